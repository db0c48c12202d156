"""A spec file's profiles: picked on the command line (else the default), deep-merged over the
file's sections, validated as the spec each produces; the CLI says which and why."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from search.spec import deep_merge, load_spec, pick_profile
from search.views.cli import main
from trainers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]

BASE = {
    "name": "t",
    "dataset": {"name": "synthetic", "val_fraction": 0.2},
    "model": {"name": "ls_convit_nano"},
    "train": {"batch_size": 32, "weight_decay": 0.05},
    "space": {
        "locality_strength": {"type": "uniform", "low": 0.5, "high": 2.0},
        "lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2},
    },
    "objectives": [{"metric": "val_acc", "mode": "max"}, {"metric": "throughput", "mode": "max"}],
    "default_profile": "small",
    "profiles": {
        "small": {"description": "a quick look", "budget": {"trials": 2, "max_epochs": 1},
                  "dataset": {"train_fraction": 0.5}},
        "big": {"description": "the full study", "budget": {"trials": 300, "max_epochs": 40, "grace_epochs": 4},
                "train": {"batch_size": 256}, "resources": {"cpus": 4, "gpus": 0.25},
                "space": {"lr": {"low": 1e-5}}},
    },
}


def _write(tmp_path: Path, data: dict, name: str = "t.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _with_profile(name: str, override: dict) -> dict:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["profiles"][name] = override
    return data


def test_deep_merge_merges_mappings_and_replaces_the_rest():
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1, "e": {"f": 1}}
    merged = deep_merge(base, {"a": {"c": [3]}, "d": None, "e": 2, "g": {"h": 1}})
    assert merged == {"a": {"b": 1, "c": [3]}, "d": None, "e": 2, "g": {"h": 1}}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1, "e": {"f": 1}}  # not changed in place


def test_the_default_profile_applies_without_profile(tmp_path):
    spec = load_spec(_write(tmp_path, BASE))
    assert spec.profile == "small"
    assert spec.budget.trials == 2 and spec.dataset.train_fraction == 0.5
    assert spec.dataset.val_fraction == 0.2 and spec.train.weight_decay == 0.05  # the file's own values stay


def test_a_profile_deep_merges_over_the_sections(tmp_path):
    spec = load_spec(_write(tmp_path, BASE), profile="big")
    assert spec.profile == "big"
    assert (spec.budget.trials, spec.budget.max_epochs, spec.budget.grace_epochs) == (300, 40, 4)
    assert spec.train.batch_size == 256 and spec.train.weight_decay == 0.05
    assert spec.resources.gpus == 0.25 and spec.resources.cpus == 4
    assert spec.space["lr"].low == 1e-5 and spec.space["lr"].high == 1e-2 and spec.space["lr"].type == "loguniform"
    assert spec.dataset.train_fraction == 1.0  # only the default profile set it
    small = load_spec(_write(tmp_path, BASE))
    assert spec.spec_hash != small.spec_hash


def test_the_profile_name_does_not_enter_the_spec_hash(tmp_path):
    # the same merged spec from two profiles: the same study
    data = _with_profile("twin", BASE["profiles"]["small"])
    path = _write(tmp_path, data)
    assert load_spec(path, profile="twin").spec_hash == load_spec(path, profile="small").spec_hash


def test_a_file_without_profiles_is_read_as_written(tmp_path):
    data = {k: v for k, v in BASE.items() if k not in ("profiles", "default_profile")}
    data["budget"] = {"trials": 3, "max_epochs": 1}
    path = _write(tmp_path, data)
    spec = load_spec(path)
    assert spec.profile == "" and spec.budget.trials == 3
    with pytest.raises(ConfigError, match=r"--profile gpu: no such profile; it has no 'profiles:' block"):
        load_spec(path, profile="gpu")


def test_an_unknown_profile_names_the_available_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"t\.yaml: --profile gpu: no such profile; use one of small, big$"):
        load_spec(_write(tmp_path, BASE), profile="gpu")


@pytest.mark.parametrize("change,message", [
    (_with_profile("big", {"budget": {"trails": 3}}), "profiles.big.budget.trails: unknown key; did you mean 'trials'?"),
    (_with_profile("big", {"budget": {"trials": 0, "max_epochs": 2}}), "profiles.big.budget.trials: must be at least 1"),
    (_with_profile("big", {"budget": {"trials": 2, "max_epochs": 2}, "resources": {"gpus": 1.5}}),
     "profiles.big.resources.gpus: above 1 must be a whole number"),
    (_with_profile("big", {"budget": {"trials": 2, "max_epochs": 2}, "space": {"lr": {"low": 0.5}}}),
     "profiles.big.space.lr.low: low (0.5) is greater than high"),
    (_with_profile("big", {"budget": {"trials": 2, "max_epochs": 2}, "bogus": 1}), "profiles.big.bogus: unknown key"),
    (_with_profile("big", {"budget": {"trials": 2, "max_epochs": 2}, "profiles": {}}),
     "profiles.big.profiles: a profile overrides the spec's sections"),
    (_with_profile("big", {"budget": {"trials": 2, "max_epochs": 2}, "space": {"depth": {"type": "int", "low": 1, "high": 0}}}),
     "profiles.big.space.depth.low: low (1.0) is greater than high"),
    (_with_profile("big", {"dataset": {"train_fraction": 0.5}}), "budget: missing; add 'budget:' (a mapping) (with profile big)"),
    ({**BASE, "default_profile": "huge"}, "default_profile: 'huge' is not a profile of this file; use one of small, big"),
    ({**BASE, "profiles": {"a b": {}}}, "profiles: 'a b' is not a usable profile name"),
    ({**BASE, "profiles": {"small": 3}}, "profiles.small: expected a mapping"),
])
def test_every_profile_is_validated_as_the_spec_it_produces(tmp_path, change, message):
    # a broken profile stops the file whichever profile is picked: found before anyone runs it
    path = _write(tmp_path, change)
    with pytest.raises(ConfigError) as exc:
        load_spec(path)
    assert str(exc.value).startswith(f"{path}: ") and message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_profile_s_knob_is_checked_against_the_model(tmp_path):
    # a knob the model does not take, added only by the non-default profile
    data = _with_profile("big", {"budget": {"trials": 2, "max_epochs": 2},
                                 "space": {"not_an_arg": {"type": "uniform", "low": 0.1, "high": 1.0}}})
    with pytest.raises(ConfigError, match=r"profiles\.big\.space\.not_an_arg: is neither a training setting"):
        load_spec(_write(tmp_path, data))


def test_pick_profile_says_why(tmp_path):
    path = _write(tmp_path, BASE)
    assert pick_profile(path) == ("small", "default; --profile big for the full study", ("small", "big"))
    assert pick_profile(path, profile="big") == ("big", "--profile big; --profile small for a quick look", ("small", "big"))
    assert pick_profile(path, profile="small")[1] == "--profile small, the default; --profile big for the full study"


def test_check_prints_the_profile_and_what_a_run_asks_for(tmp_path, capsys):
    path = _write(tmp_path, BASE)
    assert main(["check", str(path), "--profile", "big"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: ok (t: 2 knobs, 300 trials, profiles small, big)"
    assert out[1] == "  profile big (--profile big; --profile small for a quick look)"
    # no scheduler given, two objectives: mo_asha (search.spec.records.SchedulerSpec.resolved)
    assert out[2] == ("  would run 300 trials x up to 40 epochs (scheduler mo_asha, grace 4) of ls_convit_nano on 100% of "
                      "synthetic's training images, batch 256; each trial asks for 4 CPUs, 0.25 GPU (4 trials share a GPU)")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "  profile small (default; --profile big for the full study)"
    assert "2 trials x up to 1 epoch " in out[2] and "on 50% of" in out[2] and out[2].endswith("asks for 1 CPU")


def test_an_unknown_profile_on_the_command_line_is_one_line_exit_2(tmp_path, capsys):
    path = _write(tmp_path, BASE)
    for command in (["check", str(path)], ["run", str(path), "--storage", str(tmp_path / "s")]):
        assert main([*command, "--profile", "gpu"]) == 2
        err = capsys.readouterr().err
        assert err.strip() == f"error: {path}: --profile gpu: no such profile; use one of small, big"
    assert not (tmp_path / "s").exists()


def test_run_prints_the_profile_line_first(tmp_path, capsys):
    # the run stops at the dataset (a folder with nothing in it), after saying which profile
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["dataset"] = {"name": "fashion_mnist", "val_fraction": 0.1}
    path = _write(tmp_path, data)
    code = main(["run", str(path), "--profile", "big", "--storage", str(tmp_path / "s"),
                 "--data-dir", str(tmp_path / "nowhere"), "--cache-dir", str(tmp_path / "c")])
    captured = capsys.readouterr()
    assert code == 2 and "--data-dir" in captured.err
    assert captured.out.splitlines()[0] == "profile big (--profile big; --profile small for a quick look)"


def test_the_main_job_has_a_cpu_default_and_a_gpu_profile():
    path = ROOT / "spaces" / "convit_locality.yaml"
    cpu, gpu = load_spec(path), load_spec(path, profile="gpu")
    assert cpu.profile == "cpu" and cpu.scheduler.name == "mo_asha" and cpu.resources.gpus == 0
    assert gpu.profile == "gpu" and gpu.scheduler.name == "mo_asha"
    assert 0 < gpu.resources.gpus < 1 and gpu.dataset.train_fraction == 1.0
    assert gpu.budget.trials >= 100 and gpu.budget.max_epochs >= 10
    locality = {"locality_strength", "local_up_to_layer", "gate_init", "gate_lr_mult"}
    assert locality <= set(cpu.space) and locality <= set(gpu.space)

"""Choosing a model from a study: `pareto --where/--family/--select/--export`, `train`, `compare`.

Most tests read a study folder written here with the results store (no Ray, no training). One
test builds a real one-trial study on the synthetic dataset, exports its trial and retrains it.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from search import ResultsStore, filter_trials, load_trials
from search.results.filter import parse_where
from search.spec import load_spec, to_plain
from search.views.cli import main
from trainers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
SPEC = {
    "name": "tiny",
    "dataset": {"name": "synthetic", "val_fraction": 0.2},
    "models": [
        {"name": "ls_convit_nano", "args": {"depth": 3},
         "space": {"locality_strength": {"type": "uniform", "low": 0.5, "high": 2.0}}},
        {"name": "ls_gmm_nano", "space": {"num_kernels": {"type": "int", "low": 1, "high": 4}}},
    ],
    "space": {
        "lr": {"type": "loguniform", "low": 1.0e-3, "high": 1.0e-2},
        "batch_size": {"type": "choice", "values": [32, 64]},
    },
    "objectives": [{"metric": m, "mode": mode} for m, mode in OBJECTIVES],
    "budget": {"trials": 6, "max_epochs": 3, "patience": 2},
    "algorithm": {"name": "random", "seed": 7},
    "train": {"num_workers": 1, "warmup_epochs": 0.2},
    "throughput": {"batch_size": 16, "warmup": 1, "repeats": 2},
}
# trial, model, state, val_acc, throughput, params, knob values
TRIALS = [
    ("c0", "ls_convit_nano", "COMPLETE", 0.95, 1000.0, 300, {"locality_strength": 1.5, "lr": 0.002, "batch_size": 64}),
    ("c1", "ls_convit_nano", "COMPLETE", 0.90, 4000.0, 200, {"locality_strength": 0.7, "lr": 0.004, "batch_size": 32}),
    ("g2", "ls_gmm_nano", "COMPLETE", 0.70, 5000.0, 100, {"num_kernels": 3, "lr": 0.005, "batch_size": 64}),
    ("c3", "ls_convit_nano", "COMPLETE", 0.80, 3000.0, 250, {"locality_strength": 1.9, "lr": 0.003, "batch_size": 64}),
    ("g4", "ls_gmm_nano", "PRUNED", 0.99, 9000.0, 90, {"num_kernels": 1, "lr": 0.001, "batch_size": 32}),
    ("c5", "ls_convit_nano", "FAILED", None, None, None, {"locality_strength": 1.0, "lr": 0.009, "batch_size": 32}),
]
FAMILY = {"ls_convit_nano": "convit", "ls_gmm_nano": "gmm"}


def _write_study(directory: Path, spec: dict, trials: list, *, content_hash: str = "0" * 64) -> Path:
    """A study folder as `python -m search run` writes it: experiment.json and the Parquet files."""
    spec_file = directory.parent / f"{directory.name}.yaml"
    spec_file.write_text(yaml.safe_dump({**spec, "storage": str(directory.parent)}))
    parsed = load_spec(spec_file, check_model=False)
    store = ResultsStore(directory, space={k: p.to_json() for k, p in parsed.all_params().items()},
                         objectives=[(o.metric, o.mode) for o in parsed.objectives])
    now = dt.datetime.now(dt.timezone.utc)
    for trial_id, model, state, acc, tput, params, config in trials:
        row = {"trial_id": trial_id, "trial_name": f"{trial_id}_x", "experiment": parsed.name, "model": model,
               "family": FAMILY.get(model, model.split("_")[0]), "state": state,
               "stop_reason": {"COMPLETE": "max_epochs", "PRUNED": "scheduler", "FAILED": "error"}[state],
               "epochs_run": 3 if state == "COMPLETE" else 1, "val_acc": acc, "throughput": tput, "params": params,
               "flops": None if params is None else params * 1000, "seed": parsed.algorithm.seed,
               "started_at": now, "ended_at": now}
        store.add_trial(row, config)
    store.flush()
    (directory / "experiment.json").write_text(json.dumps({
        "name": parsed.name, "spec": to_plain(parsed), "spec_hash": parsed.spec_hash,
        "objectives": [[o.metric, o.mode] for o in parsed.objectives], "git_commit": None,
        "created_at": now.isoformat(), "dataset": {"content_hash": content_hash, "counts": {}},
    }))
    return directory


@pytest.fixture
def study(tmp_path) -> Path:
    return _write_study(tmp_path / "tiny", SPEC, TRIALS)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _user_error(capsys, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _front_ids(capsys, *argv: str) -> list[str]:
    code, out, err = _run(capsys, "pareto", *argv, "--format", "json")
    assert code == 0, err
    return [r["trial_id"] for r in json.loads(out)]


# -- --where, --family ---------------------------------------------------------------------------


def test_where_parses_comparisons_only():
    assert parse_where("throughput>=5000") == parse_where(" throughput >= 5000 ")
    cond = parse_where("model=='ls gmm'")
    assert (cond.column, cond.op, cond.value, cond.quoted) == ("model", "==", "ls gmm", True)
    assert parse_where("lr<1e-3").value == "1e-3"
    for bad, hint in [
        ("lr=0.1", "'=='"),
        ("lr ~ 0.1", "not a comparison"),
        ("lr>=", "no value"),
        ("__import__('os')", "not a comparison"),
        ("__import__('os').system('id')==0", "not a comparison"),
        ("val_acc>=__import__('os')", "not a number or a plain word"),
        ("val_acc>0.5; import os", "not a number or a plain word"),
        ("val_acc>=0.5 or 1==1", "not a number or a plain word"),
    ]:
        with pytest.raises(ConfigError, match=hint):
            parse_where(bad)


def test_where_narrows_the_trials_before_the_front(study, capsys):
    assert _front_ids(capsys, study) == ["c0", "c1", "g2"]
    assert _front_ids(capsys, study, "--where", "throughput>=3500") == ["c1", "g2"]
    # c3 is dominated only by c1; without c1 it is on the front of what is left.
    assert _front_ids(capsys, study, "--where", "throughput<4000") == ["c0", "c3"]
    assert _front_ids(capsys, study, "--where", "throughput<4000", "--where", "params<=250") == ["c3"]
    assert _front_ids(capsys, study, "--where", "model!=ls_gmm_nano") == ["c0", "c1"]
    assert _front_ids(capsys, study, "--where", "family=='gmm'") == ["g2"]
    assert _front_ids(capsys, study, "--where", "num_kernels>=2") == ["g2"]  # null never matches
    assert _front_ids(capsys, study, "--where", "batch_size==32") == ["c1"]
    assert _front_ids(capsys, study, "--where", "val_acc>0.99") == []
    # The PRUNED g4 passes the filter but is still not on a front of finished trials.
    assert _front_ids(capsys, study, "--where", "throughput>=5000") == ["g2"]


def test_where_errors_name_the_fix(study, capsys):
    err = _user_error(capsys, "pareto", study, "--where", "latency<5")
    assert "no column 'latency'" in err and "throughput" in err and "locality_strength" in err
    assert "'=='" in _user_error(capsys, "pareto", study, "--where", "val_acc=0.9")
    assert "holds numbers" in _user_error(capsys, "pareto", study, "--where", "throughput>=fast")
    assert "holds text" in _user_error(capsys, "pareto", study, "--where", "family>=convit")
    assert "not a comparison" in _user_error(capsys, "pareto", study, "--where", "__import__('os').system('x')")


def test_family_filter(study, capsys):
    assert _front_ids(capsys, study, "--family", "gmm") == ["g2"]
    assert _front_ids(capsys, study, "--family", "convit") == ["c0", "c1"]
    assert _front_ids(capsys, study, "--family", "convit,gmm") == ["c0", "c1", "g2"]
    assert _front_ids(capsys, study, "--family", "gmm", "--family", "convit") == ["c0", "c1", "g2"]
    err = _user_error(capsys, "pareto", study, "--family", "refiner")
    assert "refiner" in err and "convit, gmm" in err
    trials = load_trials(study)
    assert list(filter_trials(trials, where=["val_acc>=0.9"], families=["convit"])["trial_id"]) == ["c0", "c1"]


# -- --select ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule, trial", [("knee", "c1"), ("max-acc", "c0"), ("max-throughput", "g2"),
                                         ("min:params", "g2"), ("max:locality_strength", "c0")])
def test_select_prints_the_one_trial(study, capsys, rule, trial):
    code, out, err = _run(capsys, "pareto", study, "--select", rule)
    assert code == 0, err
    assert out.startswith(f"selected by {rule} from a front of 3 trials:")
    lines = dict(line.split(None, 1) for line in out.splitlines()[1:] if line and " " in line.strip())
    assert lines["trial_id"].strip() == trial
    assert "model.args.depth" in out if trial.startswith("c") else "model.args" not in out
    assert "train.num_workers" in out and "train.lr" not in out  # fixed settings, not the searched


def test_select_from_a_front_of_one_says_trial(study, capsys):
    code, out, err = _run(capsys, "pareto", study, "--select", "knee", "--family", "gmm")
    assert code == 0, err
    assert out.startswith("selected by knee from a front of 1 trial, after --family gmm:")


@pytest.mark.parametrize("n, says", [(1, "error: the only trial failed; first error:"),
                                     (2, "error: all 2 trials failed; first error:")])
def test_run_end_when_every_trial_failed(tmp_path, capsys, n, says):
    from search.views.cli import _report

    failed = [row for row in TRIALS if row[2] == "FAILED"]
    trials = [(f"f{i}", *failed[0][1:]) for i in range(n)]
    assert _report(_write_study(tmp_path / "failed", SPEC, trials)) == 1
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err


def test_select_json_and_filters(study, capsys):
    code, out, _ = _run(capsys, "pareto", study, "--select", "max-throughput", "--family", "convit", "--format", "json")
    record = json.loads(out)
    assert code == 0 and record["trial_id"] == "c1" and record["locality_strength"] == 0.7
    assert record["fixed"]["model.args.depth"] == 3 and "num_kernels" not in record
    code, out, _ = _run(capsys, "pareto", study, "--select", "max-acc", "--where", "throughput>1000")
    assert code == 0 and "after --where 'throughput>1000'" in out.splitlines()[0]


def test_select_errors(study, capsys):
    assert "unknown rule" in _user_error(capsys, "pareto", study, "--select", "best")
    err = _user_error(capsys, "pareto", study, "--select", "max:latency")
    assert "no column 'latency'" in err and "throughput" in err
    assert "no COMPLETE trial that passes --where 'val_acc>0.99'" in _user_error(
        capsys, "pareto", study, "--select", "knee", "--where", "val_acc>0.99")


# -- --export and train's checks -----------------------------------------------------------------


def test_export_writes_a_standalone_config(study, tmp_path, capsys):
    path = tmp_path / "best.yaml"
    code, out, err = _run(capsys, "pareto", study, "--export", path)  # knee by default
    assert code == 0, err
    assert "selected by knee (the default of --export" in out and f"python -m search train {path}" in out
    text = path.read_text()
    assert text.startswith("# Trial c1 of the study")
    config = yaml.safe_load(text)
    assert config["version"] == 1
    assert config["model"] == {"name": "ls_convit_nano", "args": {"depth": 3, "locality_strength": 0.7}}
    assert config["dataset"] == {"name": "synthetic", "train_fraction": 1.0, "val_fraction": 0.2,
                                 "image_size": None, "data_dir": None, "seed": 7}
    assert config["epochs"] == 3 and config["patience"] == 2 and config["seed"] == 7
    assert config["train"]["lr"] == 0.004 and config["train"]["batch_size"] == 32  # searched
    assert config["train"]["num_workers"] == 1 and config["train"]["weight_decay"] == 0.05  # fixed, default
    assert set(config["train"]) == {"batch_size", "lr", "weight_decay", "warmup_epochs", "min_lr", "label_smoothing",
                                    "grad_clip", "num_workers", "pad_crop", "flip", "precision", "compile",
                                    "cuda_graph"}
    assert config["throughput"] == {"batch_size": 16, "warmup": 1, "repeats": 2, "precision": "auto",
                                    "cuda_graph": True, "runtime": "eager", "noise_floor": 0.15}
    source = config["source"]
    assert source["study"] == str(study.resolve()) and source["trial_id"] == "c1"
    assert source["selected_by"] == "knee" and source["val_acc"] == 0.9 and source["throughput"] == 4000.0
    assert source["epochs_run"] == 3 and source["stop_reason"] == "max_epochs"

    # The other model of the conditional space: its own knobs only, an int stays an int.
    code, _, _ = _run(capsys, "pareto", study, "--select", "max-throughput", "--export", path)
    config = yaml.safe_load(path.read_text())
    assert code == 0 and config["model"] == {"name": "ls_gmm_nano", "args": {"num_kernels": 3}}
    assert config["train"]["batch_size"] == 64 and config["source"]["trial_id"] == "g2"
    assert "is a folder" in _user_error(capsys, "pareto", study, "--export", tmp_path)
    assert _run(capsys, "pareto", study, "--export", tmp_path / "new" / "best.yaml")[0] == 0  # folder created


def _exported(tmp_path, capsys, study, **changes) -> Path:
    path = tmp_path / "best.yaml"
    assert _run(capsys, "pareto", study, "--select", "max-acc", "--export", path)[0] == 0
    config = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        section, _, name = key.partition("__")
        target = config[section] if name else config
        if value is None:
            del target[name or section]
        else:
            target[name or section] = value
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"model": None}, "model: missing"),
    ({"epochs": "many"}, "epochs: expected a whole number"),
    ({"epochs": 0}, "epochs: must be at least 1"),
    ({"epoch": 3}, "epoch: unknown key; did you mean 'epochs'?"),
    ({"train__lr": -1.0}, "train.lr: must be positive"),
    ({"train__learning_rate": 0.1}, "train.learning_rate: unknown key"),
    ({"dataset__val_fraction": 1.5}, "dataset.val_fraction: must be in (0, 1)"),
    ({"version": 2}, "version: this project reads version 1"),
    ({"model__name": "no_such_model"}, "model.name: 'no_such_model' is not a registered model"),
    ({"model__args": {"depth": "deep"}}, "model.args"),
])
def test_train_rejects_a_bad_config_in_one_line(study, tmp_path, capsys, changes, message):
    path = _exported(tmp_path, capsys, study, **changes)
    err = _user_error(capsys, "train", path, "--out", tmp_path / "out")
    assert message in err and str(path) in err
    assert not (tmp_path / "out").exists()


def test_train_rejects_other_files_and_a_used_out_dir(study, tmp_path, capsys):
    assert "no such file" in _user_error(capsys, "train", tmp_path / "nope.yaml")
    spec = ROOT / "spaces" / "synthetic_smoke.yaml"
    assert "search spec, not an exported trial" in _user_error(capsys, "train", spec)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert "fix the YAML syntax" in _user_error(capsys, "train", broken)
    path = _exported(tmp_path, capsys, study)
    used = tmp_path / "best-train"  # the default out: next to the config
    used.mkdir()
    (used / "model.pt").write_bytes(b"old")
    assert "--force" in _user_error(capsys, "train", path)
    assert "must be at least 1" in _user_error(capsys, "train", path, "--epochs", "0", "--out", tmp_path / "o")


# -- compare -------------------------------------------------------------------------------------


def test_compare_puts_fronts_side_by_side(study, tmp_path, capsys):
    other = [("d0", "ls_convit_nano", "COMPLETE", 0.92, 6000.0, 150, {"locality_strength": 1.0, "lr": 0.002, "batch_size": 64}),
             ("d1", "ls_convit_nano", "COMPLETE", 0.60, 8000.0, 120, {"locality_strength": 1.2, "lr": 0.002, "batch_size": 64})]
    second = _write_study(tmp_path / "other", {**SPEC, "name": "other"}, other)
    code, out, err = _run(capsys, "compare", study, second, "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    rows = [(r["study"], r["trial_id"], r["joint_front"]) for r in data["front"]]
    # Sorted by val_acc, best first; d0 dominates c1 and g2, d1 is the fastest.
    assert rows == [("tiny", "c0", True), ("other", "d0", True), ("tiny", "c1", False),
                    ("tiny", "g2", False), ("other", "d1", True)]
    # The shared reference: the worst value over both fronts on each objective.
    assert data["reference"] == {"val_acc": 0.60, "throughput": 1000.0}
    hv = {s["study"]: s["hypervolume"] for s in data["studies"]}
    # tiny: c0 0.35 x 0 + c1 0.30 x 3000 + g2 0.10 x 1000 more; other: d0 0.32 x 5000 (d1 adds 0).
    assert hv["tiny"] == pytest.approx(0.30 * 3000 + 0.10 * 1000)
    assert hv["other"] == pytest.approx(0.32 * 5000)

    code, out, _ = _run(capsys, "compare", study, second)
    assert code == 0
    assert "hypervolume, reference point val_acc 0.6, throughput 1000" in out
    assert out.index("c0") < out.index("d0") < out.index("d1")
    code, out, _ = _run(capsys, "compare", study, second, "--family", "gmm", "--format", "json")
    assert code == 0 and [r["trial_id"] for r in json.loads(out)["front"]] == ["g2"]

    third = _write_study(tmp_path / "third", {**SPEC, "name": "third",
                                              "objectives": [{"metric": "val_acc", "mode": "max"}, {"metric": "params", "mode": "min"}]}, other)
    assert "same objectives" in _user_error(capsys, "compare", study, third)
    assert "at least two" in _user_error(capsys, "compare", study)


# -- the real thing: export a trained trial, retrain it, test it once -----------------------------


def test_exported_trial_retrains_to_the_same_architecture(tmp_path, capsys):
    import timm
    import torch

    from search.study.trainable import TrialTemplate, trial_config
    from trainers.data import DatasetRequest, prepare_dataset
    from trainers.train import train_trial

    cache = tmp_path / "cache"
    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec.update(name="one", budget={"trials": 1, "max_epochs": 1})
    spec["model"]["args"] = {"depth": 3}  # a fixed argument must reach the export too
    spec_file = tmp_path / "one.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    parsed = load_spec(spec_file, check_model=False)
    data = prepare_dataset(DatasetRequest(name="synthetic", val_fraction=0.2, seed=0), cache_dir=cache)
    template = TrialTemplate(models={"ls_convit_nano": {"depth": 3}}, data=data, epochs=1, train=parsed.train,
                             throughput=parsed.throughput, patience=None, seed=0)
    sampled = {"locality_strength": 1.7, "local_up_to_layer": 2, "lr": 3.0e-3}
    states: list[dict] = []
    outcome = train_trial(trial_config(template, sampled), on_epoch=lambda m, get_state: states.append(
        {k: tuple(v.shape) for k, v in get_state()["model"].items()}))
    measured = outcome.measurement
    trial = ("t0", "ls_convit_nano", "COMPLETE", outcome.best_val_acc, measured["throughput"], measured["params"], sampled)
    study = _write_study(tmp_path / "one", spec, [trial], content_hash=data.content_hash)

    config = tmp_path / "best.yaml"
    assert _run(capsys, "pareto", study, "--select", "max-acc", "--export", config)[0] == 0
    out = tmp_path / "retrained"
    code, stdout, err = _run(capsys, "train", config, "--out", out, "--cache-dir", cache)
    assert code == 0, err
    assert "warning" not in stdout  # the same dataset content as the study's
    assert "test_acc" in stdout and str(out / "result.parquet") in stdout

    exported = yaml.safe_load(config.read_text())
    assert exported["model"]["args"] == {"depth": 3, "locality_strength": 1.7, "local_up_to_layer": 2}
    state = torch.load(out / "model.pt", weights_only=True)
    model = timm.create_model(exported["model"]["name"], num_classes=data.num_classes, in_chans=data.channels,
                              img_size=data.image_size, **exported["model"]["args"])
    model.load_state_dict(state, strict=True)
    assert sum(p.numel() for p in model.parameters()) == measured["params"]
    assert {k: tuple(v.shape) for k, v in state.items()} == states[-1]

    table = pq.read_table(open(out / "result.parquet", "rb"))
    assert table.num_rows == 1
    row = table.to_pylist()[0]
    assert 0.0 <= row["test_acc"] <= 1.0 and row["test_loss"] > 0 and row["test_images"] == data.counts["test"]
    assert row["model"] == "ls_convit_nano" and row["family"] == "convit" and row["params"] == measured["params"]
    assert row["epochs_run"] == 1 and row["source_trial_id"] == "t0" and row["locality_strength"] == 1.7
    assert row["lr"] == 3.0e-3 and row["depth"] == 3 and row["started_at"] <= row["ended_at"]
    assert json.loads(row["model_args"]) == exported["model"]["args"]
    # A second run into the same folder is refused, and --force allows it.
    assert "--force" in _user_error(capsys, "train", config, "--out", out, "--cache-dir", cache)

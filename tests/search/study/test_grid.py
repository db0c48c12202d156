"""Grid studies (algorithm: {name: grid, seeds: N}): the spec's checks, the fixed list of configs, and
a real run SIGKILLed mid-way and resumed that trains every point exactly once per seed."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from search.spec import load_spec
from search.study.searcher import grid_searcher
from search.study.trainable import SEED_KEY
from search.views.cli import main
from tests.search.study.test_resume import _env, _read_all, _run_and_sigkill
from trainers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def _grid_spec(tmp_path: Path, **changes) -> dict:
    """spaces/synthetic_smoke.yaml as a grid: local_up_to_layer 0 or 1, lr fixed, 1 epoch, 2 seeds (4 trials)."""
    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec.update(name="grid", storage=str(tmp_path / "results"),
                space={"local_up_to_layer": {"type": "choice", "values": [0, 1]}},
                algorithm={"name": "grid", "seed": 0, "seeds": 2})
    spec["train"]["lr"] = 3.0e-3
    spec["budget"].update(trials=4, max_epochs=1)
    spec.update(changes)
    return spec


def _write(tmp_path: Path, spec: dict, name: str = "grid.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))  # the knobs in their order: the grid's
    return path


def test_a_continuous_knob_in_a_grid_is_refused_in_one_line_by_check(tmp_path):
    spec = _grid_spec(tmp_path)
    spec["space"]["lr"] = {"type": "loguniform", "low": 1e-3, "high": 1e-2}
    del spec["train"]["lr"]
    out = subprocess.run([sys.executable, "-m", "search", "check", str(_write(tmp_path, spec))], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "space.lr: grid: knob lr is continuous; list its values with type: choice" in out.stderr


@pytest.mark.parametrize("change,message", [
    ({"algorithm": {"name": "tpe", "seeds": 3}},
     "algorithm.seeds: only a grid trains each point with several seeds; remove it for tpe"),
    ({"algorithm": {"name": "grid", "seeds": 0}}, "algorithm.seeds: must be >= 1, got 0"),
    ({"space": {"depth": {"type": "int", "low": 1, "high": 2000}}},
     "space: grid of 2000 points (2000 values), more than 1000; list fewer values"),
    ({"space": {"local_up_to_layer": {"type": "choice", "values": [0, 0]}}},
     "space.local_up_to_layer: grid: knob local_up_to_layer lists a value twice"),
    ({"budget": {"trials": 4, "max_epochs": 1, "confirm": {"seeds": 2}}},
     "budget.confirm: a grid trains every point with algorithm.seeds seeds already"),
    ({"model": None, "models": [{"name": "ls_convit_nano"}, {"name": "ls_gmm_nano"}]},
     "models: a grid runs one model; conditional spaces (several models:) are not supported"),
    ({"algorithm": {"name": "grid", "seed": 2**32 - 1, "seeds": 2}}, "algorithm.seed: the grid's seeds run from"),
])
def test_grid_specs_are_checked_in_one_line(tmp_path, capsys, change, message):
    spec = _grid_spec(tmp_path)
    spec.update(change)
    spec = {k: v for k, v in spec.items() if v is not None}
    path = _write(tmp_path, spec)
    with pytest.raises(ConfigError, match=None) as info:
        load_spec(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_check_says_how_many_trials_the_grid_makes_and_notes_a_budget_that_differs(tmp_path, capsys):
    spec = _grid_spec(tmp_path, space={"local_up_to_layer": {"type": "choice", "values": [0, 1]},
                                       "depth": {"type": "int", "low": 1, "high": 5, "step": 2}})
    spec["budget"]["trials"] = 5
    assert main(["check", str(_write(tmp_path, spec))]) == 0
    out = capsys.readouterr().out
    assert "ok (grid: 2 knobs, 12 trials)" in out
    assert "would run grid of 6 points x 2 seeds = 12 trials x up to 1 epoch" in out
    assert "note: budget.trials is 5, but a grid runs every point once per seed" in out


def test_the_grid_searcher_yields_every_point_once_per_seed_seed_by_seed(tmp_path):
    spec = _grid_spec(tmp_path, space={"local_up_to_layer": {"type": "choice", "values": [0, 1]},
                                       "depth": {"type": "int", "low": 1, "high": 5, "step": 2}},
                      algorithm={"name": "grid", "seed": 7, "seeds": 2})
    loaded = load_spec(_write(tmp_path, spec))
    assert loaded.spec_hash != load_spec(_write(tmp_path, {**spec, "algorithm": {"name": "grid", "seed": 7}})).spec_hash
    searcher = grid_searcher(loaded)
    configs = []
    while (config := searcher.suggest(f"t{len(configs)}")) is not searcher.FINISHED:
        configs.append(config)
    assert len(configs) == loaded.planned_trials == 12
    assert configs[:6] == [{"local_up_to_layer": a, "depth": d, SEED_KEY: 7} for a in (0, 1) for d in (1, 3, 5)]
    assert Counter((c["local_up_to_layer"], c["depth"]) for c in configs) == {(a, d): 2 for a in (0, 1) for d in (1, 3, 5)}
    assert {c[SEED_KEY] for c in configs[6:]} == {8}  # seed k is the same at every point: the trials pair up


@pytest.mark.ray(seconds=115)
def test_the_grid_visits_every_point_exactly_seeds_times_across_a_sigkill_and_resume(tmp_path, capsys):
    spec = _grid_spec(tmp_path)
    spec["budget"]["trials"] = 3  # not what a grid runs: the note, and the study records 4
    path = _write(tmp_path, spec)
    exp = tmp_path / "results" / "grid"

    def a_trial_done_others_left() -> bool:
        done = len(_read_all(exp).get("trials.parquet", []))  # readable at every poll
        return 1 <= done < 4

    _run_and_sigkill(path, _env(tmp_path), until=a_trial_done_others_left, what="its first trial", watch=exp)
    before = _read_all(exp)["trials.parquet"]
    assert 1 <= len(before) < 4
    resumed = subprocess.run([sys.executable, "-m", "search", "resume", str(exp)], cwd=ROOT, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming study grid" in resumed.stdout and "Traceback" not in resumed.stdout + resumed.stderr

    after = _read_all(exp)
    trials = after["trials.parquet"]
    # exactly one row per (grid point, seed): none run twice, none skipped
    assert sorted((t["local_up_to_layer"], t["seed"]) for t in trials) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(t["state"] == "COMPLETE" and t["epochs_run"] == 1 for t in trials), trials
    # (a trial that finished after Tune's last snapshot is trained again, its row replaced: see
    # StoreCallback.on_step_begin; the point and seed stay one row)
    assert len({t["trial_id"] for t in trials}) == 4
    assert [p["finished"] for p in after["progress.parquet"]] == [1, 2, 3, 4]
    assert not (exp / "optuna.journal").exists()  # nothing is sampled: no Optuna study
    # each epoch reached the store through Ray with the model's mechanisms: the gates of the one GPSA
    # block (4 heads) at local_up_to_layer 1, none for the DeiT at 0; every block's per-head
    # nonlocality in both (the paper's Fig. 5 measures DeiT's too)
    layers = {t["trial_id"]: t["local_up_to_layer"] for t in trials}
    epochs = [e for e in after["epochs.parquet"] if e["trial_id"] in layers]
    assert {e["trial_id"] for e in epochs} == set(layers)
    for e in epochs:
        names = {name for name, _ in e["mechanisms"] or ()}
        gates = {f"gate.0.{h}" for h in range(4)} if layers[e["trial_id"]] == 1 else set()
        assert names == gates | {f"nonlocality.{b}.{h}" for b in range(2) for h in range(4)}, e
    meta = yaml.safe_load((exp / "experiment.json").read_text())
    assert meta["spec"]["budget"]["trials"] == 4 and meta["spec"]["algorithm"]["seeds"] == 2

    assert main(["effects", str(exp), "--objective", "val_acc"]) == 0  # the seeds pair up: 2 pairs
    out = capsys.readouterr().out
    assert "local_up_to_layer on val_acc (max), baseline local_up_to_layer=0:" in out
    assert "paired t test (Student 1908;" in out  # two points: the pairs' own variance

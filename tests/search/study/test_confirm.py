"""Confirmation seeds (budget.confirm): which configs, the replicates as real Ray trials, a kill mid-stage."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from search.results.intervals import wilson_interval
from search.spec import load_spec
from search.study.confirm import configs_to_confirm
from tests.search.study.test_resume import _env, _read_all, _run_and_sigkill

ROOT = Path(__file__).resolve().parents[3]
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]


def _row(trial_id: str, acc: float, tput: float, device: str = "cpu") -> dict:
    low, high = wilson_interval(acc, 1000)
    return {"trial_id": trial_id, "val_acc": acc, "val_acc_low": low, "val_acc_high": high, "throughput": tput,
            "throughput_low": tput * 0.85, "throughput_high": tput * 1.15, "throughput_device": device}


def test_the_front_first_then_the_trials_tied_with_it_at_most_top():
    front = [_row("f1", 0.90, 1000.0), _row("f2", 0.80, 3000.0)]
    others = [
        _row("near_f1", 0.895, 990.0),      # inside f1's intervals on both objectives
        _row("near_f2", 0.79, 2900.0),      # inside f2's
        _row("slow", 0.885, 500.0),         # accuracy overlaps f1's, throughput is apart: separated
        _row("far", 0.50, 100.0),
        _row("other_device", 0.895, 990.0, device="cuda"),  # tied by the numbers, measured elsewhere
    ]
    picked = configs_to_confirm(front, front + others, OBJECTIVES, top=10)
    assert [r["trial_id"] for r in picked] == ["f1", "f2", "near_f1", "near_f2"]
    assert [r["trial_id"] for r in configs_to_confirm(front, front + others, OBJECTIVES, top=3)] == ["f1", "f2", "near_f1"]
    assert configs_to_confirm([], others, OBJECTIVES, top=3) == []


def test_confirm_is_validated_like_the_rest_of_the_spec(tmp_path):
    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec["budget"]["confirm"] = {"seeds": 0}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = subprocess.run([sys.executable, "-m", "search", "check", str(path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "budget.confirm.seeds" in out.stderr and "Traceback" not in out.stderr
    spec["budget"]["confirm"] = {"seeds": 2}
    path.write_text(yaml.safe_dump(spec))
    assert load_spec(path).budget.confirm.top == 8


@pytest.mark.ray(seconds=155)
def test_a_kill_during_the_confirmation_resumes_to_exactly_the_replicates_asked_for(tmp_path):
    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec.update(name="confirmed", storage=str(tmp_path / "results"))
    spec["budget"].update(trials=2, max_epochs=2, confirm={"seeds": 2, "top": 1})
    path = tmp_path / "confirmed.yaml"
    path.write_text(yaml.safe_dump(spec))
    exp = tmp_path / "results" / "confirmed"

    def a_replicate_has_started() -> bool:
        tables = _read_all(exp)  # readable at every poll
        search = {t["trial_id"] for t in tables.get("trials.parquet", []) if t["replicate_of"] is None}
        return (exp / "confirm.json").is_file() and any(e["trial_id"] not in search for e in tables.get("epochs.parquet", []))

    _run_and_sigkill(path, _env(tmp_path), until=a_replicate_has_started, what="a replicate's first epoch", watch=exp)
    plan = json.loads((exp / "confirm.json").read_text())
    resumed = subprocess.run([sys.executable, "-m", "search", "resume", str(exp)], cwd=ROOT, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming the confirmation of study confirmed" in resumed.stdout, resumed.stdout[-3000:]

    after = _read_all(exp)
    trials = after["trials.parquet"]
    search = [t for t in trials if t["replicate_of"] is None]
    replicates = [t for t in trials if t["replicate_of"] is not None]
    assert len(search) == 2 and all(t["seed"] == 0 for t in search)
    confirmed = [t["trial_id"] for t in plan["trials"]]
    assert len(confirmed) == 1 and plan["trials"][0]["on_front"]
    # exactly the replicates asked for: each confirmed config once per further seed, no more
    assert sorted((t["replicate_of"], t["seed"]) for t in replicates) == sorted((c, s) for c in confirmed for s in (1, 2))
    assert all(t["state"] == "COMPLETE" for t in replicates)
    epochs = Counter((e["trial_id"], e["epoch"]) for e in after["epochs.parquet"])
    assert max(epochs.values()) == 1
    assert {e["trial_id"] for e in after["epochs.parquet"]} == {t["trial_id"] for t in trials}
    # the replicates train the same config: same knobs as their search trial
    by_id = {t["trial_id"]: t for t in search}
    for t in replicates:
        source = by_id[t["replicate_of"]]
        assert (t["locality_strength"], t["local_up_to_layer"], t["lr"]) == (
            source["locality_strength"], source["local_up_to_layer"], source["lr"])
    # the front is of configs: a confirmed member's estimate rests on its two fresh seeds, their mean
    # (the search trial that selected it apart: search.results.replicates)
    front = after["pareto.parquet"]
    assert front and {t["trial_id"] for t in front} <= {t["trial_id"] for t in search}
    for member in front:
        if member["trial_id"] in confirmed:
            seeds = [t["val_acc"] for t in replicates if t["replicate_of"] == member["trial_id"]]
            assert member["seeds"] == 2 and member["val_acc"] == pytest.approx(sum(seeds) / 2)


@pytest.mark.ray(seconds=160)
def test_a_race_killed_mid_stage_resumes_and_ends_as_its_rule_says(tmp_path):
    from search.study.race import unresolved

    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec.update(name="raced", storage=str(tmp_path / "results"))
    # one architecture and nearly one config: the search's trials are level within noise, so the race has work
    spec["space"] = {"locality_strength": {"type": "choice", "values": [1.0, 1.01]},
                     "local_up_to_layer": {"type": "choice", "values": [1]}, "lr": {"type": "choice", "values": [3e-3]}}
    spec["budget"].update(trials=2, max_epochs=1, confirm={"strategy": "race", "seeds": 2, "top": 2, "replicates": 3})
    path = tmp_path / "raced.yaml"
    path.write_text(yaml.safe_dump(spec))
    exp = tmp_path / "results" / "raced"

    def a_replicate_has_started() -> bool:
        tables = _read_all(exp)
        search = {t["trial_id"] for t in tables.get("trials.parquet", []) if t["replicate_of"] is None}
        return (exp / "confirm.json").is_file() and any(e["trial_id"] not in search for e in tables.get("epochs.parquet", []))

    _run_and_sigkill(path, _env(tmp_path), until=a_replicate_has_started, what="a replicate's first epoch", watch=exp)
    resumed = subprocess.run([sys.executable, "-m", "search", "resume", str(exp)], cwd=ROOT, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming the confirmation of study raced" in resumed.stdout, resumed.stdout[-3000:]

    plan = json.loads((exp / "confirm.json").read_text())
    assert plan["strategy"] == "race" and plan["replicates"] == 3
    trials = _read_all(exp)["trials.parquet"]
    replicates = [t for t in trials if t["replicate_of"] is not None]
    pool = {r["trial_id"] for r in plan["pool"]}
    # within the budget, to the pool, each config's seeds 1, 2, .. once each, at most 2
    assert 1 <= len(replicates) <= 3 and {t["replicate_of"] for t in replicates} <= pool
    per_config = Counter(t["replicate_of"] for t in replicates)
    for config, n in per_config.items():
        assert sorted(t["seed"] for t in replicates if t["replicate_of"] == config) == list(range(1, n + 1))
    assert max(per_config.values()) <= 2
    # it stopped for a reason its rule gives: the budget spent, or nothing left that a seed could change
    done = [t for t in replicates if t["state"] == "COMPLETE"]
    left = [c for c in unresolved(plan["pool"], done, OBJECTIVES) if per_config[c] < 2]
    assert len(replicates) == 3 or left == [], (len(replicates), left)
    assert json.loads((exp / "heldout.json").read_text())["not_tested"] == {}

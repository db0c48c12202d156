"""Confirmation replicates folded into their config: the mean over seeds, its interval, the front of configs."""

from __future__ import annotations

import datetime as dt
import json
import math

import duckdb
import pytest

import search
from search.results.intervals import wilson_interval
from search.results.replicates import fold_replicates, mean_interval
from search.results.store import ResultsStore

OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
SPACE = {"lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2}}


def _row(trial_id: str, acc: float | None, tput: float, *, state: str = "COMPLETE", of: str | None = None,
         seed: int = 0) -> dict:
    now = dt.datetime.now(dt.timezone.utc)
    low, high = wilson_interval(acc, 3000)
    return {"trial_id": trial_id, "trial_name": trial_id, "experiment": "e", "model": "m", "family": "convit",
            "state": state, "stop_reason": "max_epochs", "epochs_run": 4, "val_acc": acc, "val_images": 3000,
            "val_acc_low": low, "val_acc_high": high, "throughput": tput, "throughput_low": tput * 0.85,
            "throughput_high": tput * 1.15, "seed": seed, "replicate_of": of, "seeds": 1,
            "started_at": now, "ended_at": now, "duration_s": 1.0}


ROWS = [
    _row("a", 0.80, 1000.0),
    _row("b", 0.81, 5000.0),
    _row("c", 0.70, 900.0, state="PRUNED"),
    _row("a1", 0.82, 1000.0, of="a", seed=1),
    _row("a2", 0.84, 1000.0, of="a", seed=2),
    _row("b1", None, 5000.0, of="b", seed=1, state="FAILED"),  # a failed replicate: not a seed of b's mean
    _row("c1", 0.99, 900.0, of="c", seed=1),  # its config's search trial was pruned: nothing to fold into
]


def test_a_configs_mean_and_t_interval_by_hand():
    folded = {r["trial_id"]: r for r in fold_replicates(ROWS, OBJECTIVES)}
    assert list(folded) == ["a", "b", "c"]  # the replicates' own rows leave
    a = folded["a"]
    # mean 0.82, sd 0.02 (n - 1), t(0.975, 2) = 4.302653: half-width 4.302653 * 0.02 / sqrt(3) = 0.049683
    assert a["seeds"] == 3
    assert a["val_acc"] == pytest.approx(0.82)
    assert a["val_acc_sd"] == pytest.approx(0.02)
    assert a["val_acc_low"] == pytest.approx(0.82 - 0.049683, abs=1e-6)
    assert a["val_acc_high"] == pytest.approx(0.82 + 0.049683, abs=1e-6)
    assert (a["throughput"], a["throughput_low"]) == (1000.0, 850.0)  # the architecture's: as measured
    b = folded["b"]  # its one replicate failed: one seed, as the search measured it
    assert (b["seeds"], b["val_acc"], b["val_acc_sd"]) == (1, 0.81, None)
    assert (b["val_acc_low"], b["val_acc_high"]) == wilson_interval(0.81, 3000)
    assert (folded["c"]["seeds"], folded["c"]["val_acc"]) == (1, 0.70)


def test_seeds_that_agree_keep_at_least_the_validation_sets_own_interval():
    rows = [_row("a", 0.80, 1000.0), _row("a1", 0.80, 1000.0, of="a", seed=1)]
    (a,) = fold_replicates(rows, OBJECTIVES)
    assert a["val_acc_sd"] == 0.0
    assert (a["val_acc_low"], a["val_acc_high"]) == pytest.approx(wilson_interval(0.80, 3000))


def test_mean_interval_of_one_value_has_no_spread():
    mean, sd, low, high = mean_interval([0.5])
    assert mean == 0.5 and all(math.isnan(v) for v in (sd, low, high))


def test_the_store_the_loader_and_the_page_take_the_front_of_configs(tmp_path):
    from search.views.dashboard.server import study_payload

    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    for row in ROWS:
        store.add_trial(row, {"lr": 1e-3})
    store.flush()
    (tmp_path / "experiment.json").write_text(json.dumps({"name": "e", "objectives": [list(o) for o in OBJECTIVES]}))

    # a's mean (0.82 over 3 seeds) beats b's 0.81 but its t interval (t(2) = 4.30) overlaps b's, and b
    # is 5x faster beyond noise: a is dominated within noise, set apart with its folded mean
    front = duckdb.connect().execute(
        f"select trial_id, seeds, round(val_acc, 6), round(val_acc_sd, 6) from '{tmp_path}/pareto.parquet'").fetchall()
    assert front == [("b", 1, 0.81, None)]
    loaded = search.load(tmp_path).front(dominated=True)
    assert loaded["trial_id"].tolist() == ["b", "a"] and loaded["dominated_by"].tolist() == [None, "b"]
    assert loaded["seeds"].tolist() == [1, 3]
    assert loaded["val_acc"].tolist() == pytest.approx([0.81, 0.82])
    trials = duckdb.connect().execute(f"select trial_id, seeds, replicate_of from '{tmp_path}/trials.parquet'").fetchall()
    assert ("a1", 1, "a") in trials and len(trials) == len(ROWS)  # every seed keeps its own row
    page = study_payload(tmp_path)
    ids = page["columns"]["trial_id"]
    assert [ids[i] for i in page["front"]] == ["b"]
    assert page["columns"]["val_acc"][ids.index("a")] == pytest.approx(0.82)  # drawn at its mean
    assert page["columns"]["seeds"][ids.index("a")] == 3

"""Confirmation replicates folded into their config: the mean over seeds, its interval, the front of configs."""

from __future__ import annotations

import datetime as dt
import json
import math

import duckdb
import pytest

import search
from search.results.intervals import wilson_interval
from search.results.replicates import fold_replicates, mean_interval, pooled_sd
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


def test_a_configs_estimate_from_fresh_seeds_with_pooled_sd_and_both_noises_by_hand():
    folded = {r["trial_id"]: r for r in fold_replicates(ROWS, OBJECTIVES)}
    assert list(folded) == ["a", "b", "c"]  # the replicates' own rows leave
    a = folded["a"]
    # fresh seeds 0.82, 0.84: mean 0.83; the selecting trial's 0.80 apart, not averaged in
    assert (a["seeds"], a["selection_val_acc"]) == (2, 0.80)
    assert a["val_acc"] == pytest.approx(0.83)
    # pooled over the configs with 2+ fresh seeds (a alone): s^2 = 0.0002, sd 0.0141421, df 1
    assert a["val_acc_sd"] == pytest.approx(0.0141421, abs=1e-7) and a["val_acc_sd_df"] == 1
    # seed part 0.0002 / 2 = 1e-4; binomial part 0.83 * 0.17 / 3000 = 4.70333e-5; sum 1.470333e-4;
    # Satterthwaite df = (1.470333e-4)^2 / ((1e-4)^2 / 1) = 2.16188; t(0.975, 2.16188) = 4.008190;
    # half-width 4.008190 * sqrt(1.470333e-4) = 0.0486022
    assert a["val_acc_low"] == pytest.approx(0.83 - 0.0486022, abs=1e-6)
    assert a["val_acc_high"] == pytest.approx(0.83 + 0.0486022, abs=1e-6)
    assert (a["throughput"], a["throughput_low"]) == (1000.0, 850.0)  # the architecture's: as measured
    b = folded["b"]  # its one replicate failed: unconfirmed, one seed, as the search measured it
    assert (b["seeds"], b["val_acc"], b["selection_val_acc"]) == (1, 0.81, None)
    # ...but its interval carries the pooled seed noise too (n = 1): 0.0002 + 0.81 * 0.19 / 3000 =
    # 2.513e-4; df 1.578792; t = 5.613619; half-width 0.0889896
    assert (b["val_acc_low"], b["val_acc_high"]) == pytest.approx((0.81 - 0.0889896, 0.81 + 0.0889896), abs=1e-6)
    c = folded["c"]  # its search trial was pruned: nothing folded in, its interval as stored
    assert (c["seeds"], c["val_acc"], c["val_acc_low"]) == (1, 0.70, ROWS[2]["val_acc_low"])


def test_the_sd_is_pooled_across_configs_with_its_degrees_of_freedom():
    rows = [_row("a", 0.90, 1000.0), _row("b", 0.75, 2000.0)]
    rows += [_row(f"a{i}", v, 1000.0, of="a", seed=i) for i, v in enumerate((0.80, 0.82, 0.84), 1)]
    rows += [_row(f"b{i}", v, 2000.0, of="b", seed=i) for i, v in enumerate((0.70, 0.71), 1)]
    for r in rows:
        r["val_images"] = 6000
    a, b = fold_replicates(rows, OBJECTIVES)
    # (2 * 0.0004 + 1 * 0.00005) / (2 + 1) = 0.000283333: sd 0.0168325 on 3 degrees of freedom
    assert pooled_sd([[0.80, 0.82, 0.84], [0.70, 0.71]]) == pytest.approx((0.0168325, 3), abs=1e-7)
    assert (a["val_acc_sd"], a["val_acc_sd_df"]) == (pytest.approx(0.0168325, abs=1e-7), 3)
    # a: 0.000283333 / 3 + 0.82 * 0.18 / 6000 = 9.44444e-5 + 2.46e-5; df 4.766358; t 2.608948;
    # half-width 0.0284656
    assert (a["val_acc"], a["val_acc_low"], a["val_acc_high"]) == pytest.approx((0.82, 0.7915344, 0.8484656), abs=1e-6)
    assert (b["val_acc"], b["seeds"], b["selection_val_acc"]) == (pytest.approx(0.705), 2, 0.75)


def test_without_a_pooled_sd_a_confirmed_config_keeps_the_validation_sets_interval():
    rows = [_row("a", 0.80, 1000.0), _row("a1", 0.78, 1000.0, of="a", seed=1)]
    (a,) = fold_replicates(rows, OBJECTIVES)
    assert (a["val_acc"], a["seeds"], a["val_acc_sd"], a["val_acc_sd_df"]) == (0.78, 1, None, None)
    assert (a["val_acc_low"], a["val_acc_high"]) == pytest.approx(wilson_interval(0.78, 3000))


def test_seeds_that_agree_leave_the_validation_sets_noise():
    rows = [_row("a", 0.80, 1000.0), _row("a1", 0.80, 1000.0, of="a", seed=1), _row("a2", 0.80, 1000.0, of="a", seed=2)]
    (a,) = fold_replicates(rows, OBJECTIVES)
    assert a["val_acc_sd"] == 0.0  # the binomial part alone: the normal interval, infinite df
    half = 1.959964 * math.sqrt(0.8 * 0.2 / 3000)
    assert (a["val_acc_low"], a["val_acc_high"]) == pytest.approx((0.8 - half, 0.8 + half), abs=1e-6)


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

    # a's fresh seeds' mean (0.83) beats b's 0.81 but its interval overlaps b's, and b is 5x faster
    # beyond noise: a is dominated within noise, set apart with its estimate
    front = duckdb.connect().execute(
        f"select trial_id, seeds, round(val_acc, 6), round(val_acc_sd, 6) from '{tmp_path}/pareto.parquet'").fetchall()
    assert front == [("b", 1, 0.81, 0.014142)]  # the pooled seed SD (a's two fresh seeds) behind b's interval too
    loaded = search.load(tmp_path).front(dominated=True)
    assert loaded["trial_id"].tolist() == ["b", "a"] and loaded["dominated_by"].tolist() == [None, "b"]
    assert loaded["seeds"].tolist() == [1, 2]
    assert loaded["val_acc"].tolist() == pytest.approx([0.81, 0.83])
    trials = duckdb.connect().execute(f"select trial_id, seeds, replicate_of from '{tmp_path}/trials.parquet'").fetchall()
    assert ("a1", 1, "a") in trials and len(trials) == len(ROWS)  # every seed keeps its own row
    page = study_payload(tmp_path)
    ids = page["columns"]["trial_id"]
    assert [ids[i] for i in page["front"]] == ["b"]
    assert page["columns"]["val_acc"][ids.index("a")] == pytest.approx(0.83)  # drawn at its estimate
    assert page["columns"]["seeds"][ids.index("a")] == 2


def _tested(row: dict, acc: float | None) -> dict:
    low, high = wilson_interval(acc, 10000)
    return {**row, "test_acc": acc, "test_loss": 0.5, "test_images": 10000, "test_epoch": 4,
            "test_acc_low": low, "test_acc_high": high}


def test_the_held_out_score_folds_over_the_fresh_seeds_as_val_acc_does_by_hand():
    rows = [_tested(ROWS[0], 0.79), _tested(ROWS[1], 0.77), ROWS[2],
            _tested(ROWS[3], 0.80), _tested(ROWS[4], 0.82), *ROWS[5:]]
    folded = {r["trial_id"]: r for r in fold_replicates(rows, OBJECTIVES)}
    a = folded["a"]
    # the fresh seeds' 0.80 and 0.82 (the selecting trial's 0.79 is not averaged in): 0.81;
    # pooled test SD over a alone: s^2 = 0.0002, df 1; seed part 1e-4, binomial 0.81 * 0.19 /
    # 10000 = 1.539e-5; df_eff = 1.1539e-4^2 / 1e-8 = 1.331485; t = 7.207919; half 0.0774273
    assert a["test_acc"] == pytest.approx(0.81) and a["test_epoch"] is None
    assert a["test_acc_low"] == pytest.approx(0.81 - 0.0774273, abs=1e-6)
    assert a["test_acc_high"] == pytest.approx(0.81 + 0.0774273, abs=1e-6)
    b = folded["b"]  # unconfirmed: its own score, with the pooled seed noise at n = 1:
    # 0.0002 + 0.77 * 0.23 / 10000 = 2.1771e-4; df_eff 1.184941; t 8.857594; half 0.1306938
    assert b["test_acc"] == 0.77 and b["test_epoch"] == 4
    assert b["test_acc_low"] == pytest.approx(0.77 - 0.1306938, abs=1e-6)
    # a study whose replicates were not scored keeps each trial's own Wilson interval
    plain = {r["trial_id"]: r for r in fold_replicates([_tested(ROWS[1], 0.77), *ROWS[5:6]], OBJECTIVES)}
    assert (plain["b"]["test_acc_low"], plain["b"]["test_acc_high"]) == wilson_interval(0.77, 10000)


def test_the_trials_a_held_out_test_scores_are_the_ones_the_fronts_estimates_rest_on(tmp_path):
    from search.study.heldout import trials_to_test

    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    # a's seeds agree and beat b beyond noise; b is 5x faster: a trade-off, both on the front
    for row in [ROWS[0], ROWS[1], ROWS[2], _row("a1", 0.95, 1000.0, of="a", seed=1),
                _row("a2", 0.96, 1000.0, of="a", seed=2), *ROWS[5:]]:
        store.add_trial(row, {"lr": 1e-3})
    members = {r["trial_id"] for r in store.pareto_table().to_pylist()}
    assert members == {"a", "b"}
    # a: its fresh seeds (what its val_acc rests on); b: its failed replicate is no seed, so the search trial
    assert [r["trial_id"] for r in trials_to_test(store)] == ["a1", "a2", "b"] or \
        [r["trial_id"] for r in trials_to_test(store)] == ["b", "a1", "a2"]
    store.add_test("a1", {"test_acc": 0.8, "test_loss": 0.5, "test_images": 10000, "test_epoch": 3})
    row = next(r for r in store.trials if r["trial_id"] == "a1")
    assert (row["test_acc_low"], row["test_acc_high"]) == wilson_interval(0.8, 10000)
    assert [r["trial_id"] for r in trials_to_test(store) if r.get("test_acc") is None] in (["a2", "b"], ["b", "a2"])

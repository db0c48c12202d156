"""Intervals on the objectives and the tie rule (search/results/intervals.py), and where they show."""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import search
from search.results.intervals import bounds, mark_ties, tied_pairs, tied_with, wilson_interval
from search.views.output import front_view as format_front
from search.results.store import ResultsStore
from trainers.throughput import median_interval, with_noise_floor

OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
ROOT = Path(__file__).resolve().parents[3]


def _front(rows: list[tuple[str, float, float, float, float, float, float]]) -> pd.DataFrame:
    """(id, val_acc, low, high, throughput, low, high) rows as a front table."""
    return pd.DataFrame(rows, columns=["trial_id", "val_acc", "val_acc_low", "val_acc_high",
                                       "throughput", "throughput_low", "throughput_high"])


def test_the_tie_rule_on_a_labelled_table():
    front = _front([
        ("fast", 0.75, 0.74, 0.76, 50_000, 45_000, 55_000),   # a clear trade-off against the others
        ("mid", 0.80, 0.79, 0.81, 18_000, 16_000, 20_000),
        ("mid2", 0.79, 0.78, 0.80, 19_000, 17_000, 21_000),   # overlaps mid in both: tied
        ("slow", 0.805, 0.795, 0.815, 5_000, 4_500, 5_500),   # overlaps mid in accuracy only: not tied
    ])
    ties = dict(zip(front["trial_id"], tied_with(front, OBJECTIVES)))
    assert ties == {"fast": None, "mid": "mid2", "mid2": "mid", "slow": None}


def test_unknown_bounds_count_as_the_value_itself():
    front = _front([
        ("a", 0.80, math.nan, math.nan, 10_000, math.nan, math.nan),
        ("b", 0.80, math.nan, math.nan, 12_000, 9_000, 15_000),  # a's throughput inside b's interval, accuracy equal
        ("c", 0.79, math.nan, math.nan, 12_000, 9_000, 15_000),  # accuracy known only as 0.79 vs 0.80: apart
    ])
    assert tied_with(front, OBJECTIVES) == ["b", "a", None]
    low, high = bounds(front, "val_acc")
    assert low.tolist() == high.tolist() == [0.80, 0.80, 0.79]
    # an objective with no interval columns at all (params) is compared by its value
    assert tied_with(front.assign(params=[1, 1, 2]), OBJECTIVES + [("params", "min")]) == ["b", "a", None]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3), st.data())
def test_tied_pairs_agree_with_a_brute_force_reference(m, k, data):
    value = st.one_of(st.floats(-5, 5, allow_nan=False), st.just(math.nan))
    centres = np.array(data.draw(st.lists(st.lists(value, min_size=k, max_size=k), min_size=m, max_size=m)))
    widths = np.array(data.draw(st.lists(st.lists(st.floats(0, 3), min_size=k, max_size=k), min_size=m, max_size=m)))
    lows, highs = centres - widths, centres + widths
    expected = np.zeros((m, m), dtype=bool)
    for i in range(m):
        for j in range(m):
            if i != j:
                expected[i, j] = all(
                    not (math.isnan(lows[i, c]) or math.isnan(lows[j, c]))
                    and max(lows[i, c], lows[j, c]) <= min(highs[i, c], highs[j, c]) for c in range(k))
    got = tied_pairs(lows, highs)
    assert (got == expected).all() and (got == got.T).all()


def test_wilson_interval_matches_the_textbook_values():
    low, high = wilson_interval(0.5, 100)
    assert (round(low, 4), round(high, 4)) == (0.4038, 0.5962)  # Brown, Cai & DasGupta (2001)
    low, high = wilson_interval(1.0, 50)
    assert high == 1.0 and round(low, 4) == 0.9287  # never beyond [0, 1], unlike the Wald interval
    assert all(math.isnan(v) for v in wilson_interval(0.8, None) + wilson_interval(None, 3000))


def test_median_interval_takes_the_order_statistics_of_95_percent_coverage():
    assert median_interval(list(range(1, 11))) == (2, 9)  # n = 10: x(2), x(9), coverage 97.9%
    assert median_interval(list(range(1, 31))) == (10, 21)  # n = 30: x(10), x(21), coverage 95.7%
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95%: the range
    for n in range(6, 60):  # the coverage of the chosen ranks is at least 95%, and one rank further is not
        j = median_interval(list(range(1, n + 1)))[0]
        below = sum(math.comb(n, i) for i in range(j)) / 2**n
        below_next = below + math.comb(n, j) / 2**n
        assert 1 - 2 * below >= 0.95 > 1 - 2 * below_next


def test_the_noise_floor_widens_an_interval_and_leaves_unknown_bounds_alone():
    record = {"throughput": 1000.0, "throughput_low": 990.0, "throughput_high": 1200.0}
    assert with_noise_floor(record, 0.1) == {"throughput": 1000.0, "throughput_low": 900.0, "throughput_high": 1200.0}
    assert with_noise_floor({"throughput": 1000.0, "throughput_low": None, "throughput_high": None}, 0.1)["throughput_low"] is None


def _row(i: int, acc: float, tput: float, *, device: str = "cpu: x") -> dict:
    now = dt.datetime.now(dt.timezone.utc)
    low, high = wilson_interval(acc, 3000)
    return {"trial_id": f"t{i}", "trial_name": f"t{i}", "experiment": "e", "model": "m", "family": "convit",
            "state": "COMPLETE", "stop_reason": "max_epochs", "epochs_run": 4, "val_acc": acc, "val_images": 3000,
            "val_acc_low": low, "val_acc_high": high, "throughput": tput, "throughput_low": tput * 0.9,
            "throughput_high": tput * 1.1, "throughput_device": device, "params": 1, "flops": 1, "seed": 0,
            "started_at": now, "ended_at": now, "duration_s": 1.0}


def _ties(table: pd.DataFrame) -> dict[str, str | None]:
    return {i: (None if pd.isna(t) else t) for i, t in zip(table["trial_id"], table["tied_with"])}


def test_the_store_the_loader_and_the_table_carry_intervals_and_ties(tmp_path):
    store = ResultsStore(tmp_path, space={}, objectives=OBJECTIVES)
    for i, (acc, tput) in enumerate([(0.75, 50_000), (0.81, 18_000), (0.80, 19_000), (0.82, 5_000)]):
        store.add_trial(_row(i, acc, tput), {})
    store.flush()
    (tmp_path / "experiment.json").write_text(json.dumps({"objectives": [list(o) for o in OBJECTIVES]}))
    pareto = pq.read_table(tmp_path / "pareto.parquet").to_pandas()  # an independent reader
    # t3 (0.82, 5k) is level with t1 and t2 on accuracy and 3.6x slower beyond noise: dominated within noise
    assert _ties(pareto) == {"t1": "t2", "t2": "t1", "t0": None}
    trials = pq.read_table(tmp_path / "trials.parquet").to_pandas()
    assert trials.set_index("trial_id").loc["t2", "tied_with"] == "t1"
    assert {"val_acc_low", "val_acc_high", "throughput_low", "throughput_high", "val_images"} <= set(trials.columns)

    experiment = search.load(tmp_path)
    front = experiment.front(where=["throughput > 18500"])  # t1 gone: t2's tie goes with it
    assert _ties(front) == {"t2": None, "t0": None}
    table = format_front(experiment.front(), OBJECTIVES, fmt="table")
    assert "val_acc 95%" in table and "throughput 95%" in table and "16,200-19,800" in table
    records = json.loads(format_front(experiment.front(), OBJECTIVES, fmt="json"))
    assert {"val_acc_low", "throughput_high", "tied_with"} <= set(records[0])


def test_ties_are_looked_for_within_each_devices_front():
    front = pd.DataFrame([_row(0, 0.80, 1000, device="a"), _row(1, 0.80, 1000, device="b")])
    assert mark_ties(front, OBJECTIVES, groups="throughput_device")["tied_with"].tolist() == [None, None]
    assert mark_ties(front, OBJECTIVES)["tied_with"].tolist() == ["t1", "t0"]


def test_the_noise_floor_is_a_validated_spec_setting(tmp_path):
    from search.spec import load_spec
    from trainers.errors import ConfigError

    spec = tmp_path / "spec.yaml"
    spec.write_text((ROOT / "spaces" / "synthetic_smoke.yaml").read_text().replace(
        "throughput: {batch_size: 64, warmup: 1, repeats: 3}", "throughput: {batch_size: 64, noise_floor: 1.5}"))
    with pytest.raises(ConfigError, match=r"throughput.noise_floor: must be in \[0, 1\)"):
        load_spec(spec)
    assert load_spec(ROOT / "spaces" / "synthetic_smoke.yaml").throughput.noise_floor == pytest.approx(0.15)

"""The race-vs-fixed replay (benchmarks.race_confirmation) on a hand-made recording."""

from __future__ import annotations

import pandas as pd
import pytest

from benchmarks.race_confirmation import replay


def _recording(accuracies: dict[int, list[float]], throughputs: dict[int, float]) -> pd.DataFrame:
    rows = []
    for config, accs in accuracies.items():
        tput = throughputs[config]
        for seed, acc in enumerate(accs):
            rows.append({"config_id": config, "seed": seed, "val_acc": acc, "val_images": 3000, "throughput": tput,
                         "throughput_low": tput * 0.85, "throughput_high": tput * 1.15, "throughput_device": "cpu"})
    return pd.DataFrame(rows)


def test_both_spend_the_budget_from_one_pool_and_are_scored_on_the_held_out_seeds():
    # 0 and 1: one architecture's speed, accuracies a point apart: tied until seeds part them.
    # 2: 5x faster, far less accurate: separated from the start; 3: dominated outright.
    table = _recording({0: [0.80, 0.82, 0.81, 0.80, 0.81, 0.80], 1: [0.81, 0.79, 0.80, 0.79, 0.80, 0.79],
                        2: [0.60, 0.61, 0.60, 0.61, 0.60, 0.61], 3: [0.50, 0.51, 0.50, 0.51, 0.50, 0.51]},
                       {0: 1000.0, 1: 1050.0, 2: 5000.0, 3: 900.0})
    out = replay(table, repetitions=6, available=4, top=3, seeds_fixed=2, seed=0)
    for fixed, race in zip(out["fixed"], out["race"]):
        assert fixed["replicates"] == 6  # the pool (0, 1 and 2) x 2 seeds
        assert 0 <= race["replicates"] <= 6
        assert 1 <= race["members"] and race["separated"] <= race["members"]
        # the truth is the mean of the 2 seeds no method saw: every error is within the recording's spread
        assert 0.0 <= fixed["rmse"] <= 0.03 and 0.0 <= race["rmse"] <= 0.03


def test_a_pool_with_nothing_to_settle_races_only_until_the_seeds_spread_is_known():
    # two configs far apart on both objectives: a trade-off beyond noise; the race spends what a
    # pooled seed SD on 2 degrees of freedom takes (2 seeds each), then stops
    table = _recording({0: [0.90] * 6, 1: [0.60] * 6}, {0: 1000.0, 1: 8000.0})
    out = replay(table, repetitions=2, available=4, top=2, seeds_fixed=3, seed=1)
    assert [r["replicates"] for r in out["race"]] == [4, 4]
    assert [r["replicates"] for r in out["fixed"]] == [6, 6]
    assert out["race"][0]["rmse"] == pytest.approx(0.0) and out["race"][0]["separated"] == 2

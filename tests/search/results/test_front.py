"""The front pipeline (search/results/front.py) and its dominance-within-noise rule
(search/results/intervals.py), on labelled tables whose answers are worked out by hand."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

import search
from search.results.front import compute_front, front_groups
from search.results.intervals import dominated_by, kernel, noise_dominance, separated_groups
from search.results.pareto import pareto_mask
from search.results.store import ResultsStore
from search.views.cli import main as cli
from tests.search.results.test_intervals import OBJECTIVES, _front, _row

# The front a user was shown on a 2-core Cascade Lake Xeon (the issue "A front that means what it
# says"): (id, val_acc, its 95% interval, throughput, its 95% interval).
PRINTED = _front([
    ("2c133265", 0.8185, 0.8085, 0.8280, 5_501, 4_675, 6_326),
    ("5c506bd4", 0.8147, 0.8046, 0.8243, 5_693, 4_839, 6_547),
    ("bcdd3bd3", 0.8133, 0.8033, 0.8230, 12_518, 10_640, 14_396),
    ("df3f956c", 0.7978, 0.7875, 0.8078, 15_470, 13_150, 17_791),
    ("8c1f8a6c", 0.7887, 0.7782, 0.7988, 31_589, 26_851, 36_327),
    ("22fa73d1", 0.7590, 0.7480, 0.7697, 31_630, 26_886, 36_375),
])


def test_the_printed_front_by_hand():
    """Worked out pair by pair:
    - 22fa73d1 against 8c1f8a6c: throughput level (26,886-36,375 overlaps 26,851-36,327), accuracy
      beaten beyond noise (0.7697 < 0.7782): dominated, not a trade-off.
    - df3f956c against 8c1f8a6c: accuracy level (0.7875 <= 0.7988), throughput beaten (17,791 < 26,851).
    - 2c133265 against bcdd3bd3: accuracy level (0.8085 <= 0.8230), throughput beaten (6,326 < 10,640).
    - 5c506bd4: the same against bcdd3bd3, and against df3f956c (0.8046 <= 0.8078; 6,547 < 13,150).
    - bcdd3bd3 against 8c1f8a6c: each better beyond noise on one objective (0.8033 > 0.7988;
      14,396 < 26,851): a real trade-off; both stay, in 2 groups."""
    assert dominated_by(PRINTED, OBJECTIVES) == [  # 5c506bd4: df3f956c dominates it too, but leaves itself
        "bcdd3bd3", "bcdd3bd3", None, "8c1f8a6c", None, "8c1f8a6c"]
    trials = PRINTED.assign(state="COMPLETE", family="convit")
    front = compute_front(trials, OBJECTIVES)
    assert front["trial_id"].tolist() == ["bcdd3bd3", "8c1f8a6c"]
    assert front["tied_with"].tolist() == [None, None] and front_groups(front, OBJECTIVES) == 2
    shown = compute_front(trials, OBJECTIVES, dominated=True)
    assert shown["trial_id"].tolist() == ["bcdd3bd3", "8c1f8a6c", "2c133265", "5c506bd4", "df3f956c", "22fa73d1"]
    assert shown["dominated_by"].tolist()[:2] == [None, None]


# A main-job run on a 2-core Xeon (Sapphire Rapids, fp32): each candidate level within noise on
# accuracy with the next, and that one faster beyond noise.
CHAIN = _front([
    ("421b4934", 0.8185, 0.8085, 0.8280, 11_087, 9_424, 12_750),
    ("02ebfc76", 0.8133, 0.8033, 0.8230, 21_840, 18_564, 25_116),
    ("c601576f", 0.7987, 0.7883, 0.8086, 35_212, 29_930, 40_493),
    ("865ec472", 0.7868, 0.7763, 0.7970, 60_892, 51_758, 70_026),
])


def test_a_chain_of_dominance_within_noise_does_not_empty_the_front():
    """Pair by pair: 02ebfc76 dominates 421b4934 (0.8033 <= 0.8280, level; 18,564 > 12,750), and so
    does c601576f (0.8085 <= 0.8086, level by a hair; 29,930 > 12,750); c601576f dominates 02ebfc76 (0.7883 <= 0.8230; 29,930 > 25,116); 865ec472 dominates c601576f
    (0.7763 <= 0.8086; 51,758 > 40,493). No other pair: 865ec472 is beaten on accuracy beyond
    noise by 02ebfc76 (0.7970 < 0.8033) and 421b4934. Removing every dominated row would leave
    865ec472 alone, 3 points below the best. The kernel: 865ec472 stays (undominated), so
    c601576f leaves, so 02ebfc76 stays, so 421b4934 leaves."""
    lows, highs = np.array(CHAIN[["val_acc_low", "throughput_low"]]), np.array(CHAIN[["val_acc_high", "throughput_high"]])
    beaten = noise_dominance(lows, highs, ["max", "max"])
    assert np.argwhere(beaten).tolist() == [[0, 1], [0, 2], [1, 2], [2, 3]]
    assert kernel(beaten).tolist() == [False, True, False, True]
    assert dominated_by(CHAIN, OBJECTIVES) == ["02ebfc76", None, "865ec472", None]
    front = compute_front(CHAIN.assign(state="COMPLETE", family="convit"), OBJECTIVES)
    assert front["trial_id"].tolist() == ["02ebfc76", "865ec472"] and front_groups(front, OBJECTIVES) == 2


def test_the_kernel_by_hand():
    # no relation: all stay; a dominates b and c: both leave; a 2-cycle (a over b, b over a) is broken
    # at a, which stays, so b leaves, and c, dominated by a, leaves
    assert kernel(np.zeros((3, 3), bool)).tolist() == [True, True, True]
    assert kernel(np.array([[0, 0, 0], [1, 0, 0], [1, 0, 0]], bool)).tolist() == [True, False, False]
    assert kernel(np.array([[0, 1, 0], [1, 0, 0], [1, 0, 0]], bool)).tolist() == [True, False, False]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3), st.floats(0, 10), st.floats(0, 3)), min_size=1, max_size=9))
def test_the_kernel_is_stable_where_the_relation_has_no_cycle(rows):
    """No staying row dominates another, and every row that leaves is dominated by one that stays."""
    centre, width = np.array([[a, c] for a, _, c, _ in rows]), np.array([[b, d] for _, b, _, d in rows])
    beaten = noise_dominance(centre - width, centre + width, ["max", "max"])
    reach = beaten.astype(int)
    for _ in range(len(rows)):
        reach = np.minimum(reach + reach @ beaten.astype(int), 1)
    stays = kernel(beaten)
    if np.trace(reach) == 0:  # acyclic
        assert not beaten[np.ix_(stays, stays)].any()
    assert all(beaten[i, stays].any() for i in np.flatnonzero(~stays))


def test_level_on_both_is_a_tie_and_a_real_trade_off_stays():
    table = _front([
        ("a", 0.80, 0.79, 0.81, 10_000, 9_000, 11_000),
        ("b", 0.795, 0.785, 0.805, 10_500, 9_500, 11_500),  # level with a on both: tied, neither dominated
        ("c", 0.70, 0.69, 0.71, 20_000, 19_000, 21_000),    # worse beyond on accuracy, better beyond on speed
    ])
    assert dominated_by(table, OBJECTIVES) == [None, None, None]
    assert separated_groups(table, OBJECTIVES) == 2  # {a, b} and {c}


def test_a_minimised_objective_is_beaten_from_below():
    # rows i, j: j's interval [1, 2] lies below i's [3, 4] on a 'min' objective: j better beyond noise
    lows, highs = np.array([[3.0, 0.5], [1.0, 0.5]]), np.array([[4.0, 0.6], [2.0, 0.6]])
    assert noise_dominance(lows, highs, ["min", "max"]).tolist() == [[False, True], [False, False]]
    assert noise_dominance(lows, highs, ["max", "max"]).tolist() == [[False, False], [True, False]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12),
       st.lists(st.sampled_from(["max", "min"]), min_size=3, max_size=3))
def test_without_noise_the_rule_is_pareto_dominance(points, modes):
    """Zero-width intervals: level is equal, beyond noise is strictly better, so the relation is
    Pareto dominance and no Pareto-optimal row is dominated within noise."""
    values = np.array(points, dtype=float)
    beaten = noise_dominance(values, values, modes)
    signs = np.array([1.0 if m == "max" else -1.0 for m in modes])
    v = values * signs
    for i in range(len(v)):
        for j in range(len(v)):
            expected = i != j and bool((v[j] >= v[i]).all() and (v[j] > v[i]).any())
            assert beaten[i, j] == expected
    assert not beaten[np.ix_(pareto_mask(values, modes=modes), pareto_mask(values, modes=modes))].any()


def test_every_place_the_front_shows_leaves_the_dominated_out_or_apart(tmp_path, capsys):
    store = ResultsStore(tmp_path, space={}, objectives=OBJECTIVES)
    # t1 (0.81, 18k) and t3 (0.82, 5k): accuracy level (Wilson over 3,000 images), t3 3.6x slower
    for i, (acc, tput) in enumerate([(0.75, 50_000), (0.81, 18_000), (0.70, 80_000), (0.82, 5_000)]):
        store.add_trial(_row(i, acc, tput), {})
    store.add_progress(trial_id="t3", state="COMPLETE", elapsed_s=1.0, at=None)
    store.flush()
    (tmp_path / "experiment.json").write_text(json.dumps({"objectives": [list(o) for o in OBJECTIVES]}))
    assert pq.read_table(tmp_path / "pareto.parquet").column("trial_id").to_pylist() == ["t1", "t0", "t2"]
    trials = pq.read_table(tmp_path / "trials.parquet").to_pandas().set_index("trial_id")
    assert trials.loc["t3", "dominated_by"] == "t1" and trials["dominated_by"].notna().sum() == 1
    assert store.progress[-1]["front_size"] == 3
    assert search.load(tmp_path).front()["trial_id"].tolist() == ["t1", "t0", "t2"]

    assert cli(["pareto", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Pareto front (val_acc max, throughput max), 3 trials in 3 groups the measurements separate; "
                          "1 more dominated within noise")
    members, apart = out.split("dominated within noise, so not on the front (1)")
    assert "t3" not in members and "t3" in apart
    assert cli(["pareto", str(tmp_path), "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["trial_id"], r["dominated_by"]) for r in records] == [("t1", None), ("t0", None), ("t2", None), ("t3", "t1")]
    assert cli(["pareto", str(tmp_path), "--select", "max-acc", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["trial_id"] == "t1"  # t3 is more accurate, but not on the front


def test_json_keeps_full_float_precision(tmp_path, capsys):
    store = ResultsStore(tmp_path, space={}, objectives=OBJECTIVES)
    store.add_trial({**_row(0, 0.8123456789012345, 12345.678901234567)}, {})
    store.flush()
    (tmp_path / "experiment.json").write_text(json.dumps({"objectives": [list(o) for o in OBJECTIVES]}))
    assert cli(["pareto", str(tmp_path), "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)[0]
    assert record["val_acc"] == 0.8123456789012345 and record["throughput"] == 12345.678901234567
    assert cli(["pareto", str(tmp_path), "--select", "knee", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_acc"] == 0.8123456789012345


def test_the_front_is_one_per_device_before_the_noise_rule():
    """A slower device's member is never 'dominated within noise' by another device's."""
    rows = pd.DataFrame([_row(0, 0.80, 1_000, device="a"), _row(1, 0.80, 50_000, device="b")])
    front = compute_front(rows, OBJECTIVES, dominated=True)
    assert sorted(front["trial_id"]) == ["t0", "t1"] and front["dominated_by"].isna().all()

"""Hypervolume against hand-computed fronts and against Optuna's independent WFG implementation."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna._hypervolume import compute_hypervolume

from search import front_hypervolume, hypervolume

INF = math.inf
NAN = math.nan


def optuna_hv(values, modes, reference):
    """Optuna minimises and wants every point inside the reference: orient, drop the rest."""
    signs = np.array([-1.0 if m == "max" else 1.0 for m in modes])
    loss = np.asarray(values, dtype=float).reshape(-1, len(modes)) * signs
    ref = np.asarray(reference, dtype=float) * signs
    keep = ~np.isnan(loss).any(axis=1) & (loss <= ref).all(axis=1)
    return compute_hypervolume(loss[keep], ref)


# values, modes, reference, volume
KNOWN = [
    ([[3.0, 2.0]], ["max", "max"], [1.0, 0.0], 4.0),  # one point: its box
    ([[0.9, 100.0]], ["max", "min"], [0.5, 300.0], 0.4 * 200.0),  # min: the reference is a ceiling
    ([[2.0, 1.0], [1.0, 2.0]], ["max", "max"], [0.0, 0.0], 3.0),  # two boxes overlapping in 1x1
    ([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]], ["max", "max"], [0.0, 0.0], 6.0),  # staircase 3 + 2 + 1
    ([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]], ["min", "min"], [4.0, 4.0], 6.0),  # the same, mirrored
    ([[2.0, 2.0], [2.0, 2.0]], ["max", "max"], [0.0, 0.0], 4.0),  # duplicates count once
    ([[2.0, 2.0], [1.0, 1.0]], ["max", "max"], [0.0, 0.0], 4.0),  # a dominated point adds nothing
    ([[2.0, 0.0], [-1.0, 5.0]], ["max", "max"], [0.0, 0.0], 0.0),  # on / behind the reference
    ([[1.0, 1.0, 1.0]], ["max"] * 3, [0.0] * 3, 1.0),
    ([[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]], ["max"] * 3, [0.0] * 3, 3.0),
    ([[2.0, 1.0, 1.0], [1.0, 2.0, 1.0], [1.0, 1.0, 2.0]], ["max"] * 3, [0.0] * 3, 4.0),  # 6 - 3 + 1
    # inclusion-exclusion: boxes 3 + 8 + 9, pairwise overlaps 2 + 1 + 4, all three 1
    ([[1.0, 1.0, 3.0], [2.0, 2.0, 2.0], [3.0, 3.0, 1.0]], ["max"] * 3, [0.0] * 3, 14.0),
    ([[0.8, 500.0, 2e6]], ["max", "max", "min"], [0.5, 100.0, 3e6], 0.3 * 400.0 * 1e6),
    ([[3.0], [5.0], [NAN]], ["max"], [1.0], 4.0),  # one objective: a length
    ([], ["max", "max"], [0.0, 0.0], 0.0),
]


@pytest.mark.parametrize("values, modes, reference, volume", KNOWN)
def test_known_fronts(values, modes, reference, volume):
    assert hypervolume(values, modes=modes, reference=reference) == pytest.approx(volume, rel=1e-12)
    if values:
        assert optuna_hv(values, modes, reference) == pytest.approx(volume, rel=1e-12)


def test_nan_rows_are_ignored():
    values = [[2.0, 1.0], [NAN, 5.0], [1.0, NAN], [1.0, 2.0], [NAN, NAN]]
    assert hypervolume(values, modes=["max", "max"], reference=[0.0, 0.0]) == 3.0


def test_infinite_volume_raises_and_harmless_infinities_do_not():
    with pytest.raises(ValueError, match="infinite.*drop or cap"):
        hypervolume([[1.0, INF]], modes=["max", "max"], reference=[0.0, 0.0])
    with pytest.raises(ValueError, match="infinite"):
        hypervolume([[1.0, -INF, 1.0]], modes=["max", "min", "max"], reference=[0.0, 0.0, 0.0])
    # Infinitely bad, or infinite on a row that loses to the reference elsewhere: no volume.
    values = [[1.0, 1.0], [-INF, 5.0], [INF, -1.0]]
    assert hypervolume(values, modes=["max", "max"], reference=[0.0, 0.0]) == 1.0
    assert hypervolume([[1.0, INF]], modes=["max", "min"], reference=[0.0, 10.0]) == 0.0


@pytest.mark.parametrize(
    "values, modes, reference, message",
    [
        ([[1.0, 1.0]], ["max", "max"], [0.0], "one value per objective"),
        ([[1.0, 1.0]], ["max", "max"], [0.0, 0.0, 0.0], "one value per objective"),
        ([[1.0, 1.0]], ["max", "max"], [0.0, NAN], "finite"),
        ([[1.0, 1.0]], ["max", "max"], [-INF, 0.0], "finite"),
        ([[1.0, 1.0]], ["max", "up"], [0.0, 0.0], "'max' or 'min'"),
        ([[1.0, 1.0, 1.0]], ["max", "max"], [0.0, 0.0], r"\(n, 2\)"),
        ([1.0, 1.0], ["max", "max"], [0.0, 0.0], r"\[\[\.\.\.\]\]"),
        ([[1.0]], [], [], "one mode"),
    ],
)
def test_bad_arguments_name_the_fix(values, modes, reference, message):
    with pytest.raises(ValueError, match=message):
        hypervolume(values, modes=modes, reference=reference)


def test_200_non_dominated_points_in_3d_match_optuna():
    """A front this size has 2^200 subsets: an inclusion-exclusion algorithm would never finish
    here (speed itself is the benchmarks' business, not a timed test's)."""
    rng = np.random.default_rng(0)
    points = rng.random((200, 3))
    points /= np.linalg.norm(points, axis=1, keepdims=True)  # on a sphere: all non-dominated
    volume = hypervolume(points, modes=["max"] * 3, reference=[0.0] * 3)
    assert volume == pytest.approx(compute_hypervolume(-points, np.zeros(3)), rel=1e-12)


def test_front_hypervolume_on_a_table():
    table = pd.DataFrame(
        {
            "trial_id": ["a", "b", "c", "d"],
            "val_acc": [0.9, 0.8, 0.7, NAN],
            "throughput": [100.0, 300.0, 200.0, 1e9],
        }
    )
    objectives = [("val_acc", "max"), ("throughput", "max")]
    # a: 0.4 x 100, b: 0.3 x 300, overlap 0.3 x 100; c is dominated by b; d has no accuracy
    expected = 0.4 * 100 + 0.3 * 300 - 0.3 * 100
    assert front_hypervolume(table, objectives=objectives, reference=[0.5, 0.0]) == pytest.approx(expected)
    by_name = {"throughput": 0.0, "val_acc": 0.5}
    assert front_hypervolume(table, objectives=objectives, reference=by_name) == pytest.approx(expected)
    with pytest.raises(ValueError, match="missing"):
        front_hypervolume(table, objectives=objectives, reference={"val_acc": 0.5})
    with pytest.raises(KeyError, match="params"):
        front_hypervolume(table, objectives=objectives + [("params", "min")], reference=[0, 0, 1])


# A coarse grid makes ties and duplicates common; the reference is drawn from the same grid so
# that points on, inside and outside it all occur.
GRID = st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 4.5])
ANY = st.one_of(GRID, st.floats(-5, 5, allow_nan=False), st.just(NAN))


def _case(k: int, max_size: int):
    return st.tuples(
        st.lists(st.tuples(*(ANY,) * k), max_size=max_size),
        st.tuples(*(st.sampled_from(["max", "min"]),) * k),
        st.tuples(*(GRID,) * k),
    )


@pytest.mark.parametrize("k, max_size, examples", [(2, 40, 300), (3, 25, 200), (4, 12, 100)])
def test_matches_optuna(k, max_size, examples):
    @settings(max_examples=examples, deadline=None)
    @given(_case(k, max_size))
    def check(case):
        values, modes, reference = case
        values = np.array(values, dtype=float).reshape(len(values), k)
        ours = hypervolume(values, modes=list(modes), reference=list(reference))
        assert ours == pytest.approx(optuna_hv(values, modes, reference), rel=1e-9, abs=1e-9)

    check()


@settings(max_examples=200, deadline=None)
@given(_case(3, 15), st.data())
def test_dominated_points_and_nan_rows_change_nothing(case, data):
    values, modes, reference = case
    values = np.array(values, dtype=float).reshape(len(values), 3)
    modes = list(modes)
    before = hypervolume(values, modes=modes, reference=list(reference))
    extra = []
    finite = values[~np.isnan(values).any(axis=1)]
    if len(finite):
        # Worse than (or equal to) an existing point on every objective.
        base = finite[data.draw(st.integers(0, len(finite) - 1))]
        step = np.array(data.draw(st.tuples(*(st.floats(0, 3),) * 3)))
        extra.append(base - step * np.array([1.0 if m == "max" else -1.0 for m in modes]))
    extra.append([NAN, 100.0, -100.0])
    extra.append([NAN, NAN, NAN])
    after = hypervolume(np.vstack([values, extra]), modes=modes, reference=list(reference))
    assert after == pytest.approx(before, rel=1e-9, abs=1e-9)

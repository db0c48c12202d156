"""Pareto fronts against the definition, on labelled tables and random ones."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from search import pareto_front, pareto_mask

INF = math.inf
NAN = math.nan


def brute_force(values, modes):
    """The definition, O(n^2): i is on the front unless some j is >= everywhere and > somewhere."""
    signs = np.array([1 if m == "max" else -1 for m in modes], dtype=float)
    pts = np.asarray(values, dtype=float).reshape(len(values), len(modes)) * signs
    out = []
    for i, p in enumerate(pts):
        if np.isnan(p).any():
            out.append(False)
            continue
        dominated = any(
            not np.isnan(q).any() and (q >= p).all() and (q > p).any() for j, q in enumerate(pts) if j != i
        )
        out.append(not dominated)
    return np.array(out, dtype=bool)


# name, val_acc, throughput, on the front?
LABELLED = [
    ("fast", 0.70, 9000.0, True),
    ("accurate", 0.95, 1000.0, True),
    ("middle", 0.85, 5000.0, True),
    ("dominated", 0.80, 4000.0, False),
    ("dup_a", 0.90, 3000.0, True),  # exact duplicates do not dominate each other
    ("dup_b", 0.90, 3000.0, True),
    ("tie_acc_slower", 0.90, 2000.0, False),  # same accuracy as dup_*, slower
    ("tie_tput_worse", 0.60, 9000.0, False),  # same throughput as fast, less accurate
    ("nan_acc", NAN, 99999.0, False),  # unknown accuracy: never on the front
    ("inf_tput", 0.10, INF, True),  # infinitely fast beats everything on throughput
    ("neg_inf_tput", 0.99, -INF, True),  # most accurate; -inf is still a value
]


def test_labelled_table():
    table = pd.DataFrame(LABELLED, columns=["name", "val_acc", "throughput", "expected"])
    mask = pareto_mask(table[["val_acc", "throughput"]].to_numpy(), modes=["max", "max"])
    assert dict(zip(table["name"], mask)) == dict(zip(table["name"], table["expected"]))
    front = pareto_front(table, objectives=[("val_acc", "max"), ("throughput", "max")])
    assert list(front["name"]) == ["neg_inf_tput", "accurate", "dup_a", "dup_b", "middle", "fast", "inf_tput"]


def test_min_mode_flips_the_order():
    values = np.array([[1.0, 1.0], [2.0, 2.0], [0.5, 3.0]])
    # min a, max b: (0.5, 3) is smaller in a and larger in b than both others
    assert pareto_mask(values, modes=["min", "max"]).tolist() == [False, False, True]
    # max a, min b: (2, 2) and (1, 1) trade off; (0.5, 3) loses to (1, 1) on both
    assert pareto_mask(values, modes=["max", "min"]).tolist() == [True, True, False]


def test_empty_and_bad_shape():
    assert pareto_mask(np.zeros((0, 2)), modes=["max", "max"]).tolist() == []
    with pytest.raises(ValueError):
        pareto_mask(np.zeros((3, 3)), modes=["max", "max"])
    with pytest.raises(ValueError):
        pareto_mask(np.zeros((3, 2)), modes=["max", "up"])


values_2 = st.lists(st.tuples(*(st.sampled_from([0.0, 1.0, 2.0, 3.0, INF, -INF, NAN]),) * 2), max_size=25)
values_3 = st.lists(st.tuples(*(st.sampled_from([0.0, 1.0, 2.0, INF, NAN]),) * 3), max_size=20)
modes_2 = st.tuples(st.sampled_from(["max", "min"]), st.sampled_from(["max", "min"]))
modes_3 = st.tuples(*(st.sampled_from(["max", "min"]),) * 3)


@settings(max_examples=400, deadline=None)
@given(values_2, modes_2)
def test_two_objectives_match_the_definition(values, modes):
    arr = np.array(values, dtype=float).reshape(len(values), 2)
    assert pareto_mask(arr, modes=list(modes)).tolist() == brute_force(arr, modes).tolist()


@settings(max_examples=200, deadline=None)
@given(values_3, modes_3)
def test_three_objectives_match_the_definition(values, modes):
    arr = np.array(values, dtype=float).reshape(len(values), 3)
    assert pareto_mask(arr, modes=list(modes)).tolist() == brute_force(arr, modes).tolist()

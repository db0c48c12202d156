"""Picking one trial off a front: the named rules, their tie-breaks and their errors."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from search import pareto_mask, select

NAN = math.nan
ACC_TPUT = [("val_acc", "max"), ("throughput", "max")]


def _front():
    # Normalised (accuracy, throughput): A (1, 0), B (0.8, 0.75), C (0, 1): B is the knee.
    return pd.DataFrame(
        {
            "trial_id": ["C", "A", "B"],
            "val_acc": [0.70, 0.95, 0.90],
            "throughput": [5000.0, 1000.0, 4000.0],
            "params": [300, 100, 200],
        },
        index=[10, 11, 12],
    )


@pytest.mark.parametrize(
    "rule, trial",
    [
        ("knee", "B"),
        ("max-acc", "A"),
        ("max-throughput", "C"),
        ("min:val_acc", "C"),
        ("min:params", "A"),
        ("max:params", "C"),
    ],
)
def test_rules_on_a_known_front(rule, trial):
    row = select(_front(), objectives=ACC_TPUT, rule=rule)
    assert isinstance(row, pd.Series)
    assert row["trial_id"] == trial
    assert row.name == {"A": 11, "B": 12, "C": 10}[trial]  # the row keeps its index label


def test_knee_ignores_units_and_orients_min_objectives():
    front = _front()
    front["throughput"] *= 1e6  # min-max normalisation: units do not matter
    assert select(front, objectives=ACC_TPUT, rule="knee")["trial_id"] == "B"
    # Seconds per image instead of images/s, minimised: the same trade-off, the same knee.
    front["latency"] = 1.0 / front["throughput"]
    assert select(front, objectives=[("val_acc", "max"), ("latency", "min")], rule="knee")["trial_id"] == "B"


def test_knee_with_a_constant_objective_is_the_best_on_the_others():
    front = pd.DataFrame({"val_acc": [0.8, 0.9, 0.85], "throughput": [7.0, 7.0, 7.0]})
    assert select(front, objectives=ACC_TPUT, rule="knee").name == 1


def test_ties_go_to_the_other_objectives_then_the_lower_trial_id():
    table = pd.DataFrame(
        {
            "trial_id": ["t9", "t3", "t5", "t4"],
            "val_acc": [0.9, 0.9, 0.9, 0.8],
            "throughput": [200.0, 200.0, 100.0, 900.0],
        }
    )
    assert select(table, objectives=ACC_TPUT, rule="max-acc")["trial_id"] == "t3"
    # Symmetric knee: (0.9, 100) and (0.8, 200) are equally far from the ideal; accuracy decides.
    sym = pd.DataFrame({"trial_id": ["b", "a"], "val_acc": [0.8, 0.9], "throughput": [200.0, 100.0]})
    assert select(sym, objectives=ACC_TPUT, rule="knee")["trial_id"] == "a"
    assert select(sym, objectives=list(reversed(ACC_TPUT)), rule="knee")["trial_id"] == "b"


def test_one_row_front_returns_it_for_every_rule():
    front = _front().iloc[[1]]
    for rule in ("knee", "max-acc", "max-throughput", "min:params"):
        assert select(front, objectives=ACC_TPUT, rule=rule)["trial_id"] == "A"


def test_nan_rows_are_never_picked():
    front = pd.DataFrame({"trial_id": ["x", "y"], "val_acc": [NAN, 0.5], "throughput": [1e9, 1.0]})
    for rule in ("knee", "max-acc", "max-throughput"):
        assert select(front, objectives=ACC_TPUT, rule=rule)["trial_id"] == "y"


def test_errors_name_the_fix():
    empty = _front().iloc[:0]
    with pytest.raises(ValueError, match="no trial has completed"):
        select(empty, objectives=ACC_TPUT, rule="knee")
    with pytest.raises(ValueError, match="knee, max-acc, max-throughput"):
        select(_front(), objectives=ACC_TPUT, rule="best")
    with pytest.raises(ValueError, match="unknown rule"):
        select(_front(), objectives=ACC_TPUT, rule="max:")
    with pytest.raises(KeyError, match="flops"):
        select(_front(), objectives=ACC_TPUT, rule="min:flops")
    with pytest.raises(KeyError, match="latency"):
        select(_front(), objectives=[("latency", "min")], rule="knee")
    with pytest.raises(ValueError, match="'max' or 'min'"):
        select(_front(), objectives=[("val_acc", "up")], rule="knee")
    with pytest.raises(ValueError, match="finite"):
        select(pd.DataFrame({"val_acc": [0.1, 0.2], "throughput": [math.inf, 1.0]}), objectives=ACC_TPUT, rule="knee")


VALUE = st.sampled_from([0.0, 1.0, 2.0, 3.0, 2.5, NAN])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(VALUE, VALUE, VALUE), min_size=1, max_size=15),
    st.tuples(*(st.sampled_from(["max", "min"]),) * 3),
    st.sampled_from(["knee", "a", "b", "c"]),
)
def test_the_pick_is_never_dominated(rows, modes, rule):
    """Whatever the table, the picked row is on its Pareto front (the knee strictly prefers a
    dominating row; best-on-one-objective rules break ties on the other objectives)."""
    table = pd.DataFrame(rows, columns=["a", "b", "c"])
    objectives = list(zip("abc", modes))
    if rule != "knee":  # best on one objective, in that objective's own direction
        rule = f"{dict(objectives)[rule]}:{rule}"
    on_front = pareto_mask(table.to_numpy(), modes=list(modes))
    if not on_front.any():  # every row has a NaN
        with pytest.raises(ValueError):
            select(table, objectives=objectives, rule=rule)
        return
    row = select(table, objectives=objectives, rule=rule)
    assert on_front[table.index.get_loc(row.name)]
    if rule != "knee":
        column, mode = rule.split(":")[1], rule.split(":")[0]
        column_values = table[column][on_front]
        assert row[column] == (column_values.max() if mode == "max" else column_values.min())
    assert not np.isnan(row.to_numpy(dtype=float)).any()

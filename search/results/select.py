"""Picking one trial off a Pareto front by a named rule.

Rules:

* ``"max-acc"``: the highest ``val_acc``; ``"max-throughput"``: the highest ``throughput``.
* ``"max:<column>"`` / ``"min:<column>"``: the best row on any column, e.g. ``"min:params"``.
* ``"knee"``: the balanced trade-off. Each objective is min-max normalised over the front and
  oriented so 1 is its best value on the front and 0 its worst; the knee is the row closest
  (Euclidean) to the ideal point (1, ..., 1). An objective on which every row is equal counts
  as 1 everywhere. This is the compromise-programming choice, not a curvature estimate, and
  depends on which rows the table holds: pass the front, not all trials.

Ties go to the better row on the objectives in their listed order, then to the lower
``trial_id`` (when the table has one), then to the earlier row. Rows with a NaN objective
(or a NaN in the rule's column) are never picked, as they are never on a front.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from trainers.errors import ConfigError

__all__ = ["select", "check_rule", "RULES"]

RULES = ("knee", "max-acc", "max-throughput", "max:<column>", "min:<column>")
_NAMED = {"max-acc": ("val_acc", "max"), "max-throughput": ("throughput", "max")}


def _parse_rule(rule: str) -> tuple[str, str] | None:
    """(column, mode) for a best-on-one-column rule; None for the knee."""
    if rule == "knee":
        return None
    if rule in _NAMED:
        return _NAMED[rule]
    mode, sep, column = rule.partition(":")
    if sep and mode in ("max", "min") and column:
        return column, mode
    raise ConfigError(f"unknown rule {rule!r}; use one of {', '.join(RULES)}")


def check_rule(rule: str, *, table: pd.DataFrame | None = None) -> None:
    """Raise ConfigError unless ``rule`` is a rule and (given ``table``) its column is a numeric
    column of it."""
    target = _parse_rule(rule)
    if target is None or table is None:
        return
    if target[0] not in table.columns:
        raise ConfigError(f"--select {rule}: no column {target[0]!r}; the trials have {', '.join(map(str, table.columns))}")
    if not pd.api.types.is_numeric_dtype(table[target[0]]) or pd.api.types.is_bool_dtype(table[target[0]]):
        numeric = [str(c) for c in table.columns
                   if pd.api.types.is_numeric_dtype(table[c]) and not pd.api.types.is_bool_dtype(table[c])]
        raise ConfigError(f"--select {rule}: {target[0]!r} is not a numeric column; max: and min: take one of "
                          f"{', '.join(numeric)}")


def select(front: pd.DataFrame, *, objectives: Sequence[tuple[str, str]], rule: str) -> pd.Series:
    """The row of ``front`` that ``rule`` picks (see the module doc for the rules).

    ``objectives`` are the study's (column, mode) pairs, e.g. ``[("val_acc", "max"),
    ("throughput", "max")]``. The row comes back as a Series named by its index label.
    """
    target = _parse_rule(rule)
    objectives = [(c, m) for c, m in objectives]
    if not objectives:
        raise ValueError("objectives: list at least one (column, mode) pair")
    for _, mode in objectives:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    columns = [c for c, _ in objectives]
    needed = columns + ([target[0]] if target and target[0] not in columns else [])
    missing = [c for c in needed if c not in front.columns]
    if missing:
        raise KeyError(f"columns not in the front: {missing}; the table has {list(front.columns)}")
    if front.empty:
        raise ConfigError("the front is empty: no trial has completed yet; select once one has")

    values = front[needed].to_numpy(dtype=float, na_value=np.nan)
    usable = ~np.isnan(values).any(axis=1)
    if not usable.any():
        raise ConfigError(f"no row of the front has a value for every one of {needed}")
    # Oriented so that smaller is better: the sort keys below all ascend.
    signs = np.array([-1.0 if m == "max" else 1.0 for _, m in objectives])
    costs = values[usable, : len(columns)] * signs

    if target is None:
        if not np.isfinite(costs).all():
            raise ConfigError(
                f"the knee needs finite objective values; drop the rows with +/-inf in {columns} first"
            )
        worst, best = costs.max(axis=0), costs.min(axis=0)
        span = worst - best
        # 1 = best on the front, 0 = worst; a constant objective gives no preference (all 1).
        score = np.where(span > 0, (worst - costs) / np.where(span > 0, span, 1.0), 1.0)
        primary = np.sqrt(((1.0 - score) ** 2).sum(axis=1))
    else:
        column, mode = target
        primary = values[usable, needed.index(column)] * (-1.0 if mode == "max" else 1.0)

    keys = pd.DataFrame({"_primary": primary})
    for j in range(len(columns)):
        keys[f"_objective_{j}"] = costs[:, j]
    if "trial_id" in front.columns:
        keys["_trial_id"] = front["trial_id"].to_numpy()[usable]
    keys["_position"] = np.flatnonzero(usable)
    best = keys.sort_values(list(keys.columns), kind="stable", na_position="last").iloc[0]
    return front.iloc[int(best["_position"])]

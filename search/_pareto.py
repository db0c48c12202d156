"""Pareto fronts: which rows no other row beats on every objective.

Row a dominates row b when a is at least as good on every objective and strictly better on
one. Exact duplicates do not dominate each other, so both stay on the front. Rows with a NaN
objective are never on the front (nothing is known about them); +/-inf are ordinary values.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["pareto_mask", "pareto_front"]


def _as_maximised(values: np.ndarray, modes: Sequence[str]) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    if values.ndim != 2 or values.shape[1] != len(modes):
        raise ValueError(f"values must be (n, {len(modes)}), got shape {values.shape}")
    for mode in modes:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    signs = np.array([1.0 if m == "max" else -1.0 for m in modes])
    return values * signs


def pareto_mask(values: np.ndarray, *, modes: Sequence[str]) -> np.ndarray:
    """Boolean mask of the non-dominated rows of ``values`` (n, k), one mode per column."""
    points = _as_maximised(values, modes)
    n = points.shape[0]
    mask = np.zeros(n, dtype=bool)
    valid = ~np.isnan(points).any(axis=1)
    idx = np.flatnonzero(valid)
    if idx.size == 0:
        return mask
    if points.shape[1] == 2:
        mask[idx[_front_2d(points[idx])]] = True
    else:
        mask[idx[_front_nd(points[idx])]] = True
    return mask


def _front_2d(points: np.ndarray) -> np.ndarray:
    """Sort by the first objective (descending), then keep each point whose second objective
    beats the running maximum of every point with a strictly larger first objective."""
    a, b = points[:, 0], points[:, 1]
    order = np.lexsort((-b, -a))  # a descending, ties broken by b descending
    keep = []
    best_b_above = None  # max b over points with a strictly larger a (None: no such point)
    i = 0
    while i < order.size:
        j = i
        while j < order.size and a[order[j]] == a[order[i]]:
            j += 1
        group = order[i:j]  # same a; the first has the largest b
        top_b = b[group[0]]
        if best_b_above is None or top_b > best_b_above:
            keep.extend(int(k) for k in group if b[k] == top_b)
            best_b_above = top_b
        i = j
    return np.array(sorted(keep), dtype=int)


def _front_nd(points: np.ndarray) -> np.ndarray:
    """O(n^2) definition for three or more objectives."""
    n = points.shape[0]
    keep = np.ones(n, dtype=bool)
    for i in range(n):
        ge = (points >= points[i]).all(axis=1)
        gt = (points > points[i]).any(axis=1)
        if (ge & gt).any():
            keep[i] = False
    return np.flatnonzero(keep)


def pareto_front(table, *, objectives: Sequence[tuple[str, str]]):
    """The non-dominated rows of a pandas DataFrame, best first on the first objective.

    ``objectives`` is a list of ``(column, mode)`` pairs, e.g. ``[("val_acc", "max"),
    ("throughput", "max")]``.
    """
    columns = [c for c, _ in objectives]
    modes = [m for _, m in objectives]
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise KeyError(f"objective columns not in the table: {missing}")
    mask = pareto_mask(table[columns].to_numpy(dtype=float), modes=modes)
    front = table[mask]
    return front.sort_values(columns[0], ascending=modes[0] == "min", kind="stable")

"""Pareto fronts: which rows no other row beats on every objective.

Row a dominates row b when a is at least as good on every objective and strictly better on
one. Exact duplicates do not dominate each other, so both stay on the front. Rows with a NaN
objective are never on the front (nothing is known about them); +/-inf are ordinary values.

Throughput is a property of the device that measured it: an H100's images/s and a laptop CPU's
are not comparable. When an objective was measured on a device (``DEVICE_METRICS``) and the rows
come from several devices (``DEVICE_COLUMN``), each device gets its own front: rows compete only
with rows of the same device, unless the caller asks to mix them (``mix_devices=True``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["pareto_mask", "pareto_front", "as_maximised", "device_groups", "DEVICE_COLUMN", "DEVICE_METRICS", "RUNTIME_COLUMN"]

DEVICE_COLUMN = "throughput_device"  # the trials table's column naming the measuring device
RUNTIME_COLUMN = "throughput_runtime"  # what the timed forward ran on (eager, kernels): one per study
DEVICE_METRICS = frozenset({"throughput", "throughput_before_conversion"})  # measured on that device


def as_maximised(values: np.ndarray, modes: Sequence[str]) -> np.ndarray:
    """``values`` (n, k) with each 'min' column negated, so larger is better on every column."""
    values = np.asarray(values, dtype=float)
    if values.ndim != 2 or values.shape[1] != len(modes):
        raise ValueError(f"values must be (n, {len(modes)}), got shape {values.shape}")
    for mode in modes:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    signs = np.array([1.0 if m == "max" else -1.0 for m in modes])
    return values * signs


def device_groups(devices: Sequence | None, objectives: Sequence[tuple[str, str]], *,
                  mix_devices: bool = False) -> np.ndarray | None:
    """The ``groups`` argument of :func:`pareto_mask` for rows measured on ``devices`` (one
    name per row, None/NaN for unknown): None when the fronts need no split (no objective is
    device-measured, one device only, or ``mix_devices``)."""
    if mix_devices or devices is None or not any(c in DEVICE_METRICS for c, _ in objectives):
        return None
    names = np.asarray(["" if d is None or d != d else str(d) for d in devices], dtype=object)
    return names if len(set(names.tolist())) > 1 else None


def pareto_mask(values: np.ndarray, *, modes: Sequence[str], groups: Sequence | None = None) -> np.ndarray:
    """Boolean mask of the non-dominated rows of ``values`` (n, k), one mode per column.

    With ``groups`` (one label per row), rows compete only within their group: the union of
    one front per group."""
    if groups is not None:
        labels = np.asarray(groups, dtype=object)
        mask = np.zeros(len(labels), dtype=bool)
        values = np.asarray(values, dtype=float)
        for label in dict.fromkeys(labels.tolist()):
            rows = np.flatnonzero(labels == label)
            mask[rows] = pareto_mask(values[rows], modes=modes)
        return mask
    points = as_maximised(values, modes)
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
    beats the running maximum of every point with a strictly larger first objective.

    Vectorised: groups of equal first objective are runs of the sorted order; a group's best
    second value is its first entry; a group is on the front when that value beats the running
    maximum of the groups before it (the first group always is), and then so are its members
    that equal it (exact duplicates)."""
    a, b = points[:, 0], points[:, 1]
    order = np.lexsort((-b, -a))  # a descending, ties broken by b descending
    a_sorted, b_sorted = a[order], b[order]
    starts = np.ones(order.size, dtype=bool)
    starts[1:] = a_sorted[1:] != a_sorted[:-1]  # first entry of each group of equal a
    group = np.cumsum(starts) - 1  # group number of each sorted entry
    top_b = b_sorted[starts]  # the largest b of each group
    best_above = np.maximum.accumulate(top_b)  # max b over this group and the ones before it
    wins = np.ones(top_b.size, dtype=bool)
    wins[1:] = top_b[1:] > best_above[:-1]
    keep = wins[group] & (b_sorted == top_b[group])
    return np.sort(order[keep])


def _front_nd(points: np.ndarray, block: int = 128) -> np.ndarray:
    """Three or more objectives: a cut by a few strong points, then sort-filter-skyline in blocks.

    Dominance by *any* point is dominance, so points that one of a few strong rows (the best by
    the sum of their per-objective ranks) dominates can be dropped first, in one vectorised step.
    After a lexicographic sort of the rest (descending on every column in turn), a point can only
    be dominated by points before it (one that dominates it is >= everywhere and differs, so it
    sorts first). So they are taken a block at a time: compared with the front found so far, then
    the block's survivors with each other (enough: a block point dominated by the front or by an
    earlier point passes that dominance on). O(n * front size) numpy work in all, instead of the
    O(n^2) definition."""
    n, k = points.shape
    rows = np.arange(n)  # candidates, as row numbers of ``points``
    if n > 4096:
        ranks = np.zeros(n, dtype=np.int64)  # sum over objectives of each row's rank (0 = worst)
        for j in range(k):
            ranks[np.argsort(points[:, j], kind="stable")] += np.arange(n)
        pivots = points[np.argsort(-ranks, kind="stable")[:32]]  # (p, k)
        beaten = np.zeros(n, dtype=bool)
        for lo in range(0, n, 1 << 15):
            part = points[lo:lo + (1 << 15), None, :]  # (m, 1, k)
            beaten[lo:lo + part.shape[0]] = ((pivots >= part).all(axis=2) & (pivots > part).any(axis=2)).any(axis=1)
        rows = np.flatnonzero(~beaten)
    candidates = points[rows]
    order = np.lexsort(tuple(-candidates[:, j] for j in reversed(range(k))))
    ordered = candidates[order]
    kept: list[np.ndarray] = []  # positions in ``ordered`` of the front so far
    front = ordered[:0]
    for lo in range(0, ordered.shape[0], block):
        chunk = ordered[lo:lo + block]  # (m, k)
        alive = np.arange(chunk.shape[0])
        step = max(1, (1 << 21) // max(1, chunk.shape[0] * k))  # bound the (m, f, k) temporaries
        for f_lo in range(0, front.shape[0], step):
            if alive.size == 0:
                break
            f = front[f_lo:f_lo + step][None, :, :]  # (1, f, k)
            c = chunk[alive][:, None, :]  # (m, 1, k)
            dominated = ((f >= c).all(axis=2) & (f > c).any(axis=2)).any(axis=1)
            alive = alive[~dominated]
        if alive.size > 1:  # survivors among themselves: dom[i, j] = j dominates i
            c = chunk[alive]
            dom = (c[None, :, :] >= c[:, None, :]).all(axis=2) & (c[None, :, :] > c[:, None, :]).any(axis=2)
            alive = alive[~dom.any(axis=1)]
        if alive.size:
            kept.append(lo + alive)
            front = np.concatenate([front, chunk[alive]])
    if not kept:
        return np.zeros(0, dtype=int)
    return np.sort(rows[order[np.concatenate(kept)]])


def pareto_front(table, *, objectives: Sequence[tuple[str, str]], mix_devices: bool = False):
    """The non-dominated rows of a pandas DataFrame, best first on the first objective.

    ``objectives`` is a list of ``(column, mode)`` pairs, e.g. ``[("val_acc", "max"),
    ("throughput", "max")]``. Rows whose throughput was measured on different devices
    (``throughput_device``) get one front per device, sorted by device, unless ``mix_devices``.
    """
    columns = [c for c, _ in objectives]
    modes = [m for _, m in objectives]
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise KeyError(f"objective columns not in the table: {missing}")
    devices = table[DEVICE_COLUMN].tolist() if DEVICE_COLUMN in table.columns else None
    groups = device_groups(devices, objectives, mix_devices=mix_devices)
    mask = pareto_mask(table[columns].to_numpy(dtype=float), modes=modes, groups=groups)
    front = table[mask]
    front = front.sort_values(columns[0], ascending=modes[0] == "min", kind="stable")
    if groups is not None:
        front = front.sort_values(DEVICE_COLUMN, kind="stable", na_position="last")
    return front

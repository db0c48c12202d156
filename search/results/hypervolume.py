"""Hypervolume: how much of objective space a set of points dominates, up to a reference point.

The volume is in the objectives' own units (e.g. accuracy x images/s) after orienting each
objective so that larger is better: for a 'max' objective the reference is a lower bound, for a
'min' objective an upper bound. Each point dominates the box between itself and the reference;
the hypervolume is the volume of the union of those boxes. A point that does not strictly beat
the reference on every objective adds nothing, and rows with a NaN are skipped (nothing is known
about them), as on the Pareto front. A point that beats the reference everywhere and is infinite
on some objective (+inf on 'max', -inf on 'min') would make the volume infinite: that raises.

Exact: a sweep in two dimensions (O(n log n)); for k >= 3 objectives, slicing along the last
objective down to the 2-D sweep (HSO), O(n^(k-1) log n) on the non-dominated points -- a few
milliseconds for hundreds of points in 3-D, meant for the handful of objectives a study has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from search.results.pareto import as_maximised, pareto_mask

__all__ = ["hypervolume", "front_hypervolume"]


def hypervolume(points, *, modes: Sequence[str], reference: Sequence[float]) -> float:
    """Volume that ``points`` (n, k) dominate up to ``reference`` (k values, in the objectives'
    own units), with one mode ('max' or 'min') per column. 0.0 when no point beats the reference.
    """
    modes = list(modes)
    if not modes:
        raise ValueError("modes: list one mode ('max' or 'min') per objective")
    k = len(modes)
    values = np.asarray(points, dtype=float)
    if values.size == 0:
        values = values.reshape(0, k)
    if values.ndim == 1 and values.shape[0] == k:
        raise ValueError(f"points must be (n, {k}); wrap a single point in a list: [[...]]")
    oriented = as_maximised(values, modes)  # checks the shape and the modes

    ref = np.asarray(reference, dtype=float)
    if ref.shape != (k,):
        raise ValueError(f"reference must have one value per objective ({k}), got shape {ref.shape}")
    if not np.isfinite(ref).all():
        raise ValueError(
            f"reference must be finite, got {ref.tolist()}; pass the worst value you care about per "
            "objective (e.g. 0.0 for val_acc and throughput)"
        )
    ref = as_maximised(ref[np.newaxis, :], modes)[0]

    inside = (oriented > ref).all(axis=1)  # NaN compares False: NaN rows drop out here
    rows = np.flatnonzero(inside)
    beating = oriented[inside]
    infinite = np.isinf(beating)
    if infinite.any():
        i, j = np.argwhere(infinite)[0]
        raise ValueError(
            f"row {rows[i]} is {values[rows[i], j]} on objective {j} ({modes[j]}) and beats the "
            "reference on every objective, so the hypervolume is infinite; drop or cap that row"
        )
    if beating.shape[0] == 0:
        return 0.0
    if k >= 3:
        # Slicing costs grow with the point count; dominated points and duplicates add no volume.
        beating = np.unique(beating[pareto_mask(beating, modes=["max"] * k)], axis=0)
    # With the reference moved to the origin, each point is the far corner of its box.
    return float(_volume(beating - ref))


def _volume(points: np.ndarray) -> float:
    """Volume of the union of the boxes [0, p] over the rows p (all coordinates > 0, finite)."""
    k = points.shape[1]
    if k == 1:
        return float(points[:, 0].max())
    if k == 2:
        # Walk x from the largest down: between consecutive x values the covered height is the
        # largest y among the points at or right of that strip.
        order = np.argsort(-points[:, 0], kind="stable")
        x = points[order, 0]
        height = np.maximum.accumulate(points[order, 1])
        width = x - np.append(x[1:], 0.0)
        return float(width @ height)
    # Slice along the last objective: in the slab between consecutive values of it (from the
    # top down), the cross-section is the (k-1)-D volume of the points at or above the slab.
    order = np.argsort(-points[:, -1], kind="stable")
    ordered = points[order]
    top = ordered[:, -1]
    thickness = top - np.append(top[1:], 0.0)
    total = 0.0
    for i in np.flatnonzero(thickness > 0):
        total += thickness[i] * _volume(ordered[: i + 1, :-1])
    return total


def front_hypervolume(
    table,
    *,
    objectives: Sequence[tuple[str, str]],
    reference: Sequence[float] | Mapping[str, float],
) -> float:
    """:func:`hypervolume` of a pandas DataFrame's rows on ``objectives`` ((column, mode) pairs).

    ``reference`` is one value per objective, in the order of ``objectives`` or keyed by column.
    Dominated rows add nothing, so passing all trials or only the front gives the same number.
    """
    columns = [c for c, _ in objectives]
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise KeyError(f"objective columns not in the table: {missing}")
    if isinstance(reference, Mapping):
        unknown = sorted(set(reference) - set(columns))
        absent = [c for c in columns if c not in reference]
        if unknown or absent:
            raise ValueError(
                f"reference must have exactly the objective columns {columns} as keys; "
                f"missing {absent}, not objectives {unknown}"
            )
        reference = [reference[c] for c in columns]
    values = table[columns].to_numpy(dtype=float, na_value=np.nan)
    return hypervolume(values, modes=[m for _, m in objectives], reference=reference)

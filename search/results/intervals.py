"""Noise on the objectives: each trial's interval per objective, and which front members are tied.

A front drawn from single measurements shows differences smaller than the measurements' own
noise as trade-offs. Each objective a trial reports may carry an interval, stored beside it as
``<metric>_low`` and ``<metric>_high``:

- accuracy (``val_acc``): the Wilson score interval at 95% for a proportion measured on
  ``val_images`` images (Wilson 1927; the interval Brown, Cai & DasGupta 2001 recommend for
  binomial proportions): the noise of a finite validation set, not the seed's;
- ``throughput``: the interval the measurement stored (``trainers.throughput``: a
  distribution-free 95% interval of the median batch cost, widened to at least
  ``throughput.noise_floor`` of the value on each side);
- anything else (``params``, ``flops``, ``val_loss``, ...): no interval, the value itself.

On one objective, two members are **level within noise** when their intervals overlap, and one
is **better beyond noise** when its interval lies wholly on the better side of the other's.

- Two front members are **tied** when they are level on every objective: nothing measured
  separates them, so neither is a trade-off against the other. Tie is not transitive (a ~ b and
  b ~ c with a, c apart), so each member lists the members it is tied with.
- A member is **dominated within noise** by another when the other is at least level on every
  objective and better beyond noise on at least one: nothing measured favours it, so it is no
  trade-off. A member that overlaps another on one objective and is beaten beyond noise on the
  other is dominated, not a trade-off; a real trade-off is each member better beyond noise on a
  different objective. The relation does not chain, so a member leaves the front when a member
  that *stays* dominates it (the relation's kernel, `kernel`; ``dominated_by`` names those).
- The front's **separated groups**: its members with tied members chained into one group; the
  number of points the measurements tell apart.

A bound that is NaN (a store written before intervals were recorded) counts as the value itself:
no tie is claimed that nothing measured supports, and the tables show the bound as unknown. With
zero-width intervals the relations reduce to equality and Pareto dominance. See docs/intervals.md
for the literature (interval and probabilistic dominance).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["Z_95", "wilson_interval", "bounds", "tied_pairs", "tied_with", "mark_ties", "noise_dominance", "kernel",
           "dominated_by", "separated_groups", "INTERVAL_METRICS"]

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile
INTERVAL_METRICS = ("val_acc", "throughput")  # the objectives a trial stores an interval for


def wilson_interval(p: float | None, n: int | None, *, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``p`` observed on ``n`` trials (NaN, NaN when
    either is unknown)."""
    if p is None or n is None or not n or n < 0 or p != p or not 0.0 <= p <= 1.0:
        return math.nan, math.nan
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def bounds(table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of ``column`` for each row of a pandas DataFrame or a list of row dicts: the
    stored ``<column>_low``/``_high`` where known, else the value itself."""
    if isinstance(table, Sequence) and (not table or isinstance(table[0], Mapping)):
        def col(name: str) -> np.ndarray:
            return np.array([_float(row.get(name)) for row in table], dtype=float)
    else:
        def col(name: str) -> np.ndarray:
            if name not in table:
                return np.full(len(table), np.nan)
            return table[name].to_numpy(dtype=float, na_value=np.nan)
    value = col(column)
    low, high = col(f"{column}_low"), col(f"{column}_high")
    low = np.where(np.isnan(low), value, np.minimum(low, value))
    high = np.where(np.isnan(high), value, np.maximum(high, value))
    return low, high


def _float(value) -> float:
    return math.nan if value is None else float(value)


def tied_pairs(lows: np.ndarray, highs: np.ndarray) -> np.ndarray:
    """(m, m) boolean: rows i and j (i != j) whose intervals overlap in every column of the
    (m, k) arrays ``lows``/``highs``. A row with a NaN (its value unknown) ties with nothing."""
    lows, highs = np.asarray(lows, dtype=float), np.asarray(highs, dtype=float)
    if lows.ndim != 2 or lows.shape != highs.shape:
        raise ValueError(f"lows and highs must be (m, k) arrays of one shape, got {lows.shape} and {highs.shape}")
    overlap = (lows[:, None, :] <= highs[None, :, :]) & (lows[None, :, :] <= highs[:, None, :])  # NaN compares False
    tied = overlap.all(axis=2)
    np.fill_diagonal(tied, False)
    return tied


def noise_dominance(lows: np.ndarray, highs: np.ndarray, modes: Sequence[str]) -> np.ndarray:
    """(m, m) boolean: ``out[i, j]`` when row j dominates row i within noise (see the module doc)
    on the (m, k) interval bounds ``lows``/``highs``, one mode ('max' or 'min') per column. A row
    with a NaN bound is compared on what is known: NaN compares False, so it is neither beaten nor
    level there."""
    lows, highs = np.asarray(lows, dtype=float), np.asarray(highs, dtype=float)
    if lows.ndim != 2 or lows.shape != highs.shape or lows.shape[1] != len(modes):
        raise ValueError(f"lows and highs must be (m, {len(modes)}) arrays of one shape, got {lows.shape} and {highs.shape}")
    up = np.array([m == "max" for m in modes])
    # j above i beyond noise: j's low over i's high; below: j's high under i's low
    above = lows[None, :, :] > highs[:, None, :]
    below = highs[None, :, :] < lows[:, None, :]
    better = np.where(up, above, below)
    worse = np.where(up, below, above)
    out = better.any(axis=2) & ~worse.any(axis=2)
    np.fill_diagonal(out, False)
    return out


def _bounds_matrix(front, columns: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    pairs = [bounds(front, c) for c in columns]
    return np.stack([low for low, _ in pairs], axis=1), np.stack([high for _, high in pairs], axis=1)


def _ids(front, ids: str) -> list[str]:
    return [str(r.get(ids)) for r in front] if isinstance(front, Sequence) else [str(v) for v in front[ids].tolist()]


def kernel(beaten: np.ndarray) -> np.ndarray:
    """(m,) boolean: the rows that stay, given ``beaten[i, j]`` (row j dominates row i within noise,
    `noise_dominance`): the relation's kernel, the one set whose rows no staying row dominates and
    whose every other row a staying row dominates (von Neumann & Morgenstern 1944's stable set;
    unique when the relation has no cycle, Richardson 1953). Decided from the undominated rows on:
    a row leaves once a staying row dominates it, and stays once every row that dominates it has
    left. The relation can have cycles (random interval sets of 7 rows on 2 objectives show
    some): one that leaves rows undecided is broken at its first row (a front's order: best on the
    first objective first), which stays."""
    beaten = np.asarray(beaten, dtype=bool)
    stays: list[bool | None] = [None] * len(beaten)
    while None in stays:
        progress = False
        for i in (i for i, s in enumerate(stays) if s is None):
            over = [stays[j] for j in np.flatnonzero(beaten[i])]
            if True in over:
                stays[i], progress = False, True
            elif all(s is False for s in over):
                stays[i], progress = True, True
        if not progress:  # a cycle among the undecided: broken at its first row
            stays[stays.index(None)] = True
    return np.array(stays, dtype=bool)


def dominated_by(front, objectives: Sequence[tuple[str, str]], *, ids: str = "trial_id") -> list[str | None]:
    """For each row of ``front`` (a DataFrame or a list of row dicts), None when it stays on the
    front, else the ``ids`` of the staying rows that dominate it within noise, comma-separated.

    Dominance within noise does not chain (level within noise does not), so a row dominated only
    by rows that are themselves dominated stays: the front is the relation's `kernel`. Without
    that, a chain a > b > c > d, each step level on accuracy and faster beyond noise, would empty
    the front down to its fastest, least accurate end."""
    if not objectives or not len(front):
        return [None] * len(front)
    lows, highs = _bounds_matrix(front, [c for c, _ in objectives])
    beaten = noise_dominance(lows, highs, [m for _, m in objectives])
    stays = kernel(beaten)
    names = _ids(front, ids)
    return [None if stays[i] else ", ".join(names[j] for j in np.flatnonzero(row & stays))
            for i, row in enumerate(beaten)]


def separated_groups(front, objectives: Sequence[tuple[str, str]]) -> int:
    """How many groups ``front``'s rows fall into when rows tied with each other (level within noise
    on every objective), chained, count as one: the points its measurements tell apart."""
    if not objectives or not len(front):
        return 0
    lows, highs = _bounds_matrix(front, [c for c, _ in objectives])
    tied = tied_pairs(lows, highs)
    group = list(range(len(tied)))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i, j in zip(*np.nonzero(tied)):
        group[root(int(i))] = root(int(j))
    return len({root(i) for i in range(len(group))})


def tied_with(front, objectives: Sequence[tuple[str, str]], *, ids: str = "trial_id") -> list[str | None]:
    """For each row of ``front`` (a DataFrame or a list of row dicts), the ``ids`` of the other rows
    it is tied with, comma-separated, or None when its measurements separate it from all of them."""
    if not objectives or not len(front):
        return []
    tied = tied_pairs(*_bounds_matrix(front, [c for c, _ in objectives]))
    names = _ids(front, ids)
    return [", ".join(names[j] for j in np.flatnonzero(row)) or None for row in tied]


def mark_ties(front, objectives: Sequence[tuple[str, str]], *, groups: str | None = None):
    """A copy of the DataFrame ``front`` with its ``tied_with`` column (see :func:`tied_with`),
    looking for ties within each value of the column ``groups`` (each device's front) when given."""
    out = front.copy()
    out["tied_with"] = None
    keys = out[groups].fillna("") if groups is not None and groups in out else None
    for key in ([None] if keys is None else dict.fromkeys(keys.tolist())):
        rows = out if keys is None else out[keys == key]
        out.loc[rows.index, "tied_with"] = _objects(tied_with(rows, objectives))
    return out


def _objects(values: list[str | None]):
    """``values`` as an object array (pandas keeps None as None there, not NaN)."""
    return np.array(values, dtype=object)

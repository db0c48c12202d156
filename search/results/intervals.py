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

Two front members are **tied** when their intervals overlap on every objective: nothing measured
separates them, so neither is a trade-off against the other. A bound that is NaN (a store written
before intervals were recorded) counts as the value itself: no tie is claimed that nothing
measured supports, and the tables show the bound as unknown. Tie is not transitive (a ~ b and
b ~ c with a, c apart), so each member lists the members it is tied with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["Z_95", "wilson_interval", "bounds", "tied_pairs", "tied_with", "mark_ties", "INTERVAL_METRICS"]

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


def tied_with(front, objectives: Sequence[tuple[str, str]], *, ids: str = "trial_id") -> list[str | None]:
    """For each row of ``front`` (a DataFrame or a list of row dicts), the ``ids`` of the other rows
    it is tied with, comma-separated, or None when its measurements separate it from all of them."""
    columns = [c for c, _ in objectives]
    pairs = [bounds(front, c) for c in columns]
    if not pairs or not len(pairs[0][0]):
        return []
    lows = np.stack([low for low, _ in pairs], axis=1)
    highs = np.stack([high for _, high in pairs], axis=1)
    tied = tied_pairs(lows, highs)
    names = [str(r.get(ids)) for r in front] if isinstance(front, Sequence) else [str(v) for v in front[ids].tolist()]
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

"""Confirmation replicates folded into their config's row: the front of configs, not of seeds.

A study with ``budget.confirm`` trains the front's configs again with further seeds
(``search.study.confirm``); each such trial's row names the search trial it replicates in
``replicate_of``. The front is then taken over configs: a search trial's row is replaced by the
mean over its COMPLETE seeds (its own and its replicates'), and the replicates' own rows leave
the front's candidates. A config's accuracy interval is the wider of

- the t interval of the mean over its seeds at 95% (Student 1908): the seed's noise, and
- the Wilson interval of the mean over ``val_images`` (as for one seed, see
  ``search.results.intervals``): every seed is scored on the same validation images, so their
  spread does not show that set's own noise.

``seeds`` says how many seeds a row rests on, ``val_acc_sd`` their standard deviation (n - 1).
Objectives measured on a device (throughput) are the architecture's, the same for every seed:
the search trial's measurement and interval stay. Other objectives (``val_loss``) are means.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from search.results.intervals import wilson_interval
from search.results.pareto import DEVICE_METRICS

__all__ = ["REPLICATE_COLUMN", "fold_replicates", "has_replicates", "mean_interval"]

REPLICATE_COLUMN = "replicate_of"  # the trials table's column: the search trial a replicate trains again


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def has_replicates(rows: Iterable[Mapping[str, Any]]) -> bool:
    return any(not _missing(r.get(REPLICATE_COLUMN)) for r in rows)


def mean_interval(values: Sequence[float], *, confidence: float = 0.95) -> tuple[float, float, float, float]:
    """(mean, sd, low, high) of ``values``: Student's t interval of the mean; sd and the bounds
    are NaN for a single value."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan, math.nan
    from scipy import stats  # only where replicates exist

    sd = statistics.stdev(values)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return mean, sd, mean - half, mean + half


def fold_replicates(rows: Sequence[Mapping[str, Any]], objectives: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """The search trials' rows (``replicate_of`` empty), each with ``seeds`` set and, where it has
    COMPLETE replicates and is COMPLETE itself, its objectives averaged over them (see the module
    doc). Rows come back in their order; the replicates' own rows are left out."""
    replicas: dict[Any, list[Mapping[str, Any]]] = {}
    for r in rows:
        if not _missing(r.get(REPLICATE_COLUMN)) and r.get("state") == "COMPLETE":
            replicas.setdefault(r[REPLICATE_COLUMN], []).append(r)
    out = []
    for row in rows:
        if not _missing(row.get(REPLICATE_COLUMN)):
            continue
        folded = dict(row)
        group = [row, *replicas.get(row.get("trial_id"), ())] if row.get("state") == "COMPLETE" else [row]
        folded["seeds"] = len(group)
        folded["val_acc_sd"] = None
        if len(group) > 1:
            for column, _ in objectives:
                if column in DEVICE_METRICS:
                    continue
                values = [float(r[column]) for r in group if not _missing(r.get(column))]
                if len(values) != len(group):  # an objective a seed lacks: the config is not known
                    folded[column] = math.nan
                    continue
                mean, sd, low, high = mean_interval(values)
                folded[column] = mean
                if column == "val_acc":
                    w_low, w_high = wilson_interval(mean, _int(row.get("val_images")))
                    folded["val_acc_sd"] = sd
                    folded["val_acc_low"] = max(0.0, min(low, w_low) if w_low == w_low else low)
                    folded["val_acc_high"] = min(1.0, max(high, w_high) if w_high == w_high else high)
        out.append(folded)
    return out


def _int(value: Any) -> int | None:
    return None if _missing(value) else int(value)

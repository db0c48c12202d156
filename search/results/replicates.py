"""Confirmation replicates folded into their config's row: the front of configs, not of seeds.

A study with ``budget.confirm`` trains the front's configs again with fresh seeds
(``search.study.confirm``); each such trial's row names the search trial it replicates in
``replicate_of``. The front is then taken over configs: a search trial's row stands for its
config, and the replicates' own rows leave the front's candidates.

- **The estimate comes from the fresh seeds alone.** The search trial was chosen because its
  number was high: averaging it in carries the winner's curse into the estimate (the selected
  maximum of noisy values is biased upwards; Thaler 1988, and in hyperparameter selection
  Cawley & Talbot 2010). A confirmed config's ``val_acc`` is the mean over its COMPLETE
  replicates; the search trial's own value is kept apart in ``selection_val_acc``.
- **One seed SD, pooled across the confirmed configs.** With 3 seeds a config's own SD has 2
  degrees of freedom and varies several-fold by luck; the configs share a training recipe, so
  their seed variances are pooled (the pooled variance of a one-way layout: sum of (n_i - 1)
  s_i^2 over sum of (n_i - 1)), with its degrees of freedom in ``val_acc_sd_df``. Only the fresh
  seeds enter it, and only configs with two or more of them.
- **The two noises add.** Every seed is scored on the same ``val_images``, so their spread does
  not show that set's own sampling noise, which all of them share. The variance of the estimate
  is ``sd_p^2 / n + p (1 - p) / val_images``: the seeds' part, with ``df`` degrees of freedom,
  and the validation set's binomial part (normal approximation), known exactly. The 95% interval
  is ``p +- t(0.975, df_eff) * sqrt(that)``, with ``df_eff`` from Welch-Satterthwaite
  (Satterthwaite 1946): ``(a + b)^2 / (a^2 / df)`` for the seed part ``a`` and the binomial part
  ``b``.
- **Every member's interval means the same thing.** Where the study has a pooled seed SD, a
  config that was not confirmed (one seed: the search trial's) gets the same combined interval
  with ``n = 1``, so confirmed and unconfirmed members are compared on one footing. A study with
  no pooled SD (no config has two fresh seeds) keeps each config's Wilson interval: the seed's
  noise is then unknown, as in a study without confirmation.

``seeds`` says how many seeds a row's estimate rests on (a confirmed config: its fresh seeds),
``val_acc_sd`` the pooled seed SD behind its interval (null: unknown). Objectives measured on a
device (throughput) are the architecture's, the same for every seed: the search trial's
measurement and interval stay. Other objectives (``val_loss``) are means over the fresh seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from search.results.intervals import wilson_interval
from search.results.pareto import DEVICE_METRICS

__all__ = ["REPLICATE_COLUMN", "fold_replicates", "has_replicates", "mean_interval", "pooled_sd", "combined_interval"]

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


def pooled_sd(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """(sd, df): the pooled standard deviation of the ``groups`` of values (each a config's fresh
    seeds), sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1)), and its degrees of freedom sum (n_i - 1);
    (NaN, 0) when no group has two values."""
    df = sum(len(g) - 1 for g in groups if len(g) > 1)
    if df == 0:
        return math.nan, 0
    squares = sum((len(g) - 1) * statistics.variance(g) for g in groups if len(g) > 1)
    return math.sqrt(squares / df), df


def combined_interval(p: float, *, n: int, sd: float, df: int, val_images: int | None,
                      confidence: float = 0.95) -> tuple[float, float]:
    """The interval of an accuracy ``p`` that is the mean of ``n`` seeds with pooled seed SD ``sd``
    (``df`` degrees of freedom), all scored on the same ``val_images`` images: seed and binomial
    variances added, Student's t at the Welch-Satterthwaite degrees of freedom (see the module doc)."""
    from scipy import stats  # only where replicates exist

    seed_part = sd * sd / n
    binomial = p * (1 - p) / val_images if val_images else 0.0
    total = seed_part + binomial
    if total == 0:
        return p, p
    df_eff = math.inf if seed_part == 0 else total * total / (seed_part * seed_part / df)
    half = float(stats.t.ppf(0.5 + confidence / 2, df_eff)) * math.sqrt(total)
    return max(0.0, p - half), min(1.0, p + half)


def fold_replicates(rows: Sequence[Mapping[str, Any]], objectives: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """The search trials' rows (``replicate_of`` empty), each with ``seeds`` set and, where it is
    COMPLETE and has COMPLETE replicates, its objectives estimated from those (see the module doc).
    The held-out ``test_acc`` (search.study.heldout) folds the same way, over the seeds scored.
    Rows come back in their order; the replicates' own rows are left out."""
    replicas: dict[Any, list[Mapping[str, Any]]] = {}
    for r in rows:
        if not _missing(r.get(REPLICATE_COLUMN)) and r.get("state") == "COMPLETE":
            replicas.setdefault(r[REPLICATE_COLUMN], []).append(r)
    pooled = {column: pooled_sd([[float(r[column]) for r in group if not _missing(r.get(column))]
                                 for group in replicas.values()])
              for column in ("val_acc", "test_acc")}
    sd, df = pooled["val_acc"]
    out = []
    for row in rows:
        if not _missing(row.get(REPLICATE_COLUMN)):
            continue
        folded = dict(row)
        fresh = list(replicas.get(row.get("trial_id"), ())) if row.get("state") == "COMPLETE" else []
        folded["seeds"] = len(fresh) or 1
        folded["val_acc_sd"] = None if df == 0 else sd
        folded["val_acc_sd_df"] = None if df == 0 else df
        folded["selection_val_acc"] = row.get("val_acc") if fresh else None
        for column, _ in objectives if fresh else ():
            if column in DEVICE_METRICS:
                continue
            values = [float(r[column]) for r in fresh if not _missing(r.get(column))]
            # an objective a seed lacks: the config is not known
            folded[column] = statistics.fmean(values) if len(values) == len(fresh) else math.nan
        if row.get("state") == "COMPLETE":
            _accuracy_interval(folded, "val_acc", "val_images", seeds=folded["seeds"], pooled=pooled["val_acc"],
                               confirmed=bool(fresh))
            if fresh:  # the held-out score of a confirmed config: its fresh seeds' (the ones its val_acc rests on)
                scores = [r for r in fresh if not _missing(r.get("test_acc"))]
                folded["test_acc"] = statistics.fmean(float(r["test_acc"]) for r in scores) if scores else None
                folded["test_loss"] = statistics.fmean(float(r["test_loss"]) for r in scores) if scores else None
                folded["test_epoch"] = None  # one per seed
                folded["test_corrupted"] = None
                folded["test_images"] = scores[0]["test_images"] if scores else None
            _accuracy_interval(folded, "test_acc", "test_images", seeds=len(scores) if fresh else 1,
                               pooled=pooled["test_acc"], confirmed=bool(fresh))
        out.append(folded)
    return out


def _accuracy_interval(row: dict[str, Any], column: str, images_column: str, *, seeds: int,
                       pooled: tuple[float, int], confirmed: bool) -> None:
    """``row[column]``'s interval: seed and binomial noise combined where a pooled seed SD is
    known; else Wilson over the images (set again for a confirmed mean, kept for a single trial)."""
    acc = row.get(column)
    if _missing(acc) or not 0.0 <= acc <= 1.0 or seeds < 1:
        if confirmed:
            row[f"{column}_low"] = row[f"{column}_high"] = None
        return
    images = _int(row.get(images_column))
    sd, df = pooled
    if df:
        row[f"{column}_low"], row[f"{column}_high"] = combined_interval(acc, n=seeds, sd=sd, df=df, val_images=images)
    elif confirmed:
        row[f"{column}_low"], row[f"{column}_high"] = wilson_interval(acc, images)


def _int(value: Any) -> int | None:
    return None if _missing(value) else int(value)

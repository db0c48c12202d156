"""Ablations: each knob's effect in a grid study, as a difference to a baseline value with its interval.

A grid study (``algorithm: {name: grid, seeds: N}``) trains every point of its space once per
seed, with the same seeds at every point. For a knob K and one of its values v, two numbers:

- the mean of each objective over the COMPLETE trials at K = v (marginal: over the seeds and every
  value of the other knobs), with Student's t interval at 95%;
- the difference to K's baseline value b (its first value, or the one asked for): the trials at
  v and at b are matched by seed and every other knob's value, and the pairs' differences give a
  paired t test (Student 1908) -- their mean, its t interval at 95% and the two-sided p-value.
  Pairing takes out what the seed and the other knobs do to both trials alike, so an effect far
  smaller than the spread between seeds can be seen.

An interval of the difference that covers 0 is **inconclusive**: the study does not tell v from b.
Otherwise the value is ``better`` or ``worse`` than the baseline by the objective's mode. With
fewer than 2 pairs there is no test (``too few pairs``); where every pair differs by the same
amount (a device measurement, e.g. throughput, is the architecture's, one per architecture and
shared by every seed) the t test does not apply: the difference is shown, without an interval or
a p-value, and the verdict is ``inconclusive (no spread)``, as a claim's is (search.results.claims;
both by :func:`no_spread`).

:func:`blocked_difference` is the same difference with the error of the whole grid: where every
point has every seed (a randomised complete block design, the seeds its blocks), the residual of
the two-way model y = point + seed + e, pooled over all P points and S seeds, has (P - 1)(S - 1)
degrees of freedom instead of the pairs' n - 1, and the difference of two knob values, each the
mean of S * Q cells (Q: the other knobs' settings), has the variance 2 s^2 / (S Q) (Cochran & Cox
1957, ch. 4). With two points it is the paired t test itself; the claims use it where the grid has more.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from search.results.query import load
from search.results.replicates import REPLICATE_COLUMN, mean_interval
from search.spec.spec import SearchSpec, grid_values
from search.spec.validation import SpecLocation, from_plain
from trainers.errors import ConfigError

__all__ = ["EFFECT_COLUMNS", "TEST", "knob_effects", "paired_differences", "blocked_difference", "no_spread",
           "parse_baselines", "grid_knobs", "study_effects"]

TEST = ("paired t test (Student 1908; on a grid of more than two points, each with every seed, with the grid's "
        "pooled residual variance, seeds as blocks)")
CONFIDENCE = 0.95

# One row per objective, knob and value (the baseline's row first-listed in the knob's order).
EFFECT_COLUMNS = ("objective", "mode", "knob", "value", "baseline", "n", "seeds", "mean", "low", "high",
                  "pairs", "diff", "diff_low", "diff_high", "p_value", "verdict")


def no_spread(spread: float, level: float) -> bool:
    """Whether ``spread`` (an sd or a standard error) is no spread at all beside ``level`` (the
    difference): below 1e-12 of it (or of 1), what rounding leaves of equal differences. No test
    then, in the effects and the claims alike."""
    return not spread > 1e-12 * max(1.0, abs(level))


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _matches(stored: Any, value: Any) -> bool:
    """Whether a store cell holds the knob value ``value`` (the store keeps a choice of mixed
    types as strings, whole numbers as int64, numbers as float64)."""
    if isinstance(stored, np.generic):
        stored = stored.item()
    if _missing(stored):
        return value is None
    if isinstance(stored, str):
        return stored == (value if isinstance(value, str) else str(value))
    if isinstance(stored, bool) or isinstance(value, bool):
        return isinstance(stored, bool) and isinstance(value, bool) and stored == value
    if isinstance(stored, (int, float)) and isinstance(value, (int, float)):
        return float(stored) == float(value)
    return bool(stored == value)


def _index(stored: Any, values: Sequence[Any]) -> int | None:
    return next((i for i, v in enumerate(values) if _matches(stored, v)), None)


def _verdict(diff: float, low: float, high: float, mode: str) -> str:
    if low <= 0 <= high:
        return "inconclusive"
    return "better" if (diff > 0) == (mode == "max") else "worse"


def knob_effects(trials: pd.DataFrame, *, objectives: Sequence[tuple[str, str]], knobs: Mapping[str, Sequence[Any]],
                 baselines: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """Each knob's effect on each objective (see the module doc), from ``trials`` (rows of a grid
    study's trials.parquet: its knob columns, ``seed``, ``state`` and the objectives).

    ``objectives``: (column, mode) pairs, mode ``max`` or ``min``; ``knobs``: every knob of the
    grid and its values in the spec's order (a knob with one value is only matched on);
    ``baselines``: a value per knob to compare with (default: the knob's first value). Only
    COMPLETE trials count (search trials, not confirmation replicates); a trial with a knob value
    outside the grid is left out. One row per objective, knob and value (:data:`EFFECT_COLUMNS`):
    ``n`` trials (``seeds`` distinct seeds) with ``mean`` and its t interval ``low``-``high``;
    ``pairs`` matched with the baseline's trials, the mean difference ``diff`` (value minus
    baseline), its interval ``diff_low``-``diff_high``, ``p_value`` and ``verdict``. ConfigError
    where a baseline is not a knob or not one of its values."""
    baselines = dict(baselines or {})
    for knob, value in baselines.items():
        if knob not in knobs:
            raise ConfigError(f"baseline {knob}: not a knob of the study; use one of {', '.join(knobs) or 'none'}")
        if _index(value, list(knobs[knob])) is None:
            raise ConfigError(f"baseline {knob}={value!r}: not one of its values "
                              f"({', '.join(map(str, knobs[knob]))}); pick one of them")
    rows, cells, on_grid, seeds = _grid_cells(trials, knobs)
    names = list(knobs)
    out = []
    for objective, mode in objectives:
        y = _objective_values(rows, objective)
        usable = [i for i in range(len(rows)) if on_grid[i] and math.isfinite(y[i])]
        for knob in names:
            values = list(knobs[knob])
            if len(values) < 2:
                continue
            base = _index(baselines[knob], values) if knob in baselines else 0
            for at, value in enumerate(values):
                here = [y[i] for i in usable if cells[knob][i] == at]
                mean, _, low, high = mean_interval(here) if here else (math.nan,) * 4
                row = {"objective": objective, "mode": mode, "knob": knob, "value": value, "baseline": values[base],
                       "n": len(here), "seeds": len({seeds[i] for i in usable if cells[knob][i] == at}),
                       "mean": mean, "low": low, "high": high, "pairs": 0, "diff": math.nan, "diff_low": math.nan,
                       "diff_high": math.nan, "p_value": math.nan}
                if at == base:
                    out.append({**row, "verdict": "baseline"})
                    continue
                row.update(_paired(_pairs(y, usable, cells, seeds, names, knob, at, base), mode))
                if row["verdict"] not in ("too few pairs", "inconclusive (no spread)"):
                    row.update(_pooled(blocked_difference(trials, objective=objective, knobs=knobs, knob=knob,
                                                          value=value, baseline=values[base]), row, mode))
                out.append(row)
    table = pd.DataFrame(out, columns=list(EFFECT_COLUMNS))
    for column in ("n", "seeds", "pairs"):
        table[column] = table[column].astype("int64")
    return table


def _grid_cells(trials: pd.DataFrame, knobs: Mapping[str, Sequence[Any]]):
    """The COMPLETE search trials of ``trials``; per knob, each row's index into the knob's values
    (None off the grid); whether a row is on the grid; each row's seed."""
    rows = trials
    if "state" in rows:
        rows = rows[rows["state"] == "COMPLETE"]
    if REPLICATE_COLUMN in rows:
        rows = rows[rows[REPLICATE_COLUMN].isna()]
    names = list(knobs)
    cells = {k: [_index(v, list(knobs[k])) for v in rows[k]] if k in rows else [None] * len(rows) for k in names}
    on_grid = np.array([all(cells[k][i] is not None for k in names) for i in range(len(rows))], dtype=bool)
    seeds = rows["seed"].tolist() if "seed" in rows else [0] * len(rows)
    return rows, cells, on_grid, seeds


def _objective_values(rows: pd.DataFrame, objective: str) -> np.ndarray:
    return (pd.to_numeric(rows[objective], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
            if objective in rows else np.full(len(rows), np.nan))


def _pairs(y: np.ndarray, usable: Sequence[int], cells: Mapping[str, list], seeds: Sequence[Any], names: Sequence[str],
           knob: str, at: int, base: int) -> list[tuple[float, float]]:
    """(objective at value ``at``, at value ``base``) of ``knob`` for each seed and setting of the
    other knobs where both were trained (a cell trained twice counts as its mean)."""
    others = [k for k in names if k != knob]
    matched: dict[tuple, dict[int, list[float]]] = {}  # (seed, the other knobs' values) -> value -> objective
    for i in usable:
        key = (seeds[i], *(cells[k][i] for k in others))
        matched.setdefault(key, {}).setdefault(cells[knob][i], []).append(y[i])
    return [(float(np.mean(by[at])), float(np.mean(by[base]))) for by in matched.values() if at in by and base in by]


def paired_differences(trials: pd.DataFrame, *, objective: str, knobs: Mapping[str, Sequence[Any]], knob: str,
                       value: Any, baseline: Any) -> list[float]:
    """The differences (``knob`` = ``value`` minus ``knob`` = ``baseline``) of ``objective`` over
    the pairs :func:`knob_effects` tests: matched by seed and every other knob's value."""
    at, base, cells, seeds, y, usable = _contrast(trials, objective, knobs, knob, value, baseline)
    return [a - b for a, b in _pairs(y, usable, cells, seeds, list(knobs), knob, at, base)]


def _contrast(trials: pd.DataFrame, objective: str, knobs: Mapping[str, Sequence[Any]], knob: str, value: Any,
              baseline: Any):
    """What a difference of ``knob`` = ``value`` and ``baseline`` is taken from: the two values'
    indices, the grid cells of the rows, their seeds and objective values, and the usable rows (on
    the grid, a finite value); a ConfigError where a value is not on the grid."""
    values = list(knobs.get(knob, ()))
    at, base = _index(value, values), _index(baseline, values)
    if at is None or base is None:
        raise ConfigError(f"{knob}={value!r} or {knob}={baseline!r} is not on the grid "
                          f"({knob}: {', '.join(map(str, values)) or 'not a knob'}); use one of its values")
    rows, cells, on_grid, seeds = _grid_cells(trials, knobs)
    y = _objective_values(rows, objective)
    return at, base, cells, seeds, y, [i for i in range(len(rows)) if on_grid[i] and math.isfinite(y[i])]


def blocked_difference(trials: pd.DataFrame, *, objective: str, knobs: Mapping[str, Sequence[Any]], knob: str,
                       value: Any, baseline: Any) -> tuple[float, float, int] | None:
    """(difference, standard error, degrees of freedom) of ``knob`` = ``value`` minus ``baseline``
    with the grid's pooled residual variance (the module doc); None where the design lacks it: fewer
    than 3 points or 2 seeds, or a point without a trial at some seed (the pairs then stand alone).
    A cell trained twice counts as its mean."""
    at, base, cells, seeds, y, usable = _contrast(trials, objective, knobs, knob, value, baseline)
    names = list(knobs)
    table: dict[tuple, dict[Any, list[float]]] = {}  # point (each knob's value index) -> seed -> values
    for i in usable:
        table.setdefault(tuple(cells[k][i] for k in names), {}).setdefault(seeds[i], []).append(y[i])
    points = list(itertools.product(*(range(len(knobs[k])) for k in names)))
    blocks = sorted({s for by_seed in table.values() for s in by_seed}, key=str)
    if len(points) < 3 or len(blocks) < 2 or any(set(table.get(p, {})) != set(blocks) for p in points):
        return None
    cell = np.array([[np.mean(table[p][s]) for s in blocks] for p in points])  # P x S
    residual = cell - cell.mean(axis=1, keepdims=True) - cell.mean(axis=0, keepdims=True) + cell.mean()
    df = (len(points) - 1) * (len(blocks) - 1)
    variance = float((residual ** 2).sum()) / df
    where = names.index(knob)
    arm = np.array([p[where] == at for p in points])
    rest = np.array([p[where] == base for p in points])
    diff = float(cell[arm].mean() - cell[rest].mean())
    return diff, math.sqrt(2 * variance / (len(blocks) * int(arm.sum()))), df


def _pooled(blocked: tuple[float, float, int] | None, row: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """The interval, p and verdict of the pairs' mean difference with the grid's pooled error
    (:func:`blocked_difference`) where the design has it; else the pairs' own, as they are."""
    if blocked is None:
        return {}
    diff, se, df = blocked
    if no_spread(se, diff):
        return {"diff_low": math.nan, "diff_high": math.nan, "p_value": math.nan, "verdict": "inconclusive (no spread)"}
    from scipy import stats  # only where effects are computed

    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, df)) * se
    low, high = row["diff"] - half, row["diff"] + half
    return {"diff_low": low, "diff_high": high, "p_value": float(2 * stats.t.sf(abs(row["diff"]) / se, df)),
            "verdict": _verdict(row["diff"], low, high, mode)}


def _paired(pairs: Sequence[tuple[float, float]], mode: str) -> dict[str, Any]:
    """The paired t test of (value, baseline) pairs: the mean difference, its t interval, p."""
    result: dict[str, Any] = {"pairs": len(pairs)}
    if not pairs:
        return {**result, "verdict": "too few pairs"}
    diffs = [a - b for a, b in pairs]
    diff, sd, low, high = mean_interval(diffs, confidence=CONFIDENCE)
    result["diff"] = diff
    if len(pairs) < 2:
        return {**result, "verdict": "too few pairs"}
    if no_spread(sd, diff):  # every pair the same difference (up to rounding): no test
        return {**result, "verdict": "inconclusive (no spread)"}
    from scipy import stats  # only where effects are computed

    p = float(stats.ttest_rel([a for a, _ in pairs], [b for _, b in pairs]).pvalue)
    return {**result, "diff_low": low, "diff_high": high, "p_value": p, "verdict": _verdict(diff, low, high, mode)}


def parse_baselines(texts: Iterable[str], knobs: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """``KNOB=VALUE`` texts (``--baseline``) as {knob: the knob's value that VALUE names}; a
    one-line ConfigError for a text that is not KNOB=VALUE, a knob that is not the study's, a value
    that is not one of the knob's."""
    out: dict[str, Any] = {}
    for text in texts:
        knob, sep, given = text.partition("=")
        knob, given = knob.strip(), given.strip()
        if not sep or not knob:
            raise ConfigError(f"--baseline {text!r}: expected KNOB=VALUE, e.g. --baseline local_up_to_layer=0")
        if knob not in knobs:
            raise ConfigError(f"--baseline {text}: {knob!r} is not a knob of the study; use one of {', '.join(knobs)}")
        values = list(knobs[knob])
        found = [v for v in values if str(v) == given or (not isinstance(v, (bool, str)) and isinstance(v, (int, float))
                                                          and _number(given) == float(v))]
        if not found:
            raise ConfigError(f"--baseline {text}: {given!r} is not one of {knob}'s values "
                              f"({', '.join(map(str, values))})")
        out[knob] = found[0]
    return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _grid_spec(meta: Mapping[str, Any], path: Path) -> SearchSpec:
    plain = meta.get("spec")
    if not isinstance(plain, dict):
        raise ConfigError(f"{path}/experiment.json: no 'spec' object; the study's files are damaged")
    plain = {k: v for k, v in plain.items() if k not in ("source", "profile")}
    spec = from_plain(SearchSpec, plain, SpecLocation(f"{path}/experiment.json", "spec"))
    if not spec.is_grid:
        raise ConfigError(f"{path}: not a grid study (algorithm: {spec.algorithm.name}); effects pair trials by seed "
                          "and every other knob, which only a grid trains: algorithm: {name: grid, seeds: N}")
    return spec


def grid_knobs(meta: Mapping[str, Any], path: str | Path) -> dict[str, tuple[Any, ...]]:
    """A grid study's knobs and their values in the spec's order, from its experiment.json ``meta``;
    ConfigError where the study is not a grid study."""
    spec = _grid_spec(meta, Path(path))
    return {k: grid_values(p) or () for k, p in spec.all_params().items()}


def study_effects(study: str | Path, *, objectives: Sequence[str] = (), baselines: Iterable[str] = ()) -> pd.DataFrame:
    """:func:`knob_effects` of the grid study at ``study`` (a folder or URI), for ``objectives``
    (column names; default: the study's objectives) and ``baselines`` (``KNOB=VALUE`` texts)."""
    exp = load(study)
    knobs = grid_knobs(exp.spec, exp.path)
    modes = dict(exp.objectives)
    for name in objectives:
        if name not in modes:
            raise ConfigError(f"--objective {name}: not an objective of this study; use one of {', '.join(modes)}")
    chosen = [(name, modes[name]) for name in dict.fromkeys(objectives)] or list(exp.objectives)
    return knob_effects(exp.trials, objectives=chosen, knobs=knobs, baselines=parse_baselines(baselines, knobs))

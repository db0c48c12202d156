"""The papers' claims, tested on this platform's own grid studies (``studies/claims.yaml``).

A claim says what a paper predicts ("at small data ConViT beats a DeiT of the same size"), the
paper's number, and which study tests it, one of three ways (``test.kind``):

- ``effect``: a knob's value against a baseline value in one grid study; the pairs (same seed,
  same other knobs) and the paired t test (Student 1908) of ``python -m search effects``. With
  ``epoch: E`` the validation accuracy after epoch E stands in for the final one.
- ``shrinks``: that effect in ``study`` minus the same effect in ``then`` (e.g. on little data and
  on more); Welch's t test (Welch 1947) of the two sets of paired differences.
- ``versus``: the trials at one grid point of ``study`` against every trial of ``control`` (a study
  of another model, e.g. the plain-attention control of GMM); Welch's t test over the seeds
  (unpaired: two models share the seed's data order, not their weights).

The verdict, from the 95% interval of the difference: ``expect: higher`` is **reproduced** when
the interval lies above 0, **not reproduced** when it lies below, **inconclusive** when it covers 0
(or fewer than 2 pairs/seeds); ``lower`` the mirror image; ``no_gain`` (a saturation) is reproduced
when the interval's upper end is below ``margin`` (any gain is smaller than that, at 95%), not
reproduced when the interval lies above 0, inconclusive otherwise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import Field, model_validator

from search.results.effects import grid_knobs, paired_differences
from search.results.query import Experiment, load
from search.results.replicates import REPLICATE_COLUMN
from search.spec.spec import read_yaml
from search.spec.validation import FieldError, Number, Record, SpecLocation, Whole, from_plain
from trainers.errors import ConfigError

__all__ = ["Claim", "ClaimTest", "ClaimsFile", "ClaimResult", "load_claims", "evaluate_claim", "welch",
           "paired", "VERDICTS"]

CONFIDENCE = 0.95
VERDICTS = ("reproduced", "not reproduced", "inconclusive", "not run")


class ClaimTest(Record):
    kind: Literal["effect", "shrinks", "versus"]
    study: str  # a spec next to the claims file, without .yaml
    knob: str | None = None  # effect, shrinks
    value: Any = None
    baseline: Any = None
    then: str | None = None  # shrinks: the second study
    control: str | None = None  # versus: the other model's study
    at: dict[str, Any] = Field(default_factory=dict)  # versus: the grid point of `study`
    objective: str = "val_acc"
    epoch: Whole | None = None  # the objective after this epoch (epochs.parquet), not the final one

    @model_validator(mode="after")
    def _check(self) -> "ClaimTest":
        if self.kind in ("effect", "shrinks") and (self.knob is None or self.value is None or self.baseline is None):
            raise FieldError("knob", f"a {self.kind} test names knob, value and baseline")
        if self.kind == "shrinks" and not self.then:
            raise FieldError("then", "a shrinks test names the second study: then: STUDY")
        if self.kind == "versus" and (not self.control or not self.at):
            raise FieldError("control", "a versus test names control: STUDY and at: {knob: value}")
        if self.epoch is not None and self.epoch < 1:
            raise FieldError("epoch", f"must be at least 1, got {self.epoch}")
        return self

    @property
    def studies(self) -> tuple[str, ...]:
        return tuple(s for s in (self.study, self.then, self.control) if s)


class Claim(Record):
    id: str
    paper: str
    claim: str
    paper_result: str
    expect: Literal["higher", "lower", "no_gain"]
    margin: Number = 0.01  # no_gain: the largest gain that still counts as none
    test: ClaimTest


class ClaimsFile(Record):
    claims: tuple[Claim, ...]

    @model_validator(mode="after")
    def _check(self) -> "ClaimsFile":
        ids = [c.id for c in self.claims]
        if not ids:
            raise FieldError("claims", "is empty; list at least one claim")
        if len(set(ids)) != len(ids):
            raise FieldError("claims", f"an id is listed twice: {ids}")
        return self

    def studies(self) -> list[str]:
        """Every study the claims use, in the order first used."""
        return list(dict.fromkeys(s for c in self.claims for s in c.test.studies))


def load_claims(path: str | Path) -> ClaimsFile:
    """Read and validate a claims file; a study that has no spec next to it is a ConfigError."""
    path = Path(path)
    claims = from_plain(ClaimsFile, read_yaml(path, example="studies/claims.yaml"), SpecLocation(str(path)))
    for study in claims.studies():
        if not (path.parent / f"{study}.yaml").is_file():
            raise ConfigError(f"{path}: study {study!r} has no spec {path.parent / study}.yaml; add it or fix the name")
    return claims


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    diff: float  # the difference the claim is about (see the module doc)
    low: float
    high: float
    p_value: float
    n: str  # what the test counted, e.g. "3 pairs" or "3 vs 3 seeds"
    arms: str  # the means compared, e.g. "0.4618 vs 0.3520"
    verdict: str
    test: str  # the test's name


def paired(diffs: Sequence[float]) -> tuple[float, float, float, float]:
    """(mean, low, high, p) of paired differences: Student's t interval and the two-sided p of
    the one-sample t test against 0 (NaN where there are fewer than 2, or no spread)."""
    from scipy import stats

    n = len(diffs)
    if n == 0:
        return (math.nan,) * 4
    mean = statistics.fmean(diffs)
    if n < 2:
        return mean, math.nan, math.nan, math.nan
    sd = statistics.stdev(diffs)
    if sd == 0:  # every pair the same difference: no spread, no test (as `effects`)
        return mean, math.nan, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half, float(stats.ttest_1samp(diffs, 0.0).pvalue)


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float, float]:
    """(mean(a) - mean(b), low, high, p): Welch's t interval with the Welch-Satterthwaite degrees
    of freedom, and the two-sided p of Welch's t test (NaN where a sample has fewer than 2, or
    neither spreads)."""
    from scipy import stats

    if not a or not b:
        return (math.nan,) * 4
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan, math.nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, math.nan, math.nan, math.nan
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, df)) * se
    return diff, diff - half, diff + half, float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def _verdict(expect: str, low: float, high: float, margin: float) -> str:
    if math.isnan(low) or math.isnan(high):
        return "inconclusive"
    if expect == "no_gain":
        return "reproduced" if high < margin else "not reproduced" if low > 0 else "inconclusive"
    above, below = low > 0, high < 0
    if expect == "lower":
        above, below = below, above
    return "reproduced" if above else "not reproduced" if below else "inconclusive"


def _trials(exp: Experiment, objective: str, epoch: int | None) -> pd.DataFrame:
    """The study's COMPLETE search trials; with ``epoch``, ``objective`` taken after that epoch."""
    rows = exp.trials
    rows = rows[rows["state"] == "COMPLETE"]
    if REPLICATE_COLUMN in rows:
        rows = rows[rows[REPLICATE_COLUMN].isna()]
    if objective not in rows:
        raise ConfigError(f"{exp.path}: no column {objective!r}; claims test one of {', '.join(dict(exp.objectives))}")
    if epoch is None:
        return rows
    at = exp.epochs[exp.epochs["epoch"] == epoch].drop_duplicates("trial_id", keep="last")
    values = dict(zip(at["trial_id"], at[objective]))
    rows = rows.copy()
    rows[objective] = [values.get(t, math.nan) for t in rows["trial_id"]]
    return rows


def _effect(exp: Experiment, test: ClaimTest) -> list[float]:
    knobs = grid_knobs(exp.spec, exp.path)
    return paired_differences(_trials(exp, test.objective, test.epoch), objective=test.objective, knobs=knobs,
                              knob=test.knob, value=test.value, baseline=test.baseline)


def _values(rows: pd.DataFrame, objective: str, at: Mapping[str, Any]) -> list[float]:
    """``objective`` of the rows whose knobs hold the values of ``at`` (none: every row)."""
    for knob, value in at.items():
        rows = rows[[str(v) == str(value) or _same_number(v, value) for v in rows[knob]]]
    return [float(v) for v in rows[objective] if not pd.isna(v)]


def _at_point(exp: Experiment, test: ClaimTest) -> list[float]:
    knobs = grid_knobs(exp.spec, exp.path)
    for knob in test.at:
        if knob not in knobs:
            raise ConfigError(f"at: {knob} is not a knob of {exp.path}; use one of {', '.join(knobs)}")
    return _values(_trials(exp, test.objective, test.epoch), test.objective, test.at)


def _same_number(a: Any, b: Any) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _means(a: Sequence[float], b: Sequence[float]) -> str:
    if not a or not b:
        return "-"
    return f"{statistics.fmean(a):.4f} vs {statistics.fmean(b):.4f}"


def evaluate_claim(claim: Claim, studies: Mapping[str, Experiment]) -> ClaimResult:
    """Test ``claim`` on ``studies`` (its studies by name, loaded); a claim whose studies are not
    all there is ``not run``."""
    test = claim.test
    if any(s not in studies for s in test.studies):
        return ClaimResult(claim, math.nan, math.nan, math.nan, math.nan, "-", "-", "not run", "-")
    if test.kind == "effect":
        exp = studies[test.study]
        diffs = _effect(exp, test)
        diff, low, high, p = paired(diffs)
        trials = _trials(exp, test.objective, test.epoch)
        arm = _values(trials, test.objective, {test.knob: test.value})
        base = _values(trials, test.objective, {test.knob: test.baseline})
        n, arms, name = f"{len(diffs)} pairs", _means(arm, base), "paired t (Student 1908)"
    elif test.kind == "shrinks":
        first, then = _effect(studies[test.study], test), _effect(studies[test.then], test)
        diff, low, high, p = welch(first, then)
        gaps = (f"{statistics.fmean(first):+.4f} vs {statistics.fmean(then):+.4f}" if first and then else "-")
        n, arms, name = f"{len(first)} vs {len(then)} pairs", gaps, "Welch t (Welch 1947)"
    else:
        at = _at_point(studies[test.study], test)
        control = _values(_trials(studies[test.control], test.objective, test.epoch), test.objective, {})
        diff, low, high, p = welch(at, control)
        n, arms, name = f"{len(at)} vs {len(control)} seeds", _means(at, control), "Welch t (Welch 1947)"
    return ClaimResult(claim, diff, low, high, p, n, arms, _verdict(claim.expect, low, high, claim.margin), name)

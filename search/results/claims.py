"""The papers' claims, tested on this platform's own grid studies (``studies/claims.yaml``).

A claim says what a paper predicts ("at small data ConViT beats a DeiT of the same size"), the
paper's number, and which study tests it, one of three ways (``test.kind``):

- ``effect``: a knob's value against a baseline value in one grid study; the pairs (same seed,
  same other knobs) and the paired t test (Student 1908) of ``python -m search effects``, its
  variance pooled over the whole grid where every point has every seed and there are more than two
  points (the seed-blocked residual, ``search.results.effects.blocked_difference``: more degrees
  of freedom than the pairs alone). With ``epoch: E`` the metric after epoch E stands in for the
  final one.
- ``shrinks``: that effect in ``study`` minus the same effect in ``then`` (e.g. on little data and
  on more); Welch's t test (Welch 1947) of the two estimates (of two sets of paired differences:
  Welch's t test of the two sets).
- ``trend``: that effect in each study of ``over`` against log10 of the study's data fraction (its
  spec's ``dataset.train_fraction``, as its experiment.json recorded it): the least-squares slope
  of the seed pairs' differences on it, per tenfold data, with its t test on n - 2 degrees of
  freedom (Draper & Smith 1998, ch. 1). A curve over several fractions, where ``shrinks`` compares two.
- ``versus``: the trials at one grid point of ``study`` against every trial of ``control`` (a study
  of another model, e.g. the plain-attention control of GMM); Welch's t test over the seeds
  (unpaired: two models share the seed's data order, not their weights), or with ``paired`` the
  paired t test seed by seed (a control of the same code with one part off, whose seed draws the
  same data and the same init of every shared weight).
- ``mechanism``: what a model reports of its own mechanism after each epoch (epochs.parquet's
  ``mechanisms``, e.g. ConViT's gates): per trial at the grid point ``at``, the mean of the
  ``mechanism``'s values after the last epoch minus after the first (``contrast: training``), or
  after the last epoch the deepest block's mean minus the first block's (``contrast: depth``); the
  t test of those differences over the trials (Student 1908).

Each claim's protocol is fixed in the claims file before the run: the side (``expect``), the
family-wise error rate ``alpha``, the smallest effect of interest ``sesoi`` (the paper's effect,
or a stated scaled one) and the ``family`` it belongs to (claims resting on the same trials are
one member of the family of tests). Each test gives a difference, its standard error and degrees
of freedom; the verdicts, at family-wise ``alpha`` (Holm 1979, across the family's members;
Bonferroni within a member, whose claims share their trials):

- **reproduced**: the difference lies on the predicted side (the two-sided t test, adjusted);
- **contradicted**: it lies on the other side;
- **smaller than the paper's**: neither, and an equivalence test (two one-sided tests, TOST;
  Schuirmann 1987, Lakens 2017) puts it within +-``sesoi`` (adjusted the same way);
- **inconclusive**: none of these; the page prints the smallest effect the run could have
  detected with 80% power, ``(t(1 - a/2, df) + t(0.8, df)) * se``, at ``a`` the Bonferroni share
  ``alpha / m`` (the level of Holm's first step; power of the t test as in Cohen 1988).

``expect: no_gain`` (a saturation) tests the difference against ``margin`` instead of 0, one
sided: reproduced when it is below the margin (H0: difference >= margin rejected), contradicted
when it is above it (H0: difference <= margin rejected). Fewer than two pairs or seeds, or no
spread at all between them, give no test: inconclusive, with no detectable effect to print.
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

from search.results.effects import blocked_difference, grid_knobs, no_spread, paired_differences
from search.results.query import Experiment, load
from search.results.replicates import REPLICATE_COLUMN
from search.spec import read_yaml
from search.spec.validation import FieldError, Flag, Number, Record, SpecLocation, Whole, from_plain
from trainers.errors import ConfigError

__all__ = ["Claim", "ClaimTest", "ClaimsFile", "ClaimResult", "Estimate", "load_claims", "evaluate_claim",
           "evaluate_claims", "family_adjusted", "welch", "paired", "combined", "slope", "holm", "verdict", "VERDICTS",
           "POWER"]

CONFIDENCE = 0.95
DEFAULT_METRIC = "val_acc"  # what a claim reads where neither it nor its claims file names a column
CORRUPTED = "corrupted_minus_clean@"  # + severity: the column a robustness effect reads (ClaimTest.severity)
POWER = 0.8  # the power at which the smallest detectable effect is stated
VERDICTS = ("reproduced", "contradicted", "smaller than the paper's", "inconclusive", "not run")


class ClaimTest(Record):
    kind: Literal["effect", "shrinks", "trend", "versus", "mechanism"]
    study: str  # a spec next to the claims file, without .yaml
    knob: str | None = None  # effect, shrinks
    value: Any = None
    baseline: Any = None
    then: str | None = None  # shrinks: the second study
    over: list[str] = Field(default_factory=list)  # trend: every study of the curve (x: each one's data fraction)
    control: str | None = None  # versus: the other model's study
    at: dict[str, Any] = Field(default_factory=dict)  # versus: the grid point of `study`
    # versus: pair the two studies' trials by seed (the control the same code with one part off:
    # a seed gives both the same data and the same init of every shared weight); else Welch
    paired: Flag = False
    objective: str | None = None  # the column it reads; left out: the claims file's `metric`
    epoch: Whole | None = None  # the objective after this epoch (epochs.parquet), not the final one
    # mechanism: which of the model's reported mechanisms (the names' prefix in epochs.parquet's
    # `mechanisms`: gate, sigma) and what is compared: its mean after the last epoch minus after the
    # first (training), or after the last epoch its deepest block's mean minus its first block's (depth)
    mechanism: str | None = None
    contrast: Literal["training", "depth"] | None = None
    blocks: list[int] | None = None  # mechanism: only these blocks' values (e.g. ConViT's GPSA blocks)
    # effect: instead of the metric, each trial's accuracy under corruption at this severity (1-3; the
    # mean over trainers.corruptions' kinds of `test_corrupted`) minus its clean test_acc: how much it
    # loses; a knob that raises it makes the gain over the baseline grow with severity
    severity: Whole | None = None

    @model_validator(mode="after")
    def _check(self) -> "ClaimTest":
        if self.kind in ("effect", "shrinks", "trend") and (self.knob is None or self.value is None or self.baseline is None):
            raise FieldError("knob", f"a {self.kind} test names knob, value and baseline")
        if self.kind == "shrinks" and not self.then:
            raise FieldError("then", "a shrinks test names the second study: then: STUDY")
        if self.kind == "trend" and (len(set(self.over)) < 3 or self.study not in self.over):
            raise FieldError("over", "a trend test names at least 3 studies, its study among them: over: [STUDY, ...]")
        if self.over and self.kind != "trend":
            raise FieldError("over", f"only a trend test reads studies over an x; a {self.kind} test does not")
        if self.kind == "versus" and (not self.control or not self.at):
            raise FieldError("control", "a versus test names control: STUDY and at: {knob: value}")
        if self.paired and self.kind != "versus":
            raise FieldError("paired", f"only a versus test pairs two studies by seed; a {self.kind} test pairs as it says")
        if self.kind == "mechanism" and (not self.mechanism or self.contrast is None):
            raise FieldError("mechanism", "a mechanism test names mechanism: NAME (e.g. gate) and contrast: training "
                                          "or depth")
        if self.blocks is not None and (self.kind != "mechanism" or not self.blocks):
            raise FieldError("blocks", "only a mechanism test reads some blocks: blocks: [0, 1, ...], not empty")
        if self.severity is not None and (self.kind != "effect" or not 1 <= self.severity <= 3):
            raise FieldError("severity", "only an effect test reads a corruption's severity, 1, 2 or 3")
        if self.epoch is not None and self.epoch < 1:
            raise FieldError("epoch", f"must be at least 1, got {self.epoch}")
        return self

    @property
    def studies(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for s in (self.study, *self.over, self.then, self.control) if s))

    @property
    def metric(self) -> str:
        """The column it reads (set from its claims file's ``metric`` where it names none); a
        mechanism test's: the mechanism."""
        if self.kind == "mechanism":
            return str(self.mechanism)
        if self.severity is not None:
            return f"{CORRUPTED}{self.severity}"
        return self.objective or DEFAULT_METRIC


class Claim(Record):
    id: str
    paper: str
    claim: str
    paper_result: str
    expect: Literal["higher", "lower", "no_gain"]
    margin: Number = 0.01  # no_gain: the largest gain that still counts as none
    alpha: Number = 0.05  # the family-wise error rate the verdicts hold at (Holm across the claims)
    sesoi: Number | None = None  # the smallest effect of interest (the paper's, or a stated scaled one): the TOST's bound
    family: str | None = None  # claims resting on the same trials share one: one member of Holm's family
    test: ClaimTest

    @model_validator(mode="after")
    def _check(self) -> "Claim":
        if not 0 < self.alpha < 1:
            raise FieldError("alpha", f"must be in (0, 1), got {self.alpha}")
        if self.sesoi is not None and self.sesoi <= 0:
            raise FieldError("sesoi", f"must be above 0 (a size, on the objective's scale), got {self.sesoi}")
        return self

    @property
    def member(self) -> str:
        """Its member of the family of tests: its ``family``, or itself."""
        return self.family or self.id


class ClaimsFile(Record):
    claims: tuple[Claim, ...]
    # the column every claim reads unless its test names its own `objective`: one edit moves them
    # all (to the held-out test accuracy, say, once the studies record it)
    metric: str = DEFAULT_METRIC

    @model_validator(mode="after")
    def _check(self) -> "ClaimsFile":
        ids = [c.id for c in self.claims]
        if not ids:
            raise FieldError("claims", "is empty; list at least one claim")
        if len(set(ids)) != len(ids):
            raise FieldError("claims", f"an id is listed twice: {ids}")
        # frozen records: the file's metric written into each test that names none, once
        object.__setattr__(self, "claims", tuple(_reading(c, self.metric) for c in self.claims))
        return self

    def studies(self) -> list[str]:
        """Every study the claims use, in the order first used."""
        return list(dict.fromkeys(s for c in self.claims for s in c.test.studies))


def _reading(claim: Claim, metric: str) -> Claim:
    """``claim`` with its test's objective set (``metric`` where it names none)."""
    if claim.test.objective is not None:
        return claim
    return claim.model_copy(update={"test": claim.test.model_copy(update={"objective": metric})})


def load_claims(path: str | Path) -> ClaimsFile:
    """Read and validate a claims file; a study that has no spec next to it is a ConfigError."""
    path = Path(path)
    claims = from_plain(ClaimsFile, read_yaml(path, example="studies/claims.yaml"), SpecLocation(str(path)))
    for study in claims.studies():
        if not (path.parent / f"{study}.yaml").is_file():
            raise ConfigError(f"{path}: study {study!r} has no spec {path.parent / study}.yaml; add it or fix the name")
    return claims


@dataclass(frozen=True)
class Estimate:
    """A difference with its standard error and degrees of freedom (NaN se: no test)."""

    diff: float
    se: float
    df: float

    @property
    def testable(self) -> bool:
        return math.isfinite(self.se) and self.se > 0 and math.isfinite(self.diff)

    def interval(self, confidence: float = CONFIDENCE) -> tuple[float, float]:
        if not self.testable:
            return math.nan, math.nan
        from scipy import stats

        half = float(stats.t.ppf(0.5 + confidence / 2, self.df)) * self.se
        return self.diff - half, self.diff + half

    def p_two_sided(self, against: float = 0.0) -> float:
        """The two-sided t test of H0: difference = ``against``."""
        if not self.testable:
            return math.nan
        from scipy import stats

        return float(2 * stats.t.sf(abs(self.diff - against) / self.se, self.df))

    def p_below(self, bound: float) -> float:
        """One-sided: the p of H0 difference >= ``bound`` (small: it is below)."""
        if not self.testable:
            return math.nan
        from scipy import stats

        return float(stats.t.cdf((self.diff - bound) / self.se, self.df))

    def p_above(self, bound: float) -> float:
        """One-sided: the p of H0 difference <= ``bound`` (small: it is above)."""
        if not self.testable:
            return math.nan
        from scipy import stats

        return float(stats.t.sf((self.diff - bound) / self.se, self.df))

    def p_equivalent(self, bound: float) -> float:
        """TOST: the p of H0 |difference| >= ``bound``, the larger of the two one-sided tests."""
        return max(self.p_above(-bound), self.p_below(bound)) if self.testable else math.nan

    def detectable(self, alpha: float, power: float = POWER) -> float:
        """The smallest effect a two-sided test at ``alpha`` detects with ``power``, at this se and df."""
        if not self.testable:
            return math.nan
        from scipy import stats

        return float((stats.t.ppf(1 - alpha / 2, self.df) + stats.t.ppf(power, self.df)) * self.se)

    def seeds_for(self, effect: float, *, seeds: int, alpha: float, power: float = POWER, most: int = 100) -> int | None:
        """This estimate as a pilot (it rests on ``seeds`` seeds): the fewest seeds at which
        `detectable` falls to ``effect``, the standard error shrinking as 1/sqrt(seeds) and the
        degrees of freedom growing in step (Cohen 1988, ch. 2); None where no spread was measured,
        or more than ``most`` would be needed."""
        if not self.testable or not effect > 0 or seeds < 2:
            return None
        for n in range(2, most + 1):
            df = max(1.0, self.df * (n - 1) / (seeds - 1))
            if Estimate(self.diff, self.se * math.sqrt(seeds / n), df).detectable(alpha, power) <= effect:
                return n
        return None


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    diff: float  # the difference the claim is about (see the module doc)
    low: float  # its 95% interval (uncorrected; the verdict uses p_adjusted)
    high: float
    p_value: float  # the claim's own test before correction (no_gain: one-sided against the margin)
    n: str  # what the test counted, e.g. "3 pairs" or "3 vs 3 seeds"
    arms: str  # the means compared, e.g. "0.4618 vs 0.3520"
    verdict: str
    test: str  # the test's name
    p_adjusted: float = math.nan  # Holm's adjusted p across the family of claims
    p_equivalence: float = math.nan  # the TOST's adjusted p against the claim's sesoi (NaN: none given)
    detectable: float = math.nan  # inconclusive: the smallest effect detectable with 80% power at the level used
    seeds_needed: int | None = None  # with this run as the pilot: seeds for 80% power at the claim's sesoi
    estimate: Estimate | None = None


# an effect's test: the pairs' own variance, or the grid's pooled residual variance (effects.blocked_difference)
POOLED = ", the grid's pooled residual variance"
PAIRED_TESTS = {False: "paired t (Student 1908)", True: "paired t (Student 1908)" + POOLED}


def paired(diffs: Sequence[float]) -> Estimate:
    """The mean of paired differences with its standard error sd / sqrt(n) on n - 1 degrees of
    freedom (Student 1908); NaN se where there are fewer than 2, or no spread at all."""
    n = len(diffs)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan)
    mean = statistics.fmean(diffs)
    if n < 2:
        return Estimate(mean, math.nan, math.nan)
    sd = statistics.stdev(diffs)
    if no_spread(sd, mean):  # every pair the same difference: no spread, no test (as in effects)
        return Estimate(mean, math.nan, math.nan)
    return Estimate(mean, sd / math.sqrt(n), n - 1)


def welch(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a) - mean(b) with Welch's standard error and the Welch-Satterthwaite degrees of
    freedom (Welch 1947); NaN se where a sample has fewer than 2, or neither spreads."""
    if not a or not b:
        return Estimate(math.nan, math.nan, math.nan)
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return Estimate(diff, math.nan, math.nan)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if no_spread(se, diff):
        return Estimate(diff, math.nan, math.nan)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return Estimate(diff, se, df)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values: sorted ascending, the i-th (from 0) times
    (m - i), made non-decreasing, capped at 1. A NaN (no test) takes no part and stays NaN."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    out = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        out[i] = running
    return out


def verdict(expect: str, estimate: Estimate, *, p_adjusted: float, p_contrary: float, p_equivalence: float,
            alpha: float) -> str:
    """One claim's verdict from its adjusted p-values (see the module doc): ``p_adjusted`` of its own
    test, ``p_contrary`` of a saturation's opposite test, ``p_equivalence`` of the TOST."""
    if not estimate.testable or math.isnan(p_adjusted):
        return "inconclusive"
    if expect == "no_gain":
        return "reproduced" if p_adjusted < alpha else "contradicted" if p_contrary < alpha else "inconclusive"
    if p_adjusted < alpha:
        predicted = estimate.diff > 0 if expect == "higher" else estimate.diff < 0
        return "reproduced" if predicted else "contradicted"
    if not math.isnan(p_equivalence) and p_equivalence < alpha:
        return "smaller than the paper's"
    return "inconclusive"


def _trials(exp: Experiment, objective: str, epoch: int | None) -> pd.DataFrame:
    """The study's COMPLETE search trials; with ``epoch``, ``objective`` taken after that epoch."""
    rows = exp.trials
    rows = rows[rows["state"] == "COMPLETE"]
    if REPLICATE_COLUMN in rows:
        rows = rows[rows[REPLICATE_COLUMN].isna()]
    if objective.startswith(CORRUPTED):
        rows = _with_corruption_loss(exp, rows, int(objective[len(CORRUPTED):]))
    if objective not in rows:
        raise ConfigError(f"{exp.path}: no column {objective!r} (the claims file's `metric`, or the test's `objective`); "
                          f"its objectives are {', '.join(dict(exp.objectives))}")
    if epoch is None:
        missing = int(rows[objective].isna().sum())
        if missing:  # e.g. test_acc of a study run before its trials were scored on the test split
            raise ConfigError(f"{exp.path}: {objective!r} is not recorded for {missing} of its {len(rows)} COMPLETE "
                              "trials (a study run before it was measured); run the study again")
        return rows
    at = exp.epochs[exp.epochs["epoch"] == epoch].drop_duplicates("trial_id", keep="last")
    values = dict(zip(at["trial_id"], at[objective]))
    rows = rows.copy()
    rows[objective] = [values.get(t, math.nan) for t in rows["trial_id"]]
    return rows


def _with_corruption_loss(exp: Experiment, rows: pd.DataFrame, severity: int) -> pd.DataFrame:
    """``rows`` with the column ``CORRUPTED + severity``: the mean accuracy over the corruptions at
    that severity (``test_corrupted``) minus the clean ``test_acc``."""
    if "test_corrupted" not in rows or rows["test_corrupted"].isna().all():
        raise ConfigError(f"{exp.path}: no test_corrupted column; the study must set dataset.corruptions: true")
    loss = []
    for cell, clean in zip(rows["test_corrupted"], rows["test_acc"]):
        pairs = dict(cell.items() if isinstance(cell, Mapping) else (cell if cell is not None else []))
        at = [float(v) for name, v in pairs.items() if str(name).endswith(f".{severity}")]
        loss.append(statistics.fmean(at) - float(clean) if at and not pd.isna(clean) else math.nan)
    return rows.assign(**{f"{CORRUPTED}{severity}": loss})


def _effect(exp: Experiment, test: ClaimTest) -> tuple[list[float], Estimate, bool]:
    """The pairs' differences and the effect's estimate: with the grid's pooled residual variance
    where the design has it (True), else the pairs' own (search.results.effects.blocked_difference)."""
    knobs = grid_knobs(exp.spec, exp.path)
    trials = _trials(exp, test.metric, test.epoch)
    diffs = paired_differences(trials, objective=test.metric, knobs=knobs, knob=test.knob, value=test.value,
                               baseline=test.baseline)
    blocked = blocked_difference(trials, objective=test.metric, knobs=knobs, knob=test.knob, value=test.value,
                                 baseline=test.baseline)
    if blocked is None:
        return diffs, paired(diffs), False
    diff, se, df = blocked
    return diffs, (Estimate(diff, math.nan, math.nan) if no_spread(se, diff) else Estimate(diff, se, df)), True


def combined(first: Estimate, then: Estimate) -> Estimate:
    """``first`` minus ``then``, two independent estimates: se^2 the sum of theirs, the degrees of
    freedom by Welch-Satterthwaite (Welch 1947). Of two sets of paired differences this is Welch's
    t test of the two sets."""
    diff = first.diff - then.diff
    if not (first.testable and then.testable):
        return Estimate(diff, math.nan, math.nan)
    va, vb = first.se ** 2, then.se ** 2
    return Estimate(diff, math.sqrt(va + vb), (va + vb) ** 2 / (va ** 2 / first.df + vb ** 2 / then.df))


def slope(xs: Sequence[float], ys: Sequence[float]) -> Estimate:
    """The least-squares slope of ``ys`` on ``xs`` with its standard error sqrt(s^2 / Sxx), s^2 the
    residual variance on n - 2 degrees of freedom (Draper & Smith 1998, ch. 1); NaN se with fewer
    than 3 points, one x only, or no residual spread."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return Estimate(math.nan, math.nan, math.nan)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if n < 3:
        return Estimate(b, math.nan, math.nan)
    residual = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys)) / (n - 2)
    se = math.sqrt(residual / sxx)
    return Estimate(b, math.nan, math.nan) if no_spread(se, b) else Estimate(b, se, n - 2)


def data_fraction(exp: Experiment) -> float:
    """The share of the training split a study trained on, as its experiment.json recorded its spec."""
    fraction = ((exp.spec.get("spec") or {}).get("dataset") or {}).get("train_fraction")
    return 1.0 if fraction is None else float(fraction)


def _trend(test: ClaimTest, studies: Mapping[str, Experiment]) -> tuple[Estimate, str, str, str]:
    """The effect's seed pairs in every study of ``test.over``, their slope on log10(data fraction)."""
    xs, ys, gaps = [], [], []
    for study, x in sorted(((s, data_fraction(studies[s])) for s in test.over), key=lambda item: item[1]):
        diffs = _effect(studies[study], test)[0]
        xs += [math.log10(x)] * len(diffs)
        ys += diffs
        gaps.append(f"{statistics.fmean(diffs):+.4f} at {x:g}" if diffs else f"- at {x:g}")
    return (slope(xs, ys), f"{len(ys)} pairs over {len(test.over)} studies", ", ".join(gaps),
            "least-squares slope t (Draper & Smith 1998)")


def _at(rows: pd.DataFrame, at: Mapping[str, Any]) -> pd.DataFrame:
    """The rows whose knobs hold the values of ``at`` (none: every row)."""
    for knob, value in at.items():
        rows = rows[[str(v) == str(value) or _same_number(v, value) for v in rows[knob]]]
    return rows


def _values(rows: pd.DataFrame, objective: str, at: Mapping[str, Any]) -> list[float]:
    """``objective`` of the rows whose knobs hold the values of ``at`` (none: every row)."""
    return [float(v) for v in _at(rows, at)[objective] if not pd.isna(v)]


def _mechanism(exp: Experiment, test: ClaimTest) -> tuple[list[float], list[float]]:
    """Per COMPLETE search trial at ``test.at``: (the later value, the earlier one) of the mean of
    its ``test.mechanism`` (after its last epoch against after its first; or after its last epoch, its
    deepest block against its first). A trial without the mechanism (or one block of it) is left out."""
    _check_at(exp, test.at)
    rows = exp.trials
    rows = rows[rows["state"] == "COMPLETE"]
    if REPLICATE_COLUMN in rows:
        rows = rows[rows[REPLICATE_COLUMN].isna()]
    ids = set(_at(rows, test.at)["trial_id"])
    if exp.epochs.empty or "mechanisms" not in exp.epochs:
        return [], []
    epochs = exp.epochs[exp.epochs["trial_id"].isin(ids)].sort_values("epoch")
    prefix = f"{test.mechanism}."
    later, earlier = [], []
    for _, trial in epochs.groupby("trial_id", sort=True):
        first, last = (_named(trial["mechanisms"].iloc[k], prefix, test.blocks) for k in (0, -1))
        if test.contrast == "training":
            pair = (last, first)
        else:  # depth: a name's block is what follows the mechanism's name (gate.BLOCK.HEAD)
            blocks = sorted({int(name[len(prefix):].split(".")[0]) for name in last})
            pair = (({n: v for n, v in last.items() if n.startswith(f"{prefix}{blocks[-1]}.")},
                     {n: v for n, v in last.items() if n.startswith(f"{prefix}{blocks[0]}.")})
                    if len(blocks) > 1 else ({}, {}))
        if pair[0] and pair[1]:
            later.append(statistics.fmean(pair[0].values()))
            earlier.append(statistics.fmean(pair[1].values()))
    return later, earlier


def _named(cell: Any, prefix: str, blocks: Sequence[int] | None = None) -> dict[str, float]:
    """A `mechanisms` cell ({name: value}, as Parquet's map reads back: (name, value) pairs; or
    null) narrowed to the names starting with ``prefix`` (and then one of ``blocks``, where given)."""
    if cell is None or (isinstance(cell, float) and math.isnan(cell)):
        return {}
    wanted = None if blocks is None else {f"{prefix}{b}." for b in blocks}
    return {str(n): float(v) for n, v in (cell.items() if isinstance(cell, Mapping) else cell)
            if str(n).startswith(prefix) and (wanted is None or any(str(n).startswith(w) for w in wanted))}


def _check_at(exp: Experiment, at: Mapping[str, Any]) -> None:
    knobs = grid_knobs(exp.spec, exp.path)
    for knob in at:
        if knob not in knobs:
            raise ConfigError(f"at: {knob} is not a knob of {exp.path}; use one of {', '.join(knobs)}")


def _by_seed(rows: pd.DataFrame, objective: str) -> dict[Any, float]:
    """{seed: the mean of ``objective`` over the rows of that seed} (rows without a value left out)."""
    out: dict[Any, list[float]] = {}
    for seed, value in zip(rows["seed"], rows[objective]):
        if not pd.isna(value):
            out.setdefault(seed, []).append(float(value))
    return {seed: statistics.fmean(values) for seed, values in out.items()}


def _versus(test: ClaimTest, studies: Mapping[str, Experiment]) -> tuple[Estimate, str, str, str]:
    """The grid point of ``test.study`` against ``test.control``: Welch over the seeds, or with
    ``paired`` the t test of the differences seed by seed."""
    exp = studies[test.study]
    _check_at(exp, test.at)
    rows = _at(_trials(exp, test.metric, test.epoch), test.at)
    control = _trials(studies[test.control], test.metric, test.epoch)
    if test.paired:
        mine, theirs = _by_seed(rows, test.metric), _by_seed(control, test.metric)
        diffs = [mine[s] - theirs[s] for s in sorted(mine.keys() & theirs.keys(), key=str)]
        return (paired(diffs), f"{len(diffs)} pairs (by seed)", _means(list(mine.values()), list(theirs.values())),
                "paired t (Student 1908)")
    at, base = _values(rows, test.metric, {}), _values(control, test.metric, {})
    return welch(at, base), f"{len(at)} vs {len(base)} seeds", _means(at, base), "Welch t (Welch 1947)"


def _same_number(a: Any, b: Any) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _means(a: Sequence[float], b: Sequence[float]) -> str:
    if not a or not b:
        return "-"
    return f"{statistics.fmean(a):.4f} vs {statistics.fmean(b):.4f}"


def _estimate(claim: Claim, studies: Mapping[str, Experiment]) -> tuple[Estimate, str, str, str]:
    """The claim's estimate, what it counted, the means it compares, the test's name."""
    test = claim.test
    if test.kind == "effect":
        exp = studies[test.study]
        diffs, estimate, blocked = _effect(exp, test)
        trials = _trials(exp, test.metric, test.epoch)
        arm = _values(trials, test.metric, {test.knob: test.value})
        base = _values(trials, test.metric, {test.knob: test.baseline})
        return estimate, f"{len(diffs)} pairs", _means(arm, base), PAIRED_TESTS[blocked]
    if test.kind == "mechanism":
        later, earlier = _mechanism(studies[test.study], test)
        diffs = [a - b for a, b in zip(later, earlier)]
        return paired(diffs), f"{len(diffs)} trials", _means(later, earlier), "paired t (Student 1908)"
    if test.kind == "trend":
        return _trend(test, studies)
    if test.kind == "shrinks":
        (first, a, blocked_a), (then, b, blocked_b) = _effect(studies[test.study], test), _effect(studies[test.then], test)
        gaps = (f"{statistics.fmean(first):+.4f} vs {statistics.fmean(then):+.4f}" if first and then else "-")
        name = "Welch t (Welch 1947)" + (POOLED if blocked_a or blocked_b else "")
        return combined(a, b), f"{len(first)} vs {len(then)} pairs", gaps, name
    return _versus(test, studies)


def family_adjusted(claims: Sequence[Claim], p_values: Sequence[float]) -> list[float]:
    """Each claim's p adjusted for the family: Bonferroni within a member (claims on the same
    trials), Holm across the members on each member's smallest; NaN (no test) stays NaN."""
    members = list(dict.fromkeys(c.member for c in claims))
    size = {m: sum(c.member == m for c in claims) for m in members}
    inside = [math.nan if math.isnan(p) else min(1.0, p * size[c.member]) for c, p in zip(claims, p_values)]
    best = [min((p for c, p in zip(claims, inside) if c.member == m and not math.isnan(p)), default=math.nan)
            for m in members]
    across = dict(zip(members, holm(best)))
    return [math.nan if math.isnan(p) else max(p, across[c.member]) for c, p in zip(claims, inside)]


def evaluate_claims(claims: Sequence[Claim], studies: Mapping[str, Experiment]) -> list[ClaimResult]:
    """Test ``claims`` on ``studies`` (their studies by name, loaded) as one family, corrected as
    the module doc says; a claim whose studies are not all there is ``not run`` and takes no part."""
    ran = [c for c in claims if all(s in studies for s in c.test.studies)]
    measured = [_estimate(c, studies) for c in ran]
    estimates = [m[0] for m in measured]
    own = [e.p_below(c.margin) if c.expect == "no_gain" else e.p_two_sided() for c, e in zip(ran, estimates)]
    adjusted = family_adjusted(ran, own)
    contrary = family_adjusted(ran, [e.p_above(c.margin) if c.expect == "no_gain" else math.nan
                                     for c, e in zip(ran, estimates)])
    equivalence = family_adjusted(ran, [e.p_equivalent(c.sesoi) if c.sesoi and c.expect != "no_gain" else math.nan
                                        for c, e in zip(ran, estimates)])
    level = {c.id: c.alpha / max(1, len({x.member for x in ran})) for c in ran}  # Holm's first step
    out: dict[str, ClaimResult] = {}
    for c, (e, n, arms, name), p, p_adj, p_con, p_eq in zip(ran, measured, own, adjusted, contrary, equivalence):
        low, high = e.interval()
        said = verdict(c.expect, e, p_adjusted=p_adj, p_contrary=p_con, p_equivalence=p_eq, alpha=c.alpha)
        detectable = e.detectable(level[c.id]) if said == "inconclusive" else math.nan
        out[c.id] = ClaimResult(c, e.diff, low, high, p, n, arms, said, name, p_adjusted=p_adj, p_equivalence=p_eq,
                                detectable=detectable, estimate=e,
                                seeds_needed=e.seeds_for(c.sesoi, seeds=_seeds(c, studies), alpha=level[c.id])
                                if c.sesoi else None)
    return [out.get(c.id) or ClaimResult(c, math.nan, math.nan, math.nan, math.nan, "-", "-", "not run", "-")
            for c in claims]


def _seeds(claim: Claim, studies: Mapping[str, Experiment]) -> int:
    """The seeds per grid point of the claim's study (its spec's ``algorithm.seeds``)."""
    algorithm = ((studies[claim.test.study].spec.get("spec") or {}).get("algorithm") or {})
    return int(algorithm.get("seeds") or 1)


def evaluate_claim(claim: Claim, studies: Mapping[str, Experiment]) -> ClaimResult:
    """One claim tested alone (a family of one: no correction); see :func:`evaluate_claims`."""
    return evaluate_claims([claim], studies)[0]

"""docs/claims.md: the papers' claims against ours, written from the claims suite's studies."""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from search.results.claims import VERDICTS, ClaimResult
from search.results.query import Experiment
from search.results.replicates import REPLICATE_COLUMN
from search.spec import SearchSpec
from search.spec.validation import SpecLocation, from_plain
from search.study.suite import SuiteStudy
from trainers.errors import ConfigError

__all__ = ["claims_table", "claims_page", "difference_text", "suite_line", "write_claims_page"]


def _number(value: float, objective: str, *, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "-"
    if objective.endswith("acc"):  # accuracies as percentage points
        return f"{value * 100:+.2f} pp" if signed else f"{value * 100:.2f}"
    return f"{value:+,.4g}" if signed else f"{value:,.4g}"


def difference_text(r: ClaimResult) -> str:
    """The claim's difference with its 95% interval, e.g. '+11.54 pp (+1.72 pp to +21.37 pp)'."""
    objective = r.claim.test.metric
    if math.isnan(r.diff):
        return "-"
    around = "" if math.isnan(r.low) else (f" ({_number(r.low, objective, signed=True)} to "
                                           f"{_number(r.high, objective, signed=True)})")
    return _number(r.diff, objective, signed=True) + around


def _p(value: float) -> str:
    return "-" if math.isnan(value) else "<0.0001" if value < 1e-4 else f"{value:.4f}"


def _what(r: ClaimResult) -> str:
    t = r.claim.test
    measure = t.metric + (f" after epoch {t.epoch}" if t.epoch else "")
    if t.kind == "effect":
        return f"{t.knob} {t.value} minus {t.baseline}, {measure} ({t.study})"
    if t.kind == "shrinks":
        return f"gap ({t.knob} {t.value} minus {t.baseline}) in {t.study} minus in {t.then}, {measure}"
    if t.kind == "trend":
        return (f"gap ({t.knob} {t.value} minus {t.baseline}), {measure}, its slope per tenfold data over "
                f"{', '.join(t.over)}")
    if t.kind == "mechanism":
        where = f"{t.study}" + (" at " + ", ".join(f"{k} {v}" for k, v in t.at.items()) if t.at else "")
        if t.contrast == "training":
            return f"mean {t.mechanism} after the last epoch minus after the first, per trial ({where})"
        return f"mean {t.mechanism} of the deepest block minus the first, after the last epoch, per trial ({where})"
    point = ", ".join(f"{k} {v}" for k, v in t.at.items())
    return f"{t.study} at {point} minus {t.control}, {measure}"


EXPECTS = {"higher": "above 0", "lower": "below 0", "no_gain": "below the margin"}


def _protocol(r: ClaimResult) -> str:
    """What the claim was fixed to before the run: the side, alpha, the smallest effect of interest."""
    objective = r.claim.test.metric
    unit = " pp" if objective.endswith("acc") else ""
    side = EXPECTS[r.claim.expect] + (f" (+{_number(r.claim.margin, objective)}{unit})" if r.claim.expect == "no_gain" else "")
    sesoi = f", sesoi {_number(r.claim.sesoi, objective)}{unit}" if r.claim.sesoi else ""
    family = f", family {r.claim.family}" if r.claim.family else ""
    return f"{side}; alpha {r.claim.alpha:g}{sesoi}{family}"


def _verdict_text(r: ClaimResult) -> str:
    """The verdict, and for an inconclusive one the smallest effect the run could have detected."""
    if r.verdict == "inconclusive" and not math.isnan(r.detectable):
        needed = f"; seeds for the sesoi: {r.seeds_needed}" if r.seeds_needed else ""
        return (f"**inconclusive** (detectable at 80% power: {_number(r.detectable, r.claim.test.metric, signed=True)}"
                f"{needed})")
    if r.verdict == "inconclusive":
        return "**inconclusive** (no test: too few pairs or seeds, or no spread)"
    return f"**{r.verdict}**"


def claims_table(results: Sequence[ClaimResult]) -> list[list[str]]:
    """One row per claim: id, claim, the paper's number, what we measured, its protocol, ours, p
    and Holm's adjusted p, n, means, test, verdict."""
    rows = []
    for r in results:
        rows.append([r.claim.id, r.claim.claim, f"{r.claim.paper_result} [{r.claim.paper}]", _what(r), _protocol(r),
                     difference_text(r), _p(r.p_value), _p(r.p_adjusted), r.n, r.arms, r.test, _verdict_text(r)])
    return rows


def _markdown(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])


def _ran_spec(exp: Experiment) -> SearchSpec:
    """The spec the study ran with, from its own experiment.json (not the YAML as it is now)."""
    plain = exp.spec.get("spec")
    if not isinstance(plain, dict):
        raise ConfigError(f"{exp.path}/experiment.json: no 'spec' object; the study's files are damaged")
    plain = {k: v for k, v in plain.items() if k not in ("source", "profile")}
    return from_plain(SearchSpec, plain, SpecLocation(f"{exp.path}/experiment.json", "spec"))


def _data(spec: SearchSpec) -> str:
    drawn = ", a split per seed" if spec.dataset.split_per_trial else ""
    return f"{spec.dataset.train_fraction:.0%} of {spec.dataset.name}{drawn}"


def _epochs(spec: SearchSpec) -> str:
    budget = spec.budget
    scaled = f" ({budget.full_data_epochs:g} of the whole split)" if budget.full_data_epochs else ""
    patience = f", patience {budget.patience}" if budget.patience else ""
    return f"{budget.max_epochs}{scaled}{patience}"


def _commit(exp: Experiment) -> str:
    """The commit the study's driver ran at, from its experiment.json, marked where tracked files
    differed from it (``+changes``; ``?``: a record from before the flag)."""
    commit = exp.spec.get("git_commit")
    if not commit:
        return "-"
    dirty = exp.spec.get("git_dirty")
    return str(commit)[:7] + (" +changes" if dirty else "" if dirty is False else " ?")


def _spread(values: pd.Series, fmt: str) -> str:
    """'median (min-max)' of ``values`` ('-' where there are none)."""
    values = pd.to_numeric(values, errors="coerce").dropna()
    if values.empty:
        return "-"
    median, low, high = values.median(), values.min(), values.max()
    return fmt.format(median) if low == high else f"{fmt.format(median)} ({fmt.format(low)}-{fmt.format(high)})"


def _final_train_loss(exp: Experiment, trial_ids: pd.Series) -> str:
    """Each trial's train loss in its last epoch, as a spread over the trials."""
    epochs = exp.epochs
    if epochs.empty or "train_loss" not in epochs:
        return "-"
    epochs = epochs[epochs["trial_id"].isin(set(trial_ids))].sort_values("epoch")
    return _spread(epochs.drop_duplicates("trial_id", keep="last")["train_loss"], "{:.3f}")


def _search_trials(exp: Experiment) -> pd.DataFrame:
    """The study's search trials (its confirmation's replicates left out)."""
    trials = exp.trials
    return trials[trials[REPLICATE_COLUMN].isna()] if REPLICATE_COLUMN in trials else trials


def _timing(trials: pd.DataFrame) -> tuple[float, float]:
    """(seconds from the first trial's start to the last one's end, seconds the trials trained)."""
    span = (pd.to_datetime(trials["ended_at"]).max() - pd.to_datetime(trials["started_at"]).min()).total_seconds()
    return (math.nan if pd.isna(span) else span), float(pd.to_numeric(trials["duration_s"]).sum())


def suite_line(studies: Sequence[SuiteStudy], loaded: Mapping[str, Experiment]) -> str:
    """The suite's time: the studies' walls added up (what one run of them all, one after another,
    takes without its set-ups), their training, the devices, and over what dates they ran."""
    ran = [_search_trials(loaded[s.name]) for s in studies if loaded.get(s.name) is not None]
    if not ran:
        return "The suite: no study has run yet."
    timings = [_timing(t) for t in ran]
    wall = sum(w for w, _ in timings if not math.isnan(w))
    trained = sum(t for _, t in timings)
    devices = sorted({d for t in ran if "throughput_device" in t for d in t["throughput_device"].dropna()})
    starts = pd.concat([pd.to_datetime(t["started_at"]) for t in ran]).dropna()
    ends = pd.concat([pd.to_datetime(t["ended_at"]) for t in ran]).dropna()
    when = (f"; the studies ran between {starts.min():%Y-%m-%d %H:%M} and {ends.max():%Y-%m-%d %H:%M} UTC"
            if len(starts) and len(ends) else "")
    return (f"The suite: {len(ran)} of {len(studies)} studies run, {wall / 3600:.2f} h of wall time in all "
            f"(the rows' walls added up: one run of every study after another, set-ups and held-out tests aside), "
            f"{trained / 3600:.2f} h of training; on {', '.join(devices) or 'an unrecorded device'}{when}.")


def _study_row(study: SuiteStudy, exp: Experiment | None) -> list[str]:
    if exp is None:
        spec = study.spec
        plan = spec.grid_plan() or f"{spec.budget.trials} trials"
        return [study.name, spec.candidates[0].name, _data(spec), _epochs(spec), plan, "not run", "-", "-", "-", "-",
                "-", "-"]
    spec = _ran_spec(exp)  # what ran, which the YAML may no longer say
    plan = spec.grid_plan() or f"{spec.budget.trials} trials"
    trials = _search_trials(exp)
    complete = int((trials["state"] == "COMPLETE").sum())
    span, trained = _timing(trials)
    devices = ", ".join(sorted(set(trials["throughput_device"].dropna()))) if "throughput_device" in trials else "-"
    wall = "-" if math.isnan(span) else f"{span / 60:.1f} min ({trained / 60:.1f} min training)"
    unfinished = "" if len(trials) >= spec.planned_trials else f" (unfinished: {spec.planned_trials} planned)"
    ran = exp.spec.get("spec_hash")
    same = ("as the spec" if ran == study.spec.spec_hash
            else f"**stale**: ran {str(ran)[:8]}, {study.spec_path.name} is now {study.spec.spec_hash[:8]}")
    epochs_run = _spread(trials["epochs_run"], "{:.0f}") if "epochs_run" in trials else "-"
    return [study.name, spec.candidates[0].name, _data(spec), _epochs(spec), plan,
            f"{complete} of {len(trials)}{unfinished}", epochs_run, _final_train_loss(exp, trials["trial_id"]), wall,
            devices or "-", _commit(exp), same]


def claims_page(results: Sequence[ClaimResult], studies: Sequence[SuiteStudy], loaded: Mapping[str, Experiment], *,
                command: Sequence[str], profile: str | None, storage: str) -> str:
    """The page's Markdown."""
    counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    out = [
        "# The papers' claims, reproduced on this platform",
        "",
        f"Written by `{shlex.join(command)}` (profile {profile or 'as written'}) from the studies in `{storage}`, "
        "listed at the end; do not edit it by hand, run that command again (it runs only the studies that are missing, stale or "
        "unfinished). The claims and how each is tested: `studies/claims.yaml`; the specs: `studies/*.yaml`.",
        "",
        f"**{len(results)} claims: {summary}.**",
        "",
        "How to read it. Each claim is a difference between two arms of our studies, with its 95% interval: "
        "*effect*: a knob's value minus its baseline value in one grid study, over pairs of trials with the same "
        "seed and the same other knobs (paired t test, Student 1908; where the grid has more than two points and every "
        "point every seed, its variance pooled over the whole grid, the residual of seeds as blocks, which gives it "
        "more degrees of freedom); *shrinks*: that difference in one study minus "
        "the same difference in another (Welch's t test of the two sets of paired differences, Welch 1947); *trend*: "
        "that difference in several studies against log10 of each study's data fraction, the least-squares "
        "slope per tenfold data (its t test on n - 2 degrees of freedom, Draper & Smith 1998); *versus*: "
        "one grid point of a study minus a control study of another model, over seeds (Welch's t test; seed by seed, "
        "a paired t test, where the control is the same code with one part off); *mechanism*: what a model reports "
        "of its own mechanism (ConViT's gates and nonlocality, GMM's kernel widths), per trial after the last epoch "
        "minus after the first, or its deepest block minus its first (a t test over the trials; the curves per "
        "epoch are in the study's report, `python -m search report STUDY`, section *Mechanisms in training*); "
        "an *effect* with a "
        "severity reads each trial's accuracy under the corruptions at that severity minus its clean test accuracy. Each "
        "claim's protocol (the side, alpha, the smallest effect of interest) is fixed in the claims file before the "
        "run, and the verdicts hold at that family-wise alpha: Holm's correction (Holm 1979) across the claims, "
        "claims resting on the same trials counted as one. A claim is **reproduced** when its adjusted test puts "
        "the difference on the side the paper predicts, **contradicted** when on the other side, **smaller than the "
        "paper's** when an equivalence test (TOST, Schuirmann 1987) puts it within the smallest effect of interest, "
        "**inconclusive** otherwise, with the smallest effect the run could have detected at 80% power and, taking "
        "this run as the pilot, the seeds that would detect the smallest effect of interest (Cohen 1988) (a saturation "
        "claim, *below the margin*: reproduced when the difference is below that gain, contradicted when above). "
        "Where a study's seeds were raised to that number, the earlier run served as an internal pilot: only its "
        "spread sized the new run, never its effect, which leaves the test's level as it was (Wittes & Brittain "
        "1990); the new run trains every seed again and is the only one the page reads. "
        "Accuracy differences are in percentage points (pp). The scale is not the paper's: small models, a fraction "
        "of Fashion-MNIST, tens of epochs, a few seeds (the studies' table); "
        "a claim may fail to reproduce at this scale, and an inconclusive one needs more seeds, not a guess.",
        "",
    ]
    out += _markdown(["id", "claim", "the paper", "ours measures", "protocol", "ours (95% interval)", "p",
                      "p (Holm)", "n", "means", "test", "verdict"], claims_table(results))
    out += ["", "## The studies", "",
            "Each row is what the study's own experiment.json records: the spec it ran with, the commit its "
            "driver ran at (*+changes*: tracked files differed from it), and whether that spec is still the one in "
            "its file (*stale*: the file changed since; the suite runs it again). Epochs: the cap (the epochs' worth "
            "of the whole split it comes from, where the epochs scale with the data; the patience that stops a "
            "trial earlier); epochs run and the final train loss: the median over the search's trials, with the "
            "range. Wall time is from the first trial's start to the last trial's end (the set-up before it, a few "
            "seconds to a minute, and the held-out test after it, not counted: the test's time grows with the trials "
            "scored and, where corruptions are asked for, tenfold); training is the sum of the trials' own times.", ""]
    out += _markdown(["study", "model", "data", "epochs", "grid", "COMPLETE", "epochs run", "final train loss", "wall",
                      "device", "commit", "spec"],
                     [_study_row(s, loaded.get(s.name)) for s in studies])
    out += ["", suite_line(studies, loaded)]
    return "\n".join(out) + "\n"


def write_claims_page(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path

"""The spec's sections as records: the dataset, the models and their knobs, the objectives, the
budget, the sampler, the scheduler and the resources of one trial (:class:`search.spec.spec.SearchSpec`
holds one of each). Each checks its own values; what needs several sections is checked there.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field, model_validator

from search.spec.validation import FieldError, Flag, Number, Record, Whole, one_of, settings
from trainers.config import ThroughputSettings, TrainSettings

__all__ = [
    "DatasetSpec",
    "ModelSpec",
    "ParamSpec",
    "Objective",
    "ConfirmSpec",
    "Budget",
    "AlgorithmSpec",
    "SchedulerSpec",
    "Resources",
    "OBJECTIVE_METRICS",
    "RANKINGS",
    "GRID_MAX_SEEDS",
    "TrainSettingsField",
    "ThroughputSettingsField",
]

# Metrics a study can optimise; each is a column of trials.parquet.
OBJECTIVE_METRICS = ("val_acc", "val_loss", "throughput", "params", "flops")

# trainers' settings (stdlib dataclasses, checked by their own __post_init__) as spec fields
TrainSettingsField = settings(TrainSettings)
ThroughputSettingsField = settings(ThroughputSettings)


# How MO-ASHA orders one front of a rung at its quota's edge (search.study.mo_asha, rule 5):
# NSGA-II's crowding distance, or each point's exclusive hypervolume contribution (SMS-EMOA's;
# Schmucker et al. 2021 compare such orderings for MO-ASHA). Both give a front's extreme points infinity.
RANKINGS = ("crowding", "hv_contribution")

# Which seed draws a trial's training subset and validation split: the study's (algorithm.seed,
# every trial on the same images) or the trial's own (a grid's seeds, a replicate's), so that a
# claim's interval covers the draw of the data as well as the initialisation.
SPLIT_SEEDS = ("study", "trial")


class DatasetSpec(Record):
    name: str
    train_fraction: Number = 1.0
    val_fraction: Number = 0.1
    image_size: Whole | None = None
    data_dir: str | None = None
    split_seed: one_of(*SPLIT_SEEDS) | None = None  # type: ignore[valid-type]  # None: "study", as before the key
    # the held-out test also on corrupted copies of the test split (trainers.corruptions); None: no
    corruptions: Flag | None = None

    @property
    def split_per_trial(self) -> bool:
        return self.split_seed == "trial"

    @model_validator(mode="after")
    def _check(self) -> "DatasetSpec":
        if not 0.0 < self.train_fraction <= 1.0:
            raise FieldError("train_fraction", f"must be in (0, 1], got {self.train_fraction}; 0.1 keeps 10% of each class")
        if not 0.0 < self.val_fraction < 1.0:
            raise FieldError("val_fraction", f"must be in (0, 1), got {self.val_fraction}; 0.1 holds out 10% of the training split")
        if self.image_size is not None and self.image_size < 4:
            raise FieldError("image_size", f"must be at least 4 pixels, got {self.image_size}")
        return self


class ModelSpec(Record):
    """A timm model name, its fixed constructor arguments and (in ``models:``) its own knobs."""

    name: str
    args: dict[str, Any] = Field(default_factory=dict)
    space: dict[str, "ParamSpec"] = Field(default_factory=dict)


class ParamSpec(Record):
    """One searched knob. Bounds are inclusive, for floats and integers alike."""

    type: one_of("uniform", "loguniform", "int", "choice")  # type: ignore[valid-type]
    low: Number | None = None
    high: Number | None = None
    values: tuple[Any, ...] | None = None
    step: Number | None = None
    log: Flag = False
    # a choice whose values are ordered as listed (widths, depths, a few learning rates): the sampler
    # draws a position among them, so TPE's Parzen estimators and a GP see neighbours
    ordered: Flag | None = None

    @model_validator(mode="after")
    def _check(self) -> "ParamSpec":
        if self.ordered is not None and self.type != "choice":
            raise FieldError("ordered", f"only a choice takes ordered; a {self.type} range is ordered already")
        if self.type == "choice":
            if not self.values:
                raise FieldError("values", "a choice needs a non-empty list: values: [a, b]")
            if self.low is not None or self.high is not None:
                raise FieldError("", "a choice takes 'values', not low/high")
            if self.step is not None or self.log:
                raise FieldError("step" if self.step is not None else "log", "a choice takes 'values' only")
            return self
        if self.values is not None:
            raise FieldError("values", f"'{self.type}' takes low and high, not values; use type: choice for a list")
        for key in ("low", "high"):
            if getattr(self, key) is None:
                raise FieldError(key, f"missing; a {self.type} range needs low and high")
        assert self.low is not None and self.high is not None
        if self.low > self.high:
            raise FieldError("low", f"low ({self.low}) is greater than high ({self.high}); swap them")
        if self.type in ("uniform", "loguniform") and self.low == self.high:
            raise FieldError("high", f"the range [{self.low}, {self.high}] is empty; widen it or fix the value in model.args / train")
        if self.type == "loguniform" and self.low <= 0:
            raise FieldError("low", f"a loguniform range needs low > 0, got {self.low}")
        if self.log and self.type != "int":
            raise FieldError("log", f"only an int range takes log; a log-scaled {self.type} range is type: loguniform")
        if self.type == "int":
            if self.low != int(self.low) or self.high != int(self.high):
                raise FieldError("low", "an int range needs whole-number bounds")
            if self.log and self.low < 1:
                raise FieldError("low", "a log-scaled int range needs low >= 1")
            if self.step is not None and self.step != int(self.step):
                raise FieldError("step", f"an int range needs a whole-number step, got {self.step}")
        if self.step is not None and self.step <= 0:
            raise FieldError("step", f"must be positive, got {self.step}")
        # Optuna samples a log scale or a step, not both (suggest_float / suggest_int raise mid-run)
        if self.step is not None and (self.type == "loguniform" or self.log) and not (self.type == "int" and self.step == 1):
            raise FieldError("step", "a log-scaled range takes no step; remove step or use type: uniform / int without log")
        return self

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None and v is not False}

    def levels(self, n: int) -> tuple[float, ...]:
        """``n`` values of a continuous range, low and high included: evenly spaced, or evenly in
        log space for a loguniform one; a range with a step takes its steps instead. Interior values
        are rounded to 4 significant digits (what the store and the pages show) where that keeps
        them apart."""
        assert self.type in ("uniform", "loguniform") and self.low is not None and self.high is not None
        low, high = float(self.low), float(self.high)
        if self.step is not None:
            return tuple(low + k * float(self.step) for k in range(int((high - low) / float(self.step) + 1e-9) + 1))
        if self.type == "loguniform":
            inner = [math.exp(math.log(low) + k * (math.log(high) - math.log(low)) / (n - 1)) for k in range(1, n - 1)]
        else:
            inner = [low + k * (high - low) / (n - 1) for k in range(1, n - 1)]
        rounded = [float(f"{v:.4g}") for v in inner]
        return (low, *(rounded if len({low, *rounded, high}) == n else inner), high)


# The hypervolume's reference point where the spec gives none: the worst value a maximised
# metric can take. Minimised metrics have no natural bound; give `reference:` for them.
DEFAULT_REFERENCE = {"val_acc": 0.0, "throughput": 0.0}


class Objective(Record):
    metric: str
    mode: one_of("max", "min")  # type: ignore[valid-type]
    reference: Number | None = None  # hypervolume reference: a value worse than any trial's

    @model_validator(mode="after")
    def _check(self) -> "Objective":
        if self.metric not in OBJECTIVE_METRICS:
            raise FieldError("metric", f"unknown metric {self.metric!r}; use one of {', '.join(OBJECTIVE_METRICS)}")
        return self

    @property
    def reference_value(self) -> float | None:
        if self.reference is not None:
            return self.reference
        return DEFAULT_REFERENCE.get(self.metric) if self.mode == "max" else None


class ConfirmSpec(Record):
    """After the search: the front's configs (and those tied with it) trained again with more seeds.

    ``fixed``: each of the ``top`` configs gets ``seeds`` further seeds. ``race``: the next seed
    goes to the config another seed is most likely to move (tied, or dominated within noise), at
    most ``seeds`` per config and ``replicates`` in all (default top x seeds), until every config
    is separated (search.study.race)."""

    seeds: Annotated[Whole, Field(ge=1, le=100)]  # further seeds per config (race: at most), beside the search's own
    top: Annotated[Whole, Field(ge=1, le=1000)] = 8  # at most this many configs: the front first, then those tied with it
    strategy: one_of("fixed", "race") = "fixed"  # type: ignore[valid-type]
    replicates: Annotated[Whole, Field(ge=1, le=100_000)] | None = None  # race: the replicate trials in all

    @model_validator(mode="after")
    def _check(self) -> "ConfirmSpec":
        if self.replicates is not None and self.strategy != "race":
            raise FieldError("replicates", "is the race's budget; set strategy: race, or leave replicates out "
                                           "(fixed runs top x seeds)")
        return self

    @property
    def budget(self) -> int:
        """The replicate trials the stage may run."""
        return self.replicates if self.replicates is not None else self.top * self.seeds


def first_rung(max_epochs: int) -> int:
    """The default first rung of a stopping scheduler: max(1, round(max_epochs / 16)) epochs, 1 up
    to 23 epochs. A 1-epoch rung stops late bloomers on long budgets; this rule was chosen on LCBench
    task 126025 and held out on 126029 (docs/search_efficiency.md, "A later first rung")."""
    return max(1, round(max_epochs / 16))


MAX_TRIALS = 100_000  # the driver keeps every trial's row, Tune every trial's state: split a larger search


class Budget(Record):
    trials: Whole | None = None  # required, except by a grid: its points x seeds
    max_epochs: Whole | None = None  # required, unless full_data_epochs gives it
    # the epochs' worth of images of the whole training split: a study at train_fraction f trains
    # full_data_epochs / f epochs (rounded up), so every fraction sees as many images (ConViT's
    # Table 2 protocol); with patience, a cap
    full_data_epochs: Number | None = None
    # the scheduler's first rung; left out: first_rung(max_epochs) under asha/mo_asha, 1 without one
    grace_epochs: Whole | None = None
    patience: Whole | None = None
    time_limit_s: Number | None = None
    max_failures: Whole = 0  # retries of a trial that raised (from its last checkpoint)
    confirm: ConfirmSpec | None = None  # confirmation seeds (search.study.confirm); off when left out

    @model_validator(mode="after")
    def _check(self) -> "Budget":  # max_epochs from full_data_epochs: SearchSpec's check (it knows the fraction)
        if self.trials is not None and self.trials < 1:
            raise FieldError("trials", f"must be at least 1, got {self.trials}")
        if self.trials is not None and self.trials > MAX_TRIALS:
            raise FieldError("trials", f"must be at most {MAX_TRIALS:,}, got {self.trials:,} (the driver keeps every "
                                       "trial in memory); split the search into several studies")
        if self.max_epochs is None and self.full_data_epochs is None:
            raise FieldError("max_epochs", "missing; add 'max_epochs:' (a whole number), or full_data_epochs to scale "
                                           "the epochs with the data fraction")
        if self.full_data_epochs is not None and not self.full_data_epochs > 0:
            raise FieldError("full_data_epochs", f"must be above 0, got {self.full_data_epochs}")
        if self.max_epochs is not None and self.max_epochs < 1:
            raise FieldError("max_epochs", f"must be at least 1, got {self.max_epochs}")
        if self.max_epochs is not None and self.grace_epochs is not None and not 1 <= self.grace_epochs <= self.max_epochs:
            raise FieldError("grace_epochs", f"must be between 1 and max_epochs ({self.max_epochs}), got {self.grace_epochs}")
        if self.patience is not None and self.patience < 1:
            raise FieldError("patience", f"must be at least 1 epoch (or leave it out), got {self.patience}")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise FieldError("time_limit_s", f"must be positive seconds, got {self.time_limit_s}")
        if self.max_failures < 0:
            raise FieldError("max_failures", f"must be >= 0 retries, got {self.max_failures}")
        return self


GRID_MAX_SEEDS = 100  # a grid's seeds per point, at most
BOTORCH_MAX_LEVELS = 100  # values per continuous knob under botorch, at most


class AlgorithmSpec(Record):
    """An Optuna sampler (tpe, gp, nsga2, random; botorch: BoTorch's qLogNEHVI over every point of a
    finite space, search.study.finite_bo), or ``grid``: every point of the space (the product of
    each knob's values), each trained with ``seeds`` seeds, for ablations (`grid_points`)."""

    name: one_of("tpe", "gp", "botorch", "nsga2", "random", "grid") = "tpe"  # type: ignore[valid-type]
    seed: Annotated[Whole, Field(ge=0, le=2**32 - 1)] = 0  # numpy's seeds: 0 to 2**32 - 1; others fail the sampler mid-run
    n_startup_trials: Annotated[Whole, Field(ge=0)] | None = None  # tpe, gp, botorch: random trials before the model kicks in
    # grid: seeds per point, seed + 0 .. seed + seeds - 1 (None: 1; left out of the hash of other studies)
    seeds: Annotated[Whole, Field(ge=1, le=GRID_MAX_SEEDS)] | None = None
    # botorch: the values each continuous knob (uniform, loguniform) is searched at, evenly spaced
    # (in log space for loguniform; ParamSpec.levels); None: botorch takes finite knobs only
    levels: Annotated[Whole, Field(ge=2, le=BOTORCH_MAX_LEVELS)] | None = None

    @model_validator(mode="after")
    def _check(self) -> "AlgorithmSpec":
        if self.n_startup_trials is not None and self.name not in ("tpe", "gp", "botorch"):
            raise FieldError("n_startup_trials", f"only tpe, gp and botorch start with random trials; remove it for "
                             f"{self.name}")
        if self.levels is not None and self.name != "botorch":
            raise FieldError("levels", f"only botorch searches continuous knobs at levels; remove it for {self.name}, "
                             "which samples them as ranges")
        if self.seeds is not None and self.name != "grid":
            raise FieldError("seeds", f"only a grid trains each point with several seeds; remove it for {self.name} "
                             "(or use budget.confirm for further seeds of the front)")
        if self.seeds is not None and self.seed + self.seeds - 1 > 2**32 - 1:
            raise FieldError("seed", f"the grid's seeds run from {self.seed} to {self.seed + self.seeds - 1}, past "
                             f"2**32 - 1; use a seed of at most {2**32 - self.seeds}")
        return self

    @property
    def grid_seeds(self) -> tuple[int, ...]:
        """The training seeds of every grid point: seed, seed + 1, ... (one per ``seeds``), the same
        at every point, so two points' trials pair up by seed."""
        return tuple(self.seed + k for k in range(self.seeds or 1))


class SchedulerSpec(Record):
    """asha: Ray's ASHA on val_acc alone; mo_asha: promotes by Pareto rank over all objectives;
    left out, the one docs/spec.md advises (`resolved`)."""

    name: one_of("asha", "mo_asha", "none") | None = None  # type: ignore[valid-type]
    reduction_factor: Number = 2.0
    # mo_asha's options (search.study.mo_asha.MOASHAScheduler); None: its defaults (crowding, true),
    # and left out of the spec hash, so studies from before these keys keep theirs
    ranking: one_of(*RANKINGS) | None = None  # type: ignore[valid-type]
    keep_front: Flag | None = None

    @model_validator(mode="after")
    def _check(self) -> "SchedulerSpec":
        if self.reduction_factor <= 1:
            raise FieldError("reduction_factor", f"must be > 1, got {self.reduction_factor}; 2 or 3 is usual")
        if self.reduction_factor < 1.01:  # rungs at grace * rf**k: thousands of them below that, millions near 1
            raise FieldError("reduction_factor", f"must be at least 1.01, got {self.reduction_factor}; 2 or 3 is usual")
        return self

    def resolved(self, objectives: int) -> "SchedulerSpec":
        """This scheduler with its name set: as given, else mo_asha for a study of two objectives or
        more (ASHA judges val_acc alone) and asha for one. Called by SearchSpec's check: an error
        names its key from the spec's top (``scheduler.ranking``)."""
        name = self.name or ("mo_asha" if objectives > 1 else "asha")
        for key in ("ranking", "keep_front"):
            if name != "mo_asha" and getattr(self, key) is not None:
                default = "" if self.name else " (the default with one objective)"
                raise FieldError(f"scheduler.{key}", f"only mo_asha takes {key}; remove it for {name}{default}, "
                                 "or set scheduler.name: mo_asha")
        return self if name == self.name else self.model_copy(update={"name": name})


class Resources(Record):
    """What one trial asks of a Ray node: Ray only starts it on a node with all of it free."""

    cpus: Number = 1.0
    gpus: Number = 0.0  # fractions share a GPU: 0.25 runs four trials on one
    custom: dict[str, Number] = Field(default_factory=dict)  # e.g. {a100: 1}: `ray start --resources`

    @model_validator(mode="after")
    def _check(self) -> "Resources":
        if self.cpus <= 0:
            raise FieldError("cpus", f"must be positive, got {self.cpus}")
        if self.gpus < 0:
            raise FieldError("gpus", f"must be >= 0, got {self.gpus}; 0.5 shares a GPU between two trials")
        if self.gpus > 1 and self.gpus != int(self.gpus):
            raise FieldError("gpus", f"above 1 must be a whole number, got {self.gpus} (Ray's rule)")
        for name, amount in self.custom.items():
            if name.upper() in ("CPU", "GPU", "CPUS", "GPUS", "MEMORY"):
                raise FieldError("custom", f"{name!r} is a built-in resource; set resources.cpus / resources.gpus instead")
            if amount <= 0:
                raise FieldError("custom", f"{name}: must be positive, got {amount}")
        return self

    def ray_resources(self) -> dict[str, float]:
        """The request in ``tune.with_resources``' terms."""
        return {"cpu": self.cpus, "gpu": self.gpus, **self.custom}

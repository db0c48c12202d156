"""The search spec: one YAML file in ``spaces/`` -> a frozen, validated :class:`SearchSpec`.

Space keys are either a training setting (a field of :class:`TrainSettings`) or a keyword
argument of the model constructor; nothing renames them on the way to the trainer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Callable

import yaml

from pydantic import Field, ValidationError, model_validator

from search.spec.validation import (FieldError, Flag, Number, Record, SpecLocation, Whole, first_error, from_plain,
                                    one_of, settings)
from trainers.config import TRAIN_KEYS, Constraint, SettingError, ThroughputSettings, TrainSettings
from trainers.errors import ConfigError

__all__ = [
    "SearchSpec",
    "DatasetSpec",
    "ModelSpec",
    "TrainSettings",
    "ParamSpec",
    "Objective",
    "Budget",
    "ConfirmSpec",
    "AlgorithmSpec",
    "SchedulerSpec",
    "Resources",
    "ThroughputSettings",
    "load_spec",
    "SpecProfiles",
    "deep_merge",
    "pick_profile",
    "OBJECTIVE_METRICS",
]

# Metrics a study can optimise; each is a column of trials.parquet.
OBJECTIVE_METRICS = ("val_acc", "val_loss", "throughput", "params", "flops")

# trainers' settings (stdlib dataclasses, checked by their own __post_init__) as spec fields
TrainSettingsField = settings(TrainSettings)
ThroughputSettingsField = settings(ThroughputSettings)


class DatasetSpec(Record):
    name: str
    train_fraction: Number = 1.0
    val_fraction: Number = 0.1
    image_size: Whole | None = None
    data_dir: str | None = None

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

    @model_validator(mode="after")
    def _check(self) -> "ParamSpec":
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
    """After the search: the front's configs (and those tied with it) trained again with more seeds."""

    seeds: Annotated[Whole, Field(ge=1, le=100)]  # further seeds per config, beside the search's own
    top: Annotated[Whole, Field(ge=1, le=1000)] = 8  # at most this many configs: the front first, then those tied with it


class Budget(Record):
    trials: Whole | None = None  # required, except by a grid: its points x seeds
    max_epochs: Whole
    grace_epochs: Whole = 1
    patience: Whole | None = None
    time_limit_s: Number | None = None
    max_failures: Whole = 0  # retries of a trial that raised (from its last checkpoint)
    confirm: ConfirmSpec | None = None  # confirmation seeds (search.study.confirm); off when left out

    @model_validator(mode="after")
    def _check(self) -> "Budget":
        if self.trials is not None and self.trials < 1:
            raise FieldError("trials", f"must be at least 1, got {self.trials}")
        if self.max_epochs < 1:
            raise FieldError("max_epochs", f"must be at least 1, got {self.max_epochs}")
        if not 1 <= self.grace_epochs <= self.max_epochs:
            raise FieldError("grace_epochs", f"must be between 1 and max_epochs ({self.max_epochs}), got {self.grace_epochs}")
        if self.patience is not None and self.patience < 1:
            raise FieldError("patience", f"must be at least 1 epoch (or leave it out), got {self.patience}")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise FieldError("time_limit_s", f"must be positive seconds, got {self.time_limit_s}")
        if self.max_failures < 0:
            raise FieldError("max_failures", f"must be >= 0 retries, got {self.max_failures}")
        return self


GRID_MAX_POINTS = 1000  # a grid's points (the product of its knobs' values), at most
GRID_MAX_SEEDS = 100


def grid_values(param: ParamSpec) -> tuple[Any, ...] | None:
    """The values a grid takes of ``param``: its choices, or every step of an int range from low
    to high; None for a continuous range (a grid needs its values listed)."""
    if param.type == "choice":
        return tuple(param.values or ())
    if param.type == "int":
        return tuple(range(int(param.low), int(param.high) + 1, int(param.step or 1)))
    return None


def _grid_size(param: ParamSpec) -> int:
    """len(grid_values(param)) without listing an int range (which may be huge)."""
    if param.type == "int":
        return (int(param.high) - int(param.low)) // int(param.step or 1) + 1
    return len(param.values or ())


def _distinct(values: Sequence[Any]) -> list[Any]:
    """``values`` without repeats (1 and 1.0 are one value, as in the store's column)."""
    out: list[Any] = []
    for v in values:
        if not any(v == o and isinstance(v, str) == isinstance(o, str) for o in out):
            out.append(v)
    return out


class AlgorithmSpec(Record):
    """An Optuna sampler (tpe, nsga2, random), or ``grid``: every point of the space (the product
    of each knob's values), each trained with ``seeds`` seeds, for ablations (`grid_points`)."""

    name: one_of("tpe", "nsga2", "random", "grid") = "tpe"  # type: ignore[valid-type]
    seed: Annotated[Whole, Field(ge=0, le=2**32 - 1)] = 0  # numpy's seeds: 0 to 2**32 - 1; others fail the sampler mid-run
    n_startup_trials: Annotated[Whole, Field(ge=0)] | None = None  # tpe: random trials before the model kicks in
    # grid: seeds per point, seed + 0 .. seed + seeds - 1 (None: 1; left out of the hash of other studies)
    seeds: Annotated[Whole, Field(ge=1, le=GRID_MAX_SEEDS)] | None = None

    @model_validator(mode="after")
    def _check(self) -> "AlgorithmSpec":
        if self.n_startup_trials is not None and self.name != "tpe":
            raise FieldError("n_startup_trials", f"only tpe starts with random trials; remove it for {self.name}")
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
    """asha: Ray's ASHA on val_acc alone; mo_asha: promotes by Pareto rank over all objectives."""

    name: one_of("asha", "mo_asha", "none") = "asha"  # type: ignore[valid-type]
    reduction_factor: Number = 2.0

    @model_validator(mode="after")
    def _check(self) -> "SchedulerSpec":
        if self.reduction_factor <= 1:
            raise FieldError("reduction_factor", f"must be > 1, got {self.reduction_factor}; 2 or 3 is usual")
        if self.reduction_factor < 1.01:  # rungs at grace * rf**k: thousands of them below that, millions near 1
            raise FieldError("reduction_factor", f"must be at least 1.01, got {self.reduction_factor}; 2 or 3 is usual")
        return self


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


class SearchSpec(Record):
    name: str
    dataset: DatasetSpec
    objectives: tuple[Objective, ...]
    budget: Budget
    model: ModelSpec | None = None  # one model ...
    models: tuple[ModelSpec, ...] | None = None  # ... or a choice of models, each with its own knobs
    space: dict[str, ParamSpec] = Field(default_factory=dict)  # knobs every model shares
    train: TrainSettingsField = Field(default_factory=TrainSettings)  # type: ignore[valid-type]
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    resources: Resources = Field(default_factory=Resources)
    throughput: ThroughputSettingsField = Field(default_factory=ThroughputSettings)  # type: ignore[valid-type]
    constraints: tuple[str, ...] = ()  # e.g. "throughput >= 5000": broken ones are rejected untrained
    storage: str = "results"
    description: str = ""
    # the file it came from: set by load_spec, not a YAML key (`internal`: not offered in messages)
    source: str = Field(default="", json_schema_extra={"internal": True})
    # the profile of the file's `profiles:` it was built with ("" where none): set by load_spec
    profile: str = Field(default="", json_schema_extra={"internal": True})

    @model_validator(mode="after")
    def _check(self) -> "SearchSpec":
        if not self.name or any(c in self.name for c in "/\\ \t") or self.name.startswith("."):
            raise FieldError("name", f"{self.name!r} is not usable as a folder name; use letters, digits, '_' or '-'")
        if not self.objectives:
            raise FieldError("objectives", "list at least one, e.g. - {metric: val_acc, mode: max}")
        metrics = [o.metric for o in self.objectives]
        if len(set(metrics)) != len(metrics):
            raise FieldError("objectives", f"a metric is listed twice: {metrics}")
        if (self.model is None) == (self.models is None):
            raise FieldError("model", "give either 'model:' (one model) or 'models:' (a list to choose from), not both or neither")
        if self.models is not None:
            if not self.models:
                raise FieldError("models", "is empty; list at least one {name: ..., space: {...}}")
            names = [m.name for m in self.models]
            if len(set(names)) != len(names):
                raise FieldError("models", f"a model is listed twice: {names}; merge the entries")
        elif self.model is not None and self.model.space:
            raise FieldError("model.space", "per-model knobs belong to 'models:' entries; put single-model knobs under 'space:'")
        if not self.space and not any(m.space for m in self.candidates):
            raise FieldError("space", "is empty; add at least one knob, e.g. lr: {type: loguniform, low: 1e-4, high: 1e-2}")
        if "model" in self.space or any("model" in m.space for m in self.candidates):
            raise FieldError("space", "'model' is the choice between the entries of 'models:'; it cannot be a knob")
        for i, text in enumerate(self.constraints):
            try:
                Constraint.parse(text)
            except SettingError as exc:
                raise FieldError(f"constraints[{i}]", str(exc)) from None
        if self.algorithm.name == "grid":
            self._check_grid()
            if self.budget.trials is None:  # what a grid runs; frozen record, so set in place once
                object.__setattr__(self, "budget", self.budget.model_copy(update={"trials": self.planned_trials}))
        elif self.budget.trials is None:
            raise FieldError("budget.trials", "missing; add 'trials:' (a whole number)")
        return self

    def _check_grid(self) -> None:
        if self.conditional:
            raise FieldError("models", "a grid runs one model; conditional spaces (several models:) are not supported "
                             "for algorithm: grid: run one grid study per model")
        if self.budget.confirm is not None:
            raise FieldError("budget.confirm", "a grid trains every point with algorithm.seeds seeds already; "
                             "remove budget.confirm (or raise algorithm.seeds)")
        params = {f"space.{k}": p for k, p in self.space.items()}
        params.update({f"models[0].space.{k}": p for k, p in self.candidates[0].space.items()})
        points = 1
        for path, param in params.items():
            knob = path.rsplit(".", 1)[1]
            if param.type in ("uniform", "loguniform"):
                raise FieldError(path, f"grid: knob {knob} is continuous; list its values with type: choice")
            if param.type == "choice" and len(_distinct(param.values or ())) != len(param.values or ()):
                raise FieldError(path, f"grid: knob {knob} lists a value twice; list each value once")
            points *= _grid_size(param)
        if points > GRID_MAX_POINTS:
            sizes = " x ".join(str(_grid_size(p)) for p in params.values())
            raise FieldError("space", f"grid of {points} points ({sizes} values), more than {GRID_MAX_POINTS}; "
                             "list fewer values (type: choice) or give int ranges a larger step")

    # -- derived -------------------------------------------------------------------------
    @property
    def candidates(self) -> tuple[ModelSpec, ...]:
        """The models the search chooses from (one for a plain ``model:`` spec)."""
        return self.models if self.models is not None else (self.model,)  # type: ignore[return-value]

    @property
    def conditional(self) -> bool:
        """True when the model itself is searched (the ``model`` column is a knob)."""
        return len(self.candidates) > 1

    @property
    def is_grid(self) -> bool:
        return self.algorithm.name == "grid"

    def grid_points(self) -> list[dict[str, Any]]:
        """Every point of a grid study's space (the product of its knobs' `grid_values`), the
        first knob varying slowest, as {knob: value}."""
        knobs = self.all_params()
        values = [grid_values(p) for p in knobs.values()]
        assert all(v is not None for v in values), "grid_points of a spec with a continuous knob"
        return [dict(zip(knobs, point)) for point in itertools.product(*values)]  # type: ignore[arg-type]

    @property
    def planned_trials(self) -> int:
        """The trials a run makes: a grid's points x seeds, else budget.trials."""
        if self.is_grid:
            return len(self.grid_points()) * len(self.algorithm.grid_seeds)
        return self.budget.trials

    def grid_plan(self) -> str:
        """'grid of 6 points x 2 seeds = 12 trials' ('' for a sampler's study)."""
        if not self.is_grid:
            return ""
        points, seeds = len(self.grid_points()), len(self.algorithm.grid_seeds)
        return (f"grid of {points} point{'s' * (points != 1)} x {seeds} seed{'s' * (seeds != 1)} = "
                f"{points * seeds} trial{'s' * (points * seeds != 1)}")

    def notes(self) -> list[str]:
        """What a run of this spec does that its text may not say (printed by `check` and `run`)."""
        notes = []
        if self.is_grid and self.budget.trials != self.planned_trials:
            notes.append(f"budget.trials is {self.budget.trials}, but a grid runs every point once per seed: "
                         f"{self.grid_plan()} (the study records that many)")
        if self.is_grid and self.scheduler.name != "none":
            notes.append(f"scheduler {self.scheduler.name} stops grid trials early (PRUNED rows are left out of "
                         "`python -m search effects`); scheduler: {name: none} trains every point to the end")
        return notes

    def all_params(self) -> dict[str, ParamSpec]:
        """Every knob of every model (a key shared between models has one definition)."""
        params = dict(self.space)
        for model in self.candidates:
            params.update(model.space)
        return params

    @property
    def parsed_constraints(self) -> tuple[Constraint, ...]:
        return tuple(Constraint.parse(text) for text in self.constraints)

    @property
    def reference_point(self) -> list[float] | None:
        """The hypervolume's reference point, one value per objective (None: a min objective lacks one)."""
        values = [o.reference_value for o in self.objectives]
        return None if any(v is None for v in values) else [float(v) for v in values]  # type: ignore[arg-type]

    @property
    def experiment_dir(self) -> Path:
        return Path(self.storage).expanduser().resolve() / self.name

    @property
    def spec_hash(self) -> str:
        """Identifies what was searched (not where results go or how many trials were asked)."""
        data = to_plain(self)
        for key in ("storage", "source", "description", "profile"):
            data.pop(key, None)
        data["budget"].pop("trials", None)
        if data["budget"].get("confirm") is None:  # studies from before confirmation keep their hash
            data["budget"].pop("confirm", None)
        if data["algorithm"].get("seeds") is None:  # ... and those from before grids
            data["algorithm"].pop("seeds", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def train_keys(self) -> list[str]:
        return [k for k in self.space if k in TRAIN_KEYS]

    def model_keys(self) -> list[str]:
        return [k for k in self.space if k not in TRAIN_KEYS]

    def with_overrides(self, **changes: Any) -> "SearchSpec":
        """``trials``/``max_epochs`` go to the budget, ``storage``/``name`` to the top level."""
        budget_changes = {k: changes.pop(k) for k in ("trials", "max_epochs") if changes.get(k) is not None}
        top = {k: v for k, v in changes.items() if v is not None}
        dataset_dir = top.pop("data_dir", None)
        budget = self.budget
        if budget_changes:
            if "max_epochs" in budget_changes:
                budget_changes.setdefault("grace_epochs", min(budget.grace_epochs, budget_changes["max_epochs"]))
            budget = _override(Budget, {**dict(budget), **budget_changes})
        dataset = self.dataset if dataset_dir is None else self.dataset.model_copy(update={"data_dir": dataset_dir})
        return _override(SearchSpec, {**dict(self), "budget": budget, "dataset": dataset, **top})


def _override(record: type[Record], values: dict[str, Any]) -> Any:
    """``record`` with command-line overrides; a bad one is a ConfigError naming its option."""
    try:
        return record.model_validate(values)
    except ValidationError as exc:
        loc, message = first_error(record, exc)
        raise ConfigError(f"--{str(loc[-1]).replace('_', '-')}: {message}") from None


def to_plain(obj: Any) -> Any:
    """A record tree as JSON-able dicts/lists (for hashing and the experiment record)."""
    if isinstance(obj, Record):
        return {name: to_plain(getattr(obj, name)) for name in type(obj).model_fields}
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


PROFILE_KEYS = ("profiles", "default_profile")  # the profile block: top-level keys, not SearchSpec fields


class SpecProfiles(Record):
    """A spec file's ``profiles:`` block: named overrides of its sections (each deep-merged into
    the file, `deep_merge`), one picked on the command line (``--profile NAME``), else
    ``default_profile``. What a profile holds is validated as the spec it produces."""

    profiles: dict[str, dict[str, Any]] = Field(default_factory=dict)
    default_profile: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "SpecProfiles":
        for name, override in self.profiles.items():
            if not name or any(not (c.isalnum() or c in "_-") for c in name):
                raise FieldError("profiles", f"{name!r} is not a usable profile name; use letters, digits, '_' or '-'")
            for key in PROFILE_KEYS + ("source", "profile"):
                if key in override:
                    raise FieldError(f"profiles.{name}.{key}", "a profile overrides the spec's sections; "
                                     f"'{key}' cannot be set in one")
        if self.default_profile is not None and self.default_profile not in self.profiles:
            if not self.profiles:
                raise FieldError("default_profile", "names a profile, but the file has no 'profiles:' block")
            raise FieldError("default_profile", f"{self.default_profile!r} is not a profile of this file; "
                             f"use one of {', '.join(self.profiles)}")
        return self

    def pick(self, requested: str | None, file: str) -> tuple[str | None, str]:
        """(the profile to apply or None, why: for the line the CLI prints)."""
        others = [n for n in self.profiles if n != (requested or self.default_profile)]
        hint = f"; --profile {others[0]} for {_profile_purpose(self.profiles[others[0]], others[0])}" if others else ""
        if requested is not None:
            if requested not in self.profiles:
                available = (f"use one of {', '.join(self.profiles)}" if self.profiles
                             else "it has no 'profiles:' block; leave out --profile")
                raise ConfigError(f"{file}: --profile {requested}: no such profile; {available}")
            why = f"--profile {requested}" + (", the default" if requested == self.default_profile else "")
            return requested, f"{why}{hint}"
        if self.default_profile is not None:
            return self.default_profile, f"default{hint}"
        return None, ""


def _profile_purpose(override: dict[str, Any], name: str) -> str:
    """How the CLI names a profile it suggests: its description, else its name."""
    text = override.get("description")
    return str(text).rstrip(".") if isinstance(text, str) and text else f"the '{name}' profile"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` laid over it: mappings merge key by key, anything else
    (a number, a string, a list, null) replaces what was there."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _in_override(override: dict[str, Any], loc: list[str | int]) -> bool:
    """Whether the key path ``loc`` of the merged spec (or a mapping above it) was set by ``override``."""
    node: Any = override
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
        if not isinstance(node, dict):
            return True
    return True


def _validate_profile(data: dict[str, Any], name: str, override: dict[str, Any], where: SpecLocation) -> SearchSpec:
    """The spec that profile ``name`` produces; an error in what the profile set names the
    profile's key (``profiles.gpu.budget.trials``), one in the file's own sections says which
    profile it was read with."""
    merged = deep_merge(data, override)
    try:
        return SearchSpec.model_validate(merged)
    except ValidationError as exc:
        loc, message = first_error(SearchSpec, exc)
        if _in_override(override, loc):
            at = where.child("profiles").child(name)
            for part in loc:
                at = at.child(part)
            raise at.error(message) from None
        at = where
        for part in loc:
            at = at.child(part)
        raise at.error(f"{message} (with profile {name})") from None


def load_spec(path: str | Path, *, check_model: bool = True, profile: str | None = None) -> SearchSpec:
    """Read and validate a spec file; every problem is a one-line :class:`ConfigError`.

    A file with a ``profiles:`` block gives the spec of ``profile`` (else of its
    ``default_profile``, else of its sections as written); every profile is validated, so a
    broken one is found whichever is run. `pick_profile` says which and why."""
    return _load(path, check_model=check_model, profile=profile)[0]


def pick_profile(path: str | Path, *, profile: str | None = None) -> tuple[str | None, str, tuple[str, ...]]:
    """(the profile ``load_spec`` applies to the file at ``path``, why, every profile of the file)
    without validating the rest (`load_spec` does)."""
    path = Path(path)
    data = read_yaml(path)
    block = _profile_block(data, SpecLocation(str(path)))
    name, why = block.pick(profile, str(path))
    return name, why, tuple(block.profiles)


def _load(path: str | Path, *, check_model: bool, profile: str | None) -> tuple[SearchSpec, str]:
    path = Path(path)
    where = SpecLocation(str(path))
    data = read_yaml(path)
    block = _profile_block(data, where)
    chosen, why = block.pick(profile, str(path))
    data = {k: v for k, v in data.items() if k not in PROFILE_KEYS}
    if "source" in data:
        raise where.child("source").error("unknown key; it is set from the file name")
    if "profile" in data:
        raise where.child("profile").error("unknown key; pick a profile with --profile NAME (profiles: lists them)")
    specs = {name: _validate_profile(data, name, override, where) for name, override in block.profiles.items()}
    if chosen is None:
        spec: SearchSpec = from_plain(SearchSpec, data, where)
        fixed = data
    else:
        spec = specs[chosen]
        fixed = deep_merge(data, block.profiles[chosen])
    spec = spec.model_copy(update={"source": str(path), "profile": chosen or ""})
    for name, other in specs.items():  # each profile's knobs and models checked as the chosen one's
        if name == chosen:
            continue
        other_fixed = deep_merge(data, block.profiles[name])
        _check_all(other, where.child("profiles").child(name), set(other_fixed.get("train") or {}),
                   check_model=check_model and _models_differ(other, spec))
    _check_all(spec, where, set(fixed.get("train") or {}), check_model=check_model)
    return spec, why


def _models_differ(one: SearchSpec, other: SearchSpec) -> bool:
    """Whether building ``one``'s models could fail where ``other``'s passed (they differ)."""
    return (to_plain(one.candidates), to_plain(one.space)) != (to_plain(other.candidates), to_plain(other.space))


def _check_all(spec: SearchSpec, where: SpecLocation, fixed_train_keys: set[str], *, check_model: bool) -> None:
    _check_space_keys(spec, where, fixed_train_keys)
    _check_train_knobs(spec, where)
    if check_model:
        check_model_args(spec, where)


def _profile_block(data: dict[str, Any], where: SpecLocation) -> SpecProfiles:
    return from_plain(SpecProfiles, {k: data[k] for k in PROFILE_KEYS if k in data}, where)


def read_yaml(path: Path, *, example: str = "spaces/convit_locality.yaml") -> dict[str, Any]:
    """The YAML file's top-level mapping (``yaml.safe_load``), or a one-line ConfigError."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; pass a YAML file such as {example}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"{path}:{line}: {problem}; fix the YAML syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file; pass a YAML file such as {example}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top, as in {example}")
    return data


def _check_space_keys(spec: SearchSpec, where: SpecLocation, fixed_train_keys: set[str]) -> None:
    definitions = {k: (f"space.{k}", v) for k, v in spec.space.items()}
    for i, model in enumerate(spec.candidates):
        prefix = "model" if spec.models is None else f"models[{i}]"
        for key, param in model.space.items():
            if key in definitions and definitions[key][1] != param:
                raise where.child(f"{prefix}.space.{key}").error(
                    f"is also defined at {definitions[key][0]} with another range; a knob has one range "
                    "in a study (the store keeps one column per knob): use the same range in both places"
                )
            definitions.setdefault(key, (f"{prefix}.space.{key}", param))
    for key, (path, _) in definitions.items():
        if key in fixed_train_keys:
            raise where.child(path).error(
                f"is also set under train; set it in one place (remove train.{key} to search it)"
            )
    for i, model in enumerate(spec.candidates):
        prefix = "model" if spec.models is None else f"models[{i}]"
        for key in list(spec.space) + list(model.space):
            if key in model.args:
                raise where.child(f"{prefix}.args.{key}").error(
                    f"is also searched; set it in one place (remove {prefix}.args.{key} to search it)"
                )


def _check_train_knobs(spec: SearchSpec, where: SpecLocation) -> None:
    """Each choice (each end of a range) of a searched training setting is a valid setting, with
    the fixed ones as given (see `_probe_each_value`)."""
    knobs = {k: (p, f"space.{k}") for k, p in spec.space.items() if k in TRAIN_KEYS}
    for i, model in enumerate(spec.candidates):
        prefix = "model" if spec.models is None else f"models[{i}]"
        knobs.update({k: (p, f"{prefix}.space.{k}") for k, p in model.space.items() if k in TRAIN_KEYS})
    _probe_each_value(knobs, where, lambda key, value: dataclasses.replace(spec.train, **{key: value}),
                      lambda key, value, message: f"{value!r} is not a valid train.{key}: {message}")


def check_model_args(spec: SearchSpec, where: SpecLocation | None = None) -> None:
    """Every model exists in timm's registry and each of its knobs is a constructor argument."""
    where = where or SpecLocation(spec.source or "<spec>")
    for i, model in enumerate(spec.candidates):
        prefix = "model" if spec.models is None else f"models[{i}]"
        knobs = {k: (p, f"{prefix}.space.{k}") for k, p in model.space.items() if k not in TRAIN_KEYS}
        knobs.update({k: (p, f"space.{k}") for k, p in spec.space.items() if k not in TRAIN_KEYS})
        _check_one_model(model, knobs, where, prefix)


def _probe_values(param: ParamSpec) -> tuple[Any, ...]:
    """The values of a knob worth building the model with: every choice, or both ends of a range."""
    if param.type == "choice":
        return tuple(param.values or ())
    if param.type == "int":
        return (int(param.low), int(param.high))
    return (float(param.low), float(param.high))


def _probe_each_value(knobs: dict[str, tuple[ParamSpec, str]], where: SpecLocation,
                      attempt: Callable[[str, Any], Any], rejection: Callable[[str, Any, str], str]) -> None:
    """attempt(key, value) for every choice (both ends of every range) of each knob, the other
    knobs at their defaults: a value rejected there (TypeError, ValueError) would fail every trial
    that draws it, so it stops the spec with one line, rejection(key, value, message). A rejection
    that names another searched knob (refiner_blocks=8 exceeds depth=4) may hold only at that
    knob's default, so it is left to the trials, which record it as data."""
    for key, (param, path) in knobs.items():
        for value in _probe_values(param):
            try:
                attempt(key, value)
            except (TypeError, ValueError) as exc:  # SettingError is a ValueError
                message = f"{exc}".splitlines()[0]
                if any(other in message for other in knobs if other != key):
                    continue
                raise where.child(path).error(
                    f"{rejection(key, value, message)}; remove it from the "
                    + ("choices" if param.type == "choice" else "range")
                ) from None


# repr((model, args)) -> the class a meta-device build made, or what the build raised. `check` and
# every profile of a file rebuild the same models; a build is 10-100 ms (each module's init).
_META_BUILDS: dict[str, Any] = {}


def _build_on_meta(name: str, args: dict[str, Any]) -> type:
    """The class of ``timm.create_model(name, **args)`` built on the meta device (no memory), or
    the exception it raised: a TypeError or ValueError as raised, anything else (a RuntimeError
    for a negative size, an OverflowError, ...) as a ValueError naming it, so the spec's check
    reports it in one line instead of a traceback."""
    import timm
    import torch

    key = repr((name, sorted(args.items())))
    if key not in _META_BUILDS:
        if len(_META_BUILDS) >= 4096:
            _META_BUILDS.clear()
        try:
            with torch.device("meta"):
                _META_BUILDS[key] = type(timm.create_model(name, **args))
        except (TypeError, ValueError) as exc:
            _META_BUILDS[key] = exc
        except Exception as exc:  # noqa: BLE001  (arguments the model never meant to take)
            first = (str(exc).strip().splitlines() or [""])[0]
            _META_BUILDS[key] = ValueError(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
    built = _META_BUILDS[key]
    if isinstance(built, BaseException):
        raise built.with_traceback(None)
    return built


def _check_one_model(model_spec: ModelSpec, knobs: dict[str, tuple[ParamSpec, str]], where: SpecLocation,
                     prefix: str) -> None:
    import timm

    import trainers.models  # noqa: F401  (registers the project's families with timm)

    if not timm.is_model(model_spec.name):
        ours = ", ".join(n for n in timm.list_models("ls_*"))
        raise where.child(f"{prefix}.name").error(
            f"{model_spec.name!r} is not a registered model; use one of this project's ({ours}) or any timm model name"
        )
    try:
        model_class = _build_on_meta(model_spec.name, model_spec.args)
    except (TypeError, ValueError) as exc:
        raise where.child(f"{prefix}.args").error(f"{exc}".splitlines()[0] + "; fix the fixed model arguments") from None
    params = inspect.signature(model_class.__init__).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, (_, path) in knobs.items():
        if key not in params and not takes_kwargs:
            choices = [p for p in params if p != "self" and params[p].kind is not inspect.Parameter.VAR_KEYWORD]
            raise where.child(path).error(
                f"is neither a training setting ({', '.join(TRAIN_KEYS)}) nor an argument of "
                f"{model_spec.name} ({', '.join(choices)}); rename it"
            )

    _probe_each_value(knobs, where, lambda key, value: _build_on_meta(model_spec.name, {**model_spec.args, key: value}),
                      lambda key, value, message: f"{model_spec.name} does not accept {value!r}: {message}")

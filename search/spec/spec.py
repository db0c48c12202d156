"""The search spec: one YAML file in ``spaces/`` -> a frozen, validated :class:`SearchSpec`.

Space keys are either a training setting (a field of :class:`TrainSettings`) or a keyword
argument of the model constructor; nothing renames them on the way to the trainer. The spec's
sections are the records of :mod:`search.spec.records`; a file is read by :mod:`search.spec.loading`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from search.spec.records import (AlgorithmSpec, Budget, DatasetSpec, ModelSpec, Objective, ParamSpec, Resources,
                                 SchedulerSpec, ThroughputSettingsField, TrainSettingsField, first_rung)
from search.spec.validation import FieldError, Record, first_error
from trainers.config import TRAIN_KEYS, Constraint, SettingError, ThroughputSettings, TrainSettings
from trainers.errors import ConfigError

__all__ = ["SearchSpec", "to_plain", "grid_values", "GRID_MAX_POINTS", "BOTORCH_MAX_POINTS"]

GRID_MAX_POINTS = 1000  # a grid's points (the product of its knobs' values), at most
BOTORCH_MAX_POINTS = 20_000  # algorithm botorch scores every point once per COMPLETE trial


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


# Keys added after studies were run with this spec format: (section, key). Left unset (None), they
# stay out of the spec hash, so a study recorded before the key existed keeps its hash.
ADDED_KEYS = (
    ("budget", "confirm"),  # confirmation seeds
    ("algorithm", "seeds"),  # grids
    ("scheduler", "ranking"),  # MO-ASHA's options
    ("scheduler", "keep_front"),
    ("budget", "full_data_epochs"),  # epochs scaled by the data fraction
    ("dataset", "split_seed"),  # the subset drawn per trial
    ("dataset", "corruptions"),  # the held-out test on corrupted copies too
    ("algorithm", "levels"),  # botorch on continuous knobs
)


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
        # left out: the scheduler docs/spec.md advises for this many objectives (frozen record, so set in place once)
        object.__setattr__(self, "scheduler", self.scheduler.resolved(len(self.objectives)))
        self._scale_epochs()
        if self.algorithm.name == "botorch":
            points = self._check_finite("botorch", BOTORCH_MAX_POINTS, "use tpe or gp")
            if self.budget.trials is not None and self.budget.trials > points:
                raise FieldError("budget.trials", f"is {self.budget.trials}, but botorch proposes each of the space's "
                                 f"{points} points once; lower it to at most {points}, or list more values")
            if len(self.objectives) < 2:
                raise FieldError("algorithm.name", "botorch maximises the expected hypervolume improvement of two or "
                                 "more objectives; with one objective use gp")
        if self.algorithm.name == "grid":
            self._check_grid()
            if self.budget.trials is None:  # what a grid runs; frozen record, so set in place once
                object.__setattr__(self, "budget", self.budget.model_copy(update={"trials": self.planned_trials}))
        elif self.budget.trials is None:
            raise FieldError("budget.trials", "missing; add 'trials:' (a whole number)")
        return self

    def _scale_epochs(self) -> None:
        """max_epochs from budget.full_data_epochs and the data fraction (once; frozen record). A
        max_epochs given beside it must be that number (a record read back, say)."""
        budget = self.budget
        if budget.full_data_epochs is None:
            return
        # rounded first: 1.2 / 0.02 is 59.99... in floats, and 60 epochs is what it means
        epochs = max(1, math.ceil(round(budget.full_data_epochs / self.dataset.train_fraction, 6)))
        if budget.max_epochs is not None and budget.max_epochs != epochs:
            raise FieldError("budget.max_epochs", f"is {budget.max_epochs}, but full_data_epochs "
                             f"{budget.full_data_epochs:g} at train_fraction {self.dataset.train_fraction:g} is {epochs} "
                             "epochs; give one of the two")
        if budget.grace_epochs is not None and not 1 <= budget.grace_epochs <= epochs:
            raise FieldError("budget.grace_epochs", f"must be between 1 and max_epochs ({epochs}, from full_data_epochs), "
                             f"got {budget.grace_epochs}")
        object.__setattr__(self, "budget", budget.model_copy(update={"max_epochs": epochs}))

    def _check_grid(self) -> None:
        if self.budget.confirm is not None:
            raise FieldError("budget.confirm", "a grid trains every point with algorithm.seeds seeds already; "
                             "remove budget.confirm (or raise algorithm.seeds)")
        self._check_finite("grid", GRID_MAX_POINTS, "run one grid study per model")

    def _check_finite(self, name: str, most: int, otherwise: str) -> int:
        """One model's space, every knob a list of values, at most ``most`` points (grid, botorch);
        ``otherwise``: what to do instead, for the error. Returns the number of points."""
        what = "a grid runs one model" if name == "grid" else "botorch scores the points of one model's space"
        if self.conditional:
            raise FieldError("models", f"{what}; conditional spaces (several models:) are not supported for "
                             f"algorithm: {name}: {otherwise}")
        params = {f"space.{k}": p for k, p in self.space.items()}
        params.update({f"models[0].space.{k}": p for k, p in self.candidates[0].space.items()})
        if name == "botorch":  # continuous knobs at algorithm.levels values, as the sampler draws them
            params = {path: self.sampled_param(p) for path, p in params.items()}
        points = 1
        for path, param in params.items():
            knob = path.rsplit(".", 1)[1]
            if param.type in ("uniform", "loguniform"):
                raise FieldError(path, f"{name}: knob {knob} is continuous; list its values with type: choice"
                                 + ("" if name == "grid" else f", or search it at N evenly spaced values with "
                                    f"algorithm.levels: N (e.g. 5), or {otherwise}"))
            if param.type == "choice" and len(_distinct(param.values or ())) != len(param.values or ()):
                raise FieldError(path, f"{name}: knob {knob} lists a value twice; list each value once")
            points *= _grid_size(param)
        if points > most:
            sizes = " x ".join(str(_grid_size(p)) for p in params.values())
            raise FieldError("space", f"{name} of {points} points ({sizes} values), more than {most}; "
                             "list fewer values (type: choice) or give int ranges a larger step"
                             + (" or continuous knobs fewer algorithm.levels" if self.algorithm.levels else ""))
        return points

    # -- derived -------------------------------------------------------------------------
    def sampled_param(self, param: ParamSpec) -> ParamSpec:
        """``param`` as the sampler draws it: under botorch with ``algorithm.levels``, a continuous
        range is an ordered choice of its levels (ParamSpec.levels); any other knob as it is."""
        if self.algorithm.levels is None or param.type not in ("uniform", "loguniform"):
            return param
        return ParamSpec(type="choice", values=param.levels(self.algorithm.levels), ordered=True)

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
    def trial_seeds(self) -> tuple[int, ...]:
        """Every training seed a run uses: a grid's seeds, or the study's seed and its confirmation
        replicates' (search.study.confirm: seed + 1 .. seed + S)."""
        if self.is_grid:
            return self.algorithm.grid_seeds
        further = self.budget.confirm.seeds if self.budget.confirm is not None else 0
        return tuple(self.algorithm.seed + k for k in range(further + 1))

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
    def grace_epochs(self) -> int:
        """The scheduler's first rung: budget.grace_epochs, or where left out, ``first_rung`` of the
        epochs under asha or mo_asha (1 without a scheduler, where it stops nothing)."""
        if self.budget.grace_epochs is not None:
            return self.budget.grace_epochs
        return 1 if self.scheduler.name == "none" else first_rung(self.budget.max_epochs)

    @property
    def spec_hash(self) -> str:
        """Identifies what was searched (not where results go or how many trials were asked)."""
        data = to_plain(self)
        for key in ("storage", "source", "description", "profile"):
            data.pop(key, None)
        data["budget"].pop("trials", None)
        # the rung trained, not how it was given: grace left out hashes as its value (1 before the
        # default followed the epochs, so those studies keep their hash)
        data["budget"]["grace_epochs"] = self.grace_epochs
        for section, key in ADDED_KEYS:  # left unset: studies from before the key keep their hash
            if data[section].get(key) is None:
                data[section].pop(key, None)
        models = data.get("models") or [data.get("model") or {}]
        for space in [data.get("space") or {}, *[(m or {}).get("space") or {} for m in models]]:
            for param in space.values():  # a knob's `ordered`, added later: unset, out of the hash
                if isinstance(param, dict) and param.get("ordered") is None:
                    param.pop("ordered", None)
        confirm = data["budget"].get("confirm")
        if confirm is not None:  # the race's keys, added later: at their defaults, out of the hash
            if confirm.get("strategy") == "fixed":
                confirm.pop("strategy")
            if confirm.get("replicates") is None:
                confirm.pop("replicates", None)
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
                if budget.grace_epochs is not None:  # left out, it follows the new epochs
                    budget_changes.setdefault("grace_epochs", min(budget.grace_epochs, budget_changes["max_epochs"]))
                budget_changes["full_data_epochs"] = None  # --max-epochs replaces the scaled count
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

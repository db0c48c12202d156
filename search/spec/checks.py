"""What a spec's records cannot check alone: a knob defined once (in one place, with one range),
and every value of a searched training setting a valid setting."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from search.spec.records import ModelSpec, ParamSpec
from search.spec.spec import SearchSpec
from search.spec.validation import SpecLocation
from trainers.config import TRAIN_KEYS

__all__ = ["check_space_keys", "check_train_knobs", "probe_values", "probe_each_value", "model_paths"]


def model_paths(spec: SearchSpec) -> list[tuple[str, ModelSpec]]:
    """(key path, model) of each candidate model: ``model`` for a one-model spec, else ``models[i]``."""
    return [("model" if spec.models is None else f"models[{i}]", model) for i, model in enumerate(spec.candidates)]


def check_space_keys(spec: SearchSpec, where: SpecLocation, fixed_train_keys: set[str]) -> None:
    definitions = {k: (f"space.{k}", v) for k, v in spec.space.items()}
    for prefix, model in model_paths(spec):
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
    for prefix, model in model_paths(spec):
        for key in list(spec.space) + list(model.space):
            if key in model.args:
                raise where.child(f"{prefix}.args.{key}").error(
                    f"is also searched; set it in one place (remove {prefix}.args.{key} to search it)"
                )


def check_train_knobs(spec: SearchSpec, where: SpecLocation) -> None:
    """Each choice (each end of a range) of a searched training setting is a valid setting, with
    the fixed ones as given (see `probe_each_value`)."""
    knobs = {k: (p, f"space.{k}") for k, p in spec.space.items() if k in TRAIN_KEYS}
    for prefix, model in model_paths(spec):
        knobs.update({k: (p, f"{prefix}.space.{k}") for k, p in model.space.items() if k in TRAIN_KEYS})
    probe_each_value(knobs, where, lambda key, value: dataclasses.replace(spec.train, **{key: value}),
                     lambda key, value, message: f"{value!r} is not a valid train.{key}: {message}")


def probe_values(param: ParamSpec) -> tuple[Any, ...]:
    """The values of a knob worth building the model with: every choice, or both ends of a range."""
    if param.type == "choice":
        return tuple(param.values or ())
    if param.type == "int":
        return (int(param.low), int(param.high))
    return (float(param.low), float(param.high))


def probe_each_value(knobs: dict[str, tuple[ParamSpec, str]], where: SpecLocation,
                     attempt: Callable[[str, Any], Any], rejection: Callable[[str, Any, str], str]) -> None:
    """attempt(key, value) for every choice (both ends of every range) of each knob, the other
    knobs at their defaults: a value rejected there (TypeError, ValueError) would fail every trial
    that draws it, so it stops the spec with one line, rejection(key, value, message). A rejection
    that names another searched knob (refiner_blocks=8 exceeds depth=4) may hold only at that
    knob's default, so it is left to the trials, which record it as data."""
    for key, (param, path) in knobs.items():
        for value in probe_values(param):
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

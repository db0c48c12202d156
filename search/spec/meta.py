"""Models built on the meta device: the class a spec's model name and arguments make, without
memory or weights, so `check` (and every run) finds a model argument that would fail every trial
before anything starts.
"""

from __future__ import annotations

import inspect
from typing import Any

from search.spec.checks import model_paths, probe_each_value
from search.spec.records import ModelSpec, ParamSpec
from search.spec.spec import SearchSpec
from search.spec.validation import SpecLocation
from trainers.config import TRAIN_KEYS

__all__ = ["build_on_meta", "check_model", "check_model_args"]


# repr((model, args)) -> the class a meta-device build made, or what the build raised. `check` and
# every profile of a file rebuild the same models; a build is 10-100 ms (each module's init).
_BUILDS: dict[str, Any] = {}


def build_on_meta(name: str, args: dict[str, Any]) -> type:
    """The class of ``timm.create_model(name, **args)`` built on the meta device (no memory), or
    the exception it raised: a TypeError or ValueError as raised, anything else (a RuntimeError
    for a negative size, an OverflowError, ...) as a ValueError naming it, so the spec's check
    reports it in one line instead of a traceback."""
    import timm
    import torch

    key = repr((name, sorted(args.items())))
    if key not in _BUILDS:
        if len(_BUILDS) >= 4096:
            _BUILDS.clear()
        try:
            with torch.device("meta"):
                _BUILDS[key] = type(timm.create_model(name, **args))
        except (TypeError, ValueError) as exc:
            _BUILDS[key] = exc
        except Exception as exc:  # noqa: BLE001  (arguments the model never meant to take)
            first = (str(exc).strip().splitlines() or [""])[0]
            _BUILDS[key] = ValueError(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
    built = _BUILDS[key]
    if isinstance(built, BaseException):
        raise built.with_traceback(None)
    return built


def check_model_args(spec: SearchSpec, where: SpecLocation | None = None) -> None:
    """Every model exists in timm's registry and each of its knobs is a constructor argument."""
    where = where or SpecLocation(spec.source or "<spec>")
    for prefix, model in model_paths(spec):
        knobs = {k: (p, f"{prefix}.space.{k}") for k, p in model.space.items() if k not in TRAIN_KEYS}
        knobs.update({k: (p, f"space.{k}") for k, p in spec.space.items() if k not in TRAIN_KEYS})
        check_model(model, knobs, where, prefix)


def check_model(model_spec: ModelSpec, knobs: dict[str, tuple[ParamSpec, str]], where: SpecLocation,
                prefix: str = "model") -> None:
    """``model_spec``'s name is a registered model, its fixed arguments build it, and each of
    ``knobs`` (key -> (range, key path)) is a constructor argument each of whose values builds it;
    otherwise a one-line ConfigError naming the key path under ``where`` (``prefix``: the model's)."""
    import timm

    import trainers.models  # noqa: F401  (registers the project's families with timm)

    if not timm.is_model(model_spec.name):
        ours = ", ".join(n for n in timm.list_models("ls_*"))
        raise where.child(f"{prefix}.name").error(
            f"{model_spec.name!r} is not a registered model; use one of this project's ({ours}) or any timm model name"
        )
    try:
        model_class = build_on_meta(model_spec.name, model_spec.args)
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

    probe_each_value(knobs, where, lambda key, value: build_on_meta(model_spec.name, {**model_spec.args, key: value}),
                      lambda key, value, message: f"{model_spec.name} does not accept {value!r}: {message}")

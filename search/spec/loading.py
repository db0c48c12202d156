"""Reading a spec file: its YAML, its profile, its records validated, then the checks that need the
whole spec (search.spec.checks) and its models built on the meta device (search.spec.meta)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from search.spec.checks import check_space_keys, check_train_knobs
from search.spec.meta import check_model_args
from search.spec.profiles import PROFILE_KEYS, deep_merge, profile_block, validate_profile
from search.spec.spec import SearchSpec, to_plain
from search.spec.validation import SpecLocation, from_plain
from trainers.errors import ConfigError

__all__ = ["load_spec", "pick_profile", "read_yaml"]


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
    block = profile_block(data, SpecLocation(str(path)))
    name, why = block.pick(profile, str(path))
    return name, why, tuple(block.profiles)


def _load(path: str | Path, *, check_model: bool, profile: str | None) -> tuple[SearchSpec, str]:
    path = Path(path)
    where = SpecLocation(str(path))
    data = read_yaml(path)
    block = profile_block(data, where)
    chosen, why = block.pick(profile, str(path))
    data = {k: v for k, v in data.items() if k not in PROFILE_KEYS}
    if "source" in data:
        raise where.child("source").error("unknown key; it is set from the file name")
    if "profile" in data:
        raise where.child("profile").error("unknown key; pick a profile with --profile NAME (profiles: lists them)")
    specs = {name: validate_profile(data, name, override, where) for name, override in block.profiles.items()}
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
    check_space_keys(spec, where, fixed_train_keys)
    check_train_knobs(spec, where)
    if check_model:
        check_model_args(spec, where)


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

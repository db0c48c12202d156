"""A spec file's profiles: named overrides of its sections, one picked on the command line.

``profiles: {NAME: {section: {...}}}`` and ``default_profile: NAME`` at the top of a spec file
(docs/spec.md#profiles). Each profile is deep-merged over the file (`deep_merge`) and validated as
the spec it produces (`validate_profile`), so a broken one is found whichever is run.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from search.spec.spec import SearchSpec
from search.spec.validation import FieldError, Record, SpecLocation, first_error, from_plain
from trainers.errors import ConfigError

__all__ = ["SpecProfiles", "PROFILE_KEYS", "deep_merge", "validate_profile", "profile_block"]


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


def validate_profile(data: dict[str, Any], name: str, override: dict[str, Any], where: SpecLocation) -> SearchSpec:
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




def profile_block(data: dict[str, Any], where: SpecLocation) -> SpecProfiles:
    """The ``profiles:`` block of a spec file's top-level mapping ``data`` (empty where it has none)."""
    return from_plain(SpecProfiles, {k: data[k] for k in PROFILE_KEYS if k in data}, where)

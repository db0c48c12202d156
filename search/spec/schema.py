"""Typed reading of plain YAML data into frozen dataclasses.

One small converter instead of a schema library: it walks a dataclass's type hints and turns
every mismatch (unknown key, wrong type, missing key) into a :class:`ConfigError` whose one
line names the file, the key path and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

from trainers.config import SettingError as FieldError
from trainers.errors import ConfigError

# FieldError: raised by a record's ``__post_init__``; its ``key`` (relative to the record)
# names the wrong value.
__all__ = ["from_dict", "SpecLocation", "FieldError"]


@dataclasses.dataclass(frozen=True)
class SpecLocation:
    """Where a value sits: the file and the dotted key path, for error messages."""

    file: str
    path: str = ""

    def child(self, key: str | int) -> "SpecLocation":
        if isinstance(key, int):
            return SpecLocation(self.file, f"{self.path}[{key}]")
        return SpecLocation(self.file, f"{self.path}.{key}" if self.path else key)

    def error(self, message: str) -> ConfigError:
        where = f"{self.file}: {self.path}" if self.path else self.file
        return ConfigError(f"{where}: {message}")


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "a whole number"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (dict,):
        return "a mapping"
    if origin in (tuple, list):
        return "a list"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


def from_dict(tp: Any, value: Any, where: SpecLocation) -> Any:
    """Convert ``value`` (parsed YAML) to ``tp``, or raise ConfigError naming ``where``."""
    origin = typing.get_origin(tp)

    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        non_none = [o for o in options if o is not type(None)]
        errors = []
        for option in non_none:
            try:
                return from_dict(option, value, where)
            except ConfigError as exc:
                errors.append(exc)
        if len(non_none) == 1:
            raise errors[0]
        raise where.error(
            f"expected {' or '.join(_type_name(o) for o in non_none)}, got {_describe(value)}"
        )

    if tp is Any:
        return value

    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise where.error(
                f"{_describe(value)} is not allowed{hint}; use one of "
                + ", ".join(repr(a) for a in allowed)
            )
        return value

    if tp is bool:
        if not isinstance(value, bool):
            raise where.error(f"expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise where.error(f"expected a whole number, got {_describe(value)}; write e.g. 10")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise where.error(f"expected a number, got {_describe(value)}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept what is plainly a number.
            try:
                return float(value)
            except ValueError:
                pass
        raise where.error(f"expected a number, got {_describe(value)}; write e.g. 0.5 or 1.0e-3")
    if tp is str:
        if not isinstance(value, str):
            raise where.error(f"expected a string, got {_describe(value)}; quote it")
        return value

    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise where.error(f"expected a list, got {_describe(value)}; write it as [a, b] or '- a' lines")
        item_type = args[0]
        return tuple(from_dict(item_type, v, where.child(i)) for i, v in enumerate(value))

    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        if not isinstance(value, dict):
            raise where.error(f"expected a mapping of key: value, got {_describe(value)}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise where.error(f"key {_describe(k)} must be a string")
            out[k] = from_dict(value_type, v, where.child(k))
        return out

    if dataclasses.is_dataclass(tp):
        return _dataclass_from_dict(tp, value, where)

    raise TypeError(f"unsupported schema type {tp!r}")  # a bug in the schema, not user input


def _dataclass_from_dict(cls: Any, value: Any, where: SpecLocation) -> Any:
    if not isinstance(value, dict):
        raise where.error(f"expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(cls))}, got {_describe(value)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in value:
        if key not in fields:
            offered = [name for name, f in fields.items() if not f.metadata.get("internal")]
            close = difflib.get_close_matches(str(key), offered, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise where.child(str(key)).error(
                f"unknown key; {hint}allowed keys here: {', '.join(offered)}"
            )
    kwargs = {}
    for name, field in fields.items():
        if name in value:
            kwargs[name] = from_dict(hints[name], value[name], where.child(name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise where.child(name).error(f"missing; add '{name}:' ({_type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except FieldError as exc:  # __post_init__ checks say which key is wrong
        raise (where.child(exc.key) if exc.key else where).error(str(exc)) from None

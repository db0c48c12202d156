"""pydantic, speaking the spec's language: every error one line naming the file, the key path and the fix.

The spec's records are pydantic models (:class:`Record`: frozen, unknown keys rejected, numbers
finite). pydantic reports each error with its key path (``loc``); :func:`from_plain` turns the
first into a :class:`ConfigError`. The field types below read YAML the way a user means it: a
whole number is neither ``true`` nor ``"10"``, a number may be written ``1e-3`` (YAML 1.1 reads
that as a string), a flag is ``true`` or ``false``, and a wrong word gets a "did you mean".
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, WrapValidator, create_model
from pydantic_core import PydanticCustomError

from trainers.config import SettingError
from trainers.errors import ConfigError

__all__ = ["Record", "SpecLocation", "FieldError", "Whole", "Number", "Flag", "one_of", "settings", "from_plain",
           "first_error"]

# Raised by a record's validator: its ``key`` (relative to the record) names the wrong value.
FieldError = SettingError


class Record(BaseModel):
    """A spec record: frozen, unknown keys rejected, numbers finite (no .nan or .inf)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def internal(field: Any) -> bool:
    """A field that is not written in YAML (``json_schema_extra={"internal": True}``): not offered."""
    return isinstance(field.json_schema_extra, dict) and bool(field.json_schema_extra.get("internal"))


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


def _unwrap(tp: Any) -> Any:
    """``Annotated[X, ...]`` and ``X | None`` -> X."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType) and type(None) in typing.get_args(tp):
            rest = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


def _type_name(tp: Any) -> str:
    tp = _unwrap(tp)
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
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is dict or (isinstance(tp, type) and issubclass(tp, BaseModel)) or dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (tuple, list):
        return "a list"
    return str(tp)


# -- field types ------------------------------------------------------------------------------

# The store keeps whole numbers as int64 (and Ray, Optuna and torch as C integers): beyond it a
# value passes the check and fails the run.
WHOLE_LIMIT = 2**63 - 1


def _whole(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PydanticCustomError("whole_number", "expected a whole number, got {got}; write e.g. 10",
                                  {"got": _describe(value)})
    if abs(value) > WHOLE_LIMIT:
        raise PydanticCustomError("whole_number", "{got} is too large a whole number; use one of at most 2**63 - 1",
                                  {"got": _describe(value)})
    return value


def _number(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string; accept what is plainly a number
        try:
            return float(value)
        except ValueError:
            pass
    raise PydanticCustomError("number", "expected a number, got {got}; write e.g. 0.5 or 1.0e-3",
                              {"got": _describe(value)})


def _flag(value: Any) -> Any:
    if not isinstance(value, bool):
        raise PydanticCustomError("flag", "expected true or false, got {got}", {"got": _describe(value)})
    return value


Whole = Annotated[int, BeforeValidator(_whole)]
Number = Annotated[float, BeforeValidator(_number)]
Flag = Annotated[bool, BeforeValidator(_flag)]


def one_of(*allowed: Any) -> Any:
    """``Literal[allowed]`` whose error names the close match and every allowed value."""

    def check(value: Any) -> Any:
        if any(value == a and type(value) is type(a) for a in allowed):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        raise PydanticCustomError("not_allowed", "{got} is not allowed{hint}; use one of {allowed}", {
            "got": _describe(value), "hint": f" (did you mean {close[0]!r}?)" if close else "",
            "allowed": ", ".join(repr(a) for a in allowed)})

    return Annotated[Literal[allowed], BeforeValidator(check)]


def _any_of(options: tuple[Any, ...], names: str) -> Any:
    """A union that fails with one error naming every option, not one error per option."""

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union", "expected {names}, got {got}",
                                      {"names": names, "got": _describe(value)}) from None

    return Annotated[Union[options], WrapValidator(check)]


def _lenient(tp: Any) -> Any:
    """A stdlib dataclass field's type hint as the field types above."""
    simple = {int: Whole, float: Number, bool: Flag, str: str}
    if tp in simple:
        return simple[tp]
    if tp is Any:
        return Any
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return one_of(*args)
    if origin in (Union, types.UnionType):
        rest = tuple(a for a in args if a is not type(None))
        inner = _lenient(rest[0]) if len(rest) == 1 else _any_of(tuple(_lenient(a) for a in rest), _type_name(tp))
        return Optional[inner] if len(rest) < len(args) else inner
    if origin is tuple:
        return tuple[_lenient(args[0]), ...]
    if origin is dict:
        return dict[str, _lenient(args[1])]
    if dataclasses.is_dataclass(tp):
        return settings(tp)
    raise TypeError(f"no field type for {tp!r}")  # a bug in a record, not user input


@functools.cache
def settings(cls: type) -> Any:
    """A stdlib dataclass (trainers' settings) read like a Record: each field's type checked, then
    the dataclass built, so its own ``__post_init__`` checks (SettingError) apply unchanged."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for field in dataclasses.fields(cls):
        default = (field.default if field.default is not dataclasses.MISSING
                   else ... if field.default_factory is dataclasses.MISSING else field.default_factory())
        fields[field.name] = (_lenient(hints[field.name]), default)
    checked_fields = create_model(cls.__name__, __base__=Record, **fields)  # type: ignore[call-overload]

    def build(value: Any, handler: Any) -> Any:
        if isinstance(value, cls):
            return value
        checked = handler(value)
        return cls(**dict(checked))  # a SettingError here becomes pydantic's value_error; from_plain reads its key

    return Annotated[checked_fields, WrapValidator(build)]


# -- errors -----------------------------------------------------------------------------------

def _record_at(root: type, loc: tuple[Any, ...]) -> Any:
    """The record (or container type) at ``loc`` below ``root``."""
    tp: Any = root
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            tp = tp.model_fields[part].annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) is tuple:
            tp = typing.get_args(tp)[0]
    return _unwrap(tp)


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}


def first_error(root: type, exc: ValidationError) -> tuple[list[str | int], str]:
    """The key path and the message (what to write instead) of the error to report first: an
    unknown key before the rest, as a misspelt key also leaves a required one missing."""
    errors = exc.errors(include_url=False)
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc: list[str | int] = list(error["loc"])
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind in ("value_error", "assertion_error"):
        cause = ctx.get("error")
        if isinstance(cause, SettingError) and cause.key:
            loc.append(cause.key)
        return loc, str(cause) if cause is not None else error["msg"]
    if kind == "extra_forbidden":
        parent = _record_at(root, tuple(loc[:-1]))
        offered = [name for name, f in parent.model_fields.items() if not internal(f)]
        close = difflib.get_close_matches(str(loc[-1]), offered, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return loc, f"unknown key; {hint}allowed keys here: {', '.join(offered)}"
    if kind == "missing":
        field = _record_at(root, tuple(loc[:-1])).model_fields[loc[-1]]
        return loc, f"missing; add '{loc[-1]}:' ({_type_name(field.annotation)})"
    if kind in ("model_type", "model_attributes_type", "dataclass_type"):
        record = _record_at(root, tuple(loc))
        keys = ", ".join(name for name, f in record.model_fields.items() if not internal(f))
        return loc, f"expected a mapping with keys {keys}, got {_describe(value)}"
    if kind == "dict_type":
        return loc, f"expected a mapping of key: value, got {_describe(value)}"
    if kind in ("list_type", "tuple_type"):
        return loc, f"expected a list, got {_describe(value)}; write it as [a, b] or '- a' lines"
    if kind == "string_type":
        if loc and loc[-1] == "[key]":
            return loc[:-2], f"key {_describe(loc[-2])} must be a string"
        return loc, f"expected a string, got {_describe(value)}; quote it"
    if kind == "finite_number":
        return loc, f"must be a finite number, got {_describe(value)}"
    if kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        return loc, f"must be {op} {ctx[name]}, got {_describe(value)}"
    return loc, error["msg"]  # the field types' own errors (whole_number, number, ...) say the fix already


def from_plain(root: type, data: Any, where: SpecLocation) -> Any:
    """``data`` (parsed YAML or JSON) as the record ``root``, or a one-line ConfigError naming ``where``."""
    try:
        return root.model_validate(data)
    except ValidationError as exc:
        loc, message = first_error(root, exc)
        for part in loc:
            where = where.child(part)
        raise where.error(message) from None

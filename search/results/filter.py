"""Narrowing a study's trials before its front is taken: ``--where`` conditions, ``--family``.

A condition is one comparison ``COLUMN OP VALUE``: OP is one of ``>= <= > < == !=``, COLUMN a
column of trials.parquet (result columns and searched knobs), VALUE a number, or for text
columns a word or a quoted string (``family==convit``, ``model!='vit_tiny'``), for true/false
columns ``true``/``false``, for timestamps an ISO date (``started_at>=2025-01-31``). The string
is parsed here, piece by piece; it never reaches ``eval`` or ``DataFrame.query``.

A row with no value (null) in the column never matches, whatever the operator (as in SQL).
Conditions and families combine with AND; several families are alternatives (OR).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from trainers.errors import ConfigError

__all__ = ["Condition", "parse_where", "filter_trials", "split_families"]

OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}
# Longest operators first, so '>=' is not read as '>' followed by '=...'.
_WHERE_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|==|!=|>|<)\s*(.*?)\s*$")
_QUOTED_RE = re.compile(r"""^(['"])(.*)\1$""")
_WORD_RE = re.compile(r"^[A-Za-z0-9_.:/+-]+$")
_EXAMPLE = "e.g. 'throughput>=5000', 'params<1e6' or 'family==convit'"


@dataclasses.dataclass(frozen=True)
class Condition:
    """One parsed ``COLUMN OP VALUE``; ``value`` is the text after OP (quotes removed)."""

    column: str
    op: str
    value: str
    quoted: bool = False  # the value was quoted: always text, never a number

    def __str__(self) -> str:
        return f"{self.column}{self.op}{self.value!r}" if self.quoted else f"{self.column}{self.op}{self.value}"


def parse_where(expr: str) -> Condition:
    """Parse ``expr`` (one ``COLUMN OP VALUE``); a ConfigError names what is wrong with it."""
    match = _WHERE_RE.match(expr)
    if match is None:
        if re.search(r"(?<![<>=!])=(?!=)", expr):
            hint = "; compare with '==' (not '=')"
        else:
            hint = f"; write COLUMN OP VALUE with OP one of {' '.join(OPERATORS)}, {_EXAMPLE}"
        raise ConfigError(f"--where {expr!r}: not a comparison{hint}")
    column, op, raw = match.groups()
    if not raw:
        raise ConfigError(f"--where {expr!r}: no value after {op!r}; {_EXAMPLE}")
    quoted = _QUOTED_RE.match(raw)
    if quoted is not None:
        return Condition(column, op, quoted.group(2), quoted=True)
    if not _WORD_RE.match(raw):
        raise ConfigError(
            f"--where {expr!r}: {raw!r} is not a number or a plain word; quote text that has "
            f"spaces or symbols, e.g. \"model=='vit tiny'\""
        )
    return Condition(column, op, raw)


def split_families(values: Sequence[str] | None) -> list[str]:
    """``["convit,gmm", "refiner"]`` (repeated and comma-separated flags) -> three names."""
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


def _mask(trials: pd.DataFrame, cond: Condition, expr: str) -> pd.Series:
    series = trials[cond.column]
    present = series.notna()
    compare = OPERATORS[cond.op]
    dtype = series.dtype
    if pd.api.types.is_bool_dtype(dtype):
        text = cond.value.lower()
        if cond.op not in ("==", "!=") or text not in ("true", "false"):
            raise ConfigError(f"--where {expr}: {cond.column} is true/false; compare it with == or != to true or false")
        value: Any = text == "true"
    elif pd.api.types.is_numeric_dtype(dtype):
        try:
            value = float(cond.value)
        except ValueError:
            value = None
        if cond.quoted or value is None or value != value:  # NaN compares false with everything
            raise ConfigError(f"--where {expr}: {cond.column} holds numbers; compare it with a number, e.g. {cond.column}{cond.op}0.5")
    elif pd.api.types.is_datetime64_any_dtype(dtype):
        try:
            value = pd.Timestamp(cond.value)
        except ValueError:
            raise ConfigError(f"--where {expr}: {cond.column} holds timestamps; compare it with an ISO date such as 2025-01-31 or 2025-01-31T12:00") from None
        tz = getattr(dtype, "tz", None)
        if tz is not None and value.tzinfo is None:
            value = value.tz_localize(tz)
    else:  # text
        if cond.op not in ("==", "!="):
            raise ConfigError(f"--where {expr}: {cond.column} holds text; compare it with == or !=")
        value = cond.value
        series = series.astype(object)
    return present & compare(series.where(present, other=value), value).astype(bool)


def filter_trials(
    trials: pd.DataFrame,
    *,
    where: Sequence[str | Condition] = (),
    families: Sequence[str] = (),
) -> pd.DataFrame:
    """The rows of ``trials`` that meet every ``where`` condition and belong to one of ``families``.

    An unknown column or family is a ConfigError listing what the table has (a typo would
    otherwise give an empty front and no hint).
    """
    mask = pd.Series(True, index=trials.index)
    for item in where:
        cond = item if isinstance(item, Condition) else parse_where(item)
        if cond.column not in trials.columns:
            raise ConfigError(
                f"--where {cond}: no column {cond.column!r}; the trials have {', '.join(trials.columns)}"
            )
        mask &= _mask(trials, cond, str(cond))
    families = list(families)
    if families:
        known = sorted(str(f) for f in trials["family"].dropna().unique()) if "family" in trials else []
        unknown = [f for f in families if f not in known]
        if unknown:
            raise ConfigError(
                f"--family {','.join(unknown)}: no trial of that family in the study; "
                f"it has {', '.join(known) or 'no family yet (no trial has finished)'}"
            )
        mask &= trials["family"].isin(families)
    return trials[mask]

"""What the commands print: every result as a table for people, JSON or CSV, from one function.

The results modules (``search.results``) return data: DataFrames and small dataclasses. This
module turns them into text. :func:`render` is the one place the three formats are chosen:

- ``json``: :func:`to_json`, records with full float precision (shortest round-trip, as Python's
  ``repr``), NaN as null, timestamps in ISO 8601;
- ``csv``: the rows as ``DataFrame.to_csv`` writes them (full precision);
- ``table``: the view's own layout for people (intervals beside their values, thousands
  separators, 4 significant digits).

Each command has one ``*_view`` function here that picks its rows and its table layout.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from search.results.compare import Comparison
from search.results.effects import TEST
from search.results.front import DOMINATED_COLUMN, front_groups
from search.results.importance import by_family
from search.results.store import TRIAL_COLUMNS

__all__ = [
    "FORMATS", "render", "to_json", "front_columns", "front_view", "trial_view", "comparison_view", "effects_view",
    "effect_lines", "importance_view", "format_front", "front_heading",
]

FORMATS = ("table", "json", "csv")


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: numpy scalars as Python's, NaN/inf as None, times in ISO 8601."""
    if isinstance(value, pd.DataFrame):
        return [_plain(r) for r in value.to_dict("records")]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is pd.NaT or value is pd.NA:
        return None
    if isinstance(value, (pd.Timestamp, dt.datetime, dt.date)):
        return value.isoformat()
    return value


def to_json(data: Any) -> str:
    """``data`` (a DataFrame: its records; or a mapping/list holding DataFrames) as indented JSON
    with every float at full precision."""
    return json.dumps(_plain(data), indent=2, allow_nan=False, default=str)


def render(data: Any, *, fmt: str, table: Callable[[], str], csv: pd.DataFrame | None = None) -> str:
    """``data`` in ``fmt``: JSON of ``data`` (see :func:`to_json`), CSV of ``csv`` (default: ``data``,
    which must then be a DataFrame), or ``table()``, the view's own text for people."""
    if fmt == "json":
        return to_json(data)
    if fmt == "csv":
        rows = data if csv is None else csv
        if not isinstance(rows, pd.DataFrame):
            raise TypeError("render: CSV needs rows; pass csv=DataFrame")
        return rows.to_csv(index=False)
    if fmt == "table":
        return table()
    raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")


# -- the front -----------------------------------------------------------------------------
def front_columns(front: pd.DataFrame, objectives: Sequence[tuple[str, str]], *, leading: Sequence[str] = ()) -> list[str]:
    """The columns a front shows, in order: ``leading``, the id and family, each objective and its
    interval, the held-out test_acc and its interval (where scored), what a confirmed mean rests
    on, the ties, size and cost, then the searched knobs."""
    config_columns = [c for c in front.columns if c not in TRIAL_COLUMNS and c not in leading]
    columns = list(leading) + ["trial_id", "family"]
    for column, _ in objectives:  # each objective, then its interval where recorded
        columns += [column] + [f"{column}_{end}" for end in ("low", "high") if f"{column}_{end}" in front]
    if "test_acc" in front and front["test_acc"].notna().any():  # the held-out score: selected on nothing
        columns += [c for c in ("test_acc", "test_acc_low", "test_acc_high") if c in front]
    if "selection_val_acc" in front and front["selection_val_acc"].notna().any():  # a confirmed study
        columns += [c for c in ("seeds", "selection_val_acc", "val_acc_sd", "val_acc_sd_df") if c in front]
    columns += [c for c in ("tied_with", DOMINATED_COLUMN, "params", "flops", "epochs_run", "throughput_device")
                if c in front and c not in columns]
    return columns + config_columns


def _front_table(view: pd.DataFrame, objectives: Sequence[tuple[str, str]], empty: str) -> str:
    """The members, then the candidates dominated within noise in a block of their own."""
    if DOMINATED_COLUMN not in view:
        return _rows_table(view, objectives, empty)
    beaten = view[DOMINATED_COLUMN].notna()
    text = _rows_table(view[~beaten].drop(columns=DOMINATED_COLUMN), objectives, empty)
    if beaten.any():
        text += (f"\n\ndominated within noise, so not on the front ({len(view[beaten])}): a member (dominated_by) is level "
                 "within noise on every objective and better beyond noise on one\n")
        text += _rows_table(view[beaten].drop(columns="tied_with", errors="ignore"), objectives, empty)
    return text


def _rows_table(view: pd.DataFrame, objectives: Sequence[tuple[str, str]], empty: str) -> str:
    if view.empty:
        return f"(the front is empty: {empty})"
    shown = view.copy()
    objective_columns = [c for c, _ in objectives]
    for column in objective_columns + ["test_acc"]:  # the interval beside its value, as "low-high"
        if f"{column}_low" in shown and f"{column}_high" in shown:  # '?': not recorded; '-': no value to bound
            spec = ",.0f" if column == "throughput" else ".4f"
            values = shown[column].astype(float) if column in shown else pd.Series(0.0, index=shown.index)
            shown.insert(shown.columns.get_loc(f"{column}_low"), f"{column} 95%", [
                "-" if v != v else "?" if lo != lo or hi != hi else f"{lo:{spec}}-{hi:{spec}}"
                for v, lo, hi in zip(values, shown.pop(f"{column}_low").astype(float),
                                     shown.pop(f"{column}_high").astype(float))])
    for column in ("tied_with", DOMINATED_COLUMN):
        if column in shown:
            shown[column] = shown[column].map(lambda v: v if isinstance(v, str) and v else "-")
    if "throughput" in shown:
        shown["throughput"] = shown["throughput"].map(lambda v: f"{v:,.0f}")
    if "params" in shown:
        shown["params"] = shown["params"].map(lambda v: f"{v / 1e6:.2f}M")
    if "flops" in shown:
        shown["flops"] = shown["flops"].map(lambda v: f"{v / 1e6:.1f}M")
    config_columns = [c for c in view.columns if c not in TRIAL_COLUMNS]
    for column in config_columns + [c for c in ("val_acc", "val_loss", "val_acc_sd", "selection_val_acc", "test_acc") if c in shown]:
        if column in shown and shown[column].dtype.kind == "f":
            shown[column] = shown[column].map(lambda v: "-" if v != v else f"{v:.4g}")  # NaN: not measured (e.g. not scored)
    return shown.to_string(index=False)


def front_view(front: pd.DataFrame, objectives: Sequence[tuple[str, str]], *, fmt: str, leading: Sequence[str] = (),
               empty: str = "no trial has completed yet") -> str:
    """``front`` (:func:`search.results.front.compute_front`) as a table, JSON records or CSV;
    ``leading`` columns (e.g. ``study``) go first; ``empty``: why the front is empty, for the table."""
    view = front[front_columns(front, objectives, leading=leading)]
    return render(view, fmt=fmt, table=lambda: _front_table(view, objectives, empty))


format_front = front_view  # the name search's public API has given it


def front_heading(front: pd.DataFrame, objectives: Sequence[tuple[str, str]]) -> str:
    """'Pareto front (val_acc max, throughput max), 5 trials in 3 groups the measurements separate'
    (and how many candidates left it, dominated within noise)."""
    beaten = int(front[DOMINATED_COLUMN].notna().sum()) if DOMINATED_COLUMN in front else 0
    members = len(front) - beaten
    text = (f"Pareto front ({', '.join(f'{m} {mode}' for m, mode in objectives)}), {members} trial{'s' * (members != 1)}"
            f" in {front_groups(front, objectives)} group{'s' * (front_groups(front, objectives) != 1)} the measurements separate")
    if beaten:
        text += f"; {beaten} more dominated within noise (listed apart)"
    if "test_acc" in front and front["test_acc"].notna().any():
        text += "; selected on validation, test_acc scored once on the held-out test split"
    return text


def trial_view(row: pd.Series, objectives: Sequence[tuple[str, str]], *, fmt: str,
               fixed: Mapping[str, object] | None = None) -> str:
    """One trial (e.g. what :func:`search.select` picked) with every column that has a value, and
    the ``fixed`` settings (:func:`search.results.query.fixed_settings`) after them: ``KEY  VALUE``
    lines, a JSON object (``fixed`` under its own key), or a one-row CSV of the columns."""
    present = {k: v for k, v in row.items() if not (v is None or (not isinstance(v, (list, tuple)) and pd.isna(v)))}
    leading = ["trial_id", "model", "family"] + [c for c, _ in objectives]
    order = [c for c in leading if c in present] + [c for c in present if c not in leading]
    record = {k: present[k] for k in order}
    fixed = dict(fixed or {})

    def table() -> str:
        width = max(map(len, order + list(fixed)))
        lines = []
        for key in order + ([""] if fixed else []) + list(fixed):
            if not key:
                lines.append("fixed by the spec:")
                continue
            value = present[key] if key in present else fixed[key]
            if key in ("throughput", "throughput_before_conversion"):
                text = f"{value:,.0f}"
            elif isinstance(value, float):
                text = f"{value:.6g}"
            else:
                text = str(value)
            lines.append(f"{key:<{width}}  {text}")
        return "\n".join(lines)

    return render({**record, "fixed": fixed} if fixed else record, fmt=fmt, table=table, csv=pd.DataFrame([record]))


# -- compare -------------------------------------------------------------------------------
def comparison_view(comparison: Comparison, *, fmt: str) -> str:
    """A table (fronts, then hypervolumes), JSON (everything) or CSV (the stacked fronts only)."""
    objectives = comparison.objectives
    leading = ("study", "joint_front")
    front = comparison.front[front_columns(comparison.front, objectives, leading=leading)]
    reference = None if comparison.reference is None else dict(zip([c for c, _ in objectives], comparison.reference))

    def table() -> str:
        heading = ", ".join(f"{c} {m}" for c, m in objectives)
        lines = [f"Pareto fronts ({heading}); joint_front: on the front of all the studies together", ""]
        if comparison.front.empty:
            lines.append("(every front is empty: no trial has completed yet)")
        else:
            lines.append(_front_table(front, objectives, ""))
        if comparison.reference is None:
            lines += ["", "hypervolume: - (no front has a point)"]
        else:
            ref = ", ".join(f"{c} {v:.4g}" for (c, _), v in zip(objectives, comparison.reference))
            lines += ["", f"hypervolume, reference point {ref} (the worst value on any of these fronts):"]
            studies = comparison.studies.drop(columns="path").copy()
            studies["hypervolume"] = studies["hypervolume"].map(lambda v: f"{v:.6g}")
            lines.append(studies.to_string(index=False))
        return "\n".join(lines)

    document = {"objectives": [list(o) for o in objectives], "reference": reference, "studies": comparison.studies,
                "front": front}
    return render(document, fmt=fmt, table=table, csv=front)


# -- knob effects and importance -------------------------------------------------------------
def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _number(value: Any, objective: str) -> str:
    if _missing(value):
        return "-"
    if objective in ("throughput", "params", "flops"):
        return f"{value:,.0f}"
    return f"{value:.4f}"


def _signed(value: Any, objective: str) -> str:
    text = _number(value, objective)
    return text if text == "-" or text.startswith("-") else "+" + text


def _p(value: Any) -> str:
    if _missing(value):
        return "-"
    return "<0.0001" if value < 1e-4 else f"{value:.4f}"


def effect_lines(table: pd.DataFrame) -> list[tuple[str, list[str], list[list[str]]]]:
    """``table`` (:func:`search.results.effects.knob_effects`) as (heading, column names, cells) per
    objective and knob: what the CLI's table and the report show."""
    groups = []
    for (objective, knob), group in table.groupby(["objective", "knob"], sort=False):
        mode = group["mode"].iloc[0]
        baseline = group["baseline"].iloc[0]
        heading = f"{knob} on {objective} ({mode}), baseline {knob}={baseline}"
        columns = ["value", "n", "mean", "95% t interval", f"diff to {baseline}", "diff 95%", "pairs", "p", "verdict"]
        cells = []
        for _, r in group.iterrows():
            interval = "-" if _missing(r["low"]) else f"{_number(r['low'], objective)} to {_number(r['high'], objective)}"
            diff_interval = ("-" if _missing(r["diff_low"])
                             else f"{_signed(r['diff_low'], objective)} to {_signed(r['diff_high'], objective)}")
            versus = ([_signed(r["diff"], objective), diff_interval, str(r["pairs"]), _p(r["p_value"])]
                      if r["verdict"] != "baseline" else ["", "", "", ""])
            cells.append([str(r["value"]), str(r["n"]), _number(r["mean"], objective), interval, *versus, r["verdict"]])
        groups.append((heading, columns, cells))
    return groups


def effects_view(table: pd.DataFrame, *, fmt: str) -> str:
    """``table`` (:func:`search.results.effects.knob_effects`) as JSON records, CSV, or for people:
    per objective and knob, its values against the baseline, the test named in the header."""

    def text() -> str:
        if table.empty:
            return "(no knob with more than one value: nothing to compare)"
        out = [f"knob effects on COMPLETE trials: each value's mean with its 95% t interval over its trials; the "
               f"difference to the baseline by a {TEST} on trials matched by seed and every other knob "
               "(inconclusive: its 95% interval covers 0)"]
        for heading, columns, cells in effect_lines(table):
            widths = [max(len(c), *(len(row[j]) for row in cells)) for j, c in enumerate(columns)]
            out += ["", f"{heading}:", "  " + "  ".join(c.rjust(w) if j else c.ljust(w)
                                                        for j, (c, w) in enumerate(zip(columns, widths)))]
            for row in cells:
                out.append("  " + "  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(row, widths))))
        if not table["n"].any():
            out += ["", "(no COMPLETE trial yet: nothing to compare)"]
        return "\n".join(out)

    return render(table, fmt=fmt, table=text)


def importance_view(table: pd.DataFrame, *, fmt: str) -> str:
    """``table`` (:func:`search.results.importance.knob_importance`) as JSON records, CSV, or for
    people: per family, the knobs (most important for the first objective first) against the
    objectives, with the number of COMPLETE trials and, below the minimum, the warning."""

    def text() -> str:
        if table.empty:
            return "(no searched knob: nothing to rank)"
        name = "fANOVA (seeded)" if table["evaluator"].iloc[0] == "fanova" else "PED-ANOVA"
        out = [f"knob importance by {name}, on COMPLETE trials only: each knob's share of the objective's total"]
        for group in by_family(table):
            out += ["", f"{group.heading}:"]
            if group.warning:
                out.append(f"  {group.warning}")
            if group.shares is None:
                out.append("  (fewer than 2 COMPLETE trials: nothing to compare)")
                continue
            objectives = list(group.shares.columns)
            width = max(len("knob"), *map(len, group.shares.index))
            widths = [max(len(o), 5) for o in objectives]
            out.append("  " + "knob".ljust(width) + "".join(f"  {o:>{w}}" for o, w in zip(objectives, widths)))
            for knob, row in group.shares.iterrows():
                out.append("  " + knob.ljust(width) + "".join(f"  {row[o]:>{w}.3f}" for o, w in zip(objectives, widths)))
        return "\n".join(out)

    return render(table, fmt=fmt, table=text)

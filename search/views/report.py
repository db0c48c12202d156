"""``python -m search report DIR``: one self-contained HTML file and a PNG of the front.

The HTML holds everything inline -- the data, the page's CSS and JS (the live page's, see
:mod:`search.views.dashboard.server`), and the PNG as a data: URI -- so it opens offline, can be mailed or
attached, and makes no network request. Its top part is plain HTML (a summary, the front as a
picture and as a table) for readers that do not run scripts, e.g. mail clients; below it, the
interactive views of the live page.

The PNG is drawn with Pillow (a dependency already: FFCV needs it; matplotlib is not one):
drawn at twice the size and downsampled, which antialiases the marks.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import html
import io
import math
import os
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from search.results.effects import TEST, grid_knobs, study_effects
from search.results.front import DOMINATED_COLUMN, front_groups
from search.results.importance import MIN_COMPLETE_TRIALS, MIN_TRIALS_PER_KNOB, VIEW_MAX_TRIALS, by_family, knob_importance
from search.results.intervals import bounds
from search.results.query import load, study_dir
from search.results.store import TRIAL_COLUMNS
from search.text import count
from search.views.dashboard.server import render_page, studies_payload
from search.views.mechanisms import mechanisms_section
from search.views.robustness import robustness_section
from search.views.output import effect_lines
from trainers import atomic_write, check_output_file
from trainers.errors import ConfigError

__all__ = ["Report", "write_report", "front_png"]

FAMILY_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]
BAR_COLOR = "#8c959f"  # the front members' 95% intervals
TIED_COLOR = "#d1242f"  # the ring of a front member tied with another (see search/results/intervals.py)
LABELS = {"throughput": "throughput (img/s)", "val_acc": "val_acc", "params": "params", "flops": "FLOPs"}


@dataclasses.dataclass(frozen=True)
class Report:
    html: Path
    png: Path
    trials: int
    front: int
    seconds: float


def _nice_ticks(lo: float, hi: float, n: int) -> list[float]:
    span = hi - lo
    if not span > 0:
        return [lo]
    step = 10 ** math.floor(math.log10(span / n))
    err = n / span * step
    step *= 10 if err <= 0.15 else 5 if err <= 0.35 else 2 if err <= 0.75 else 1
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def _tick_text(value: float, step: float) -> str:
    if abs(value) >= 1e6:
        return f"{value / 1e6:.3g}M"
    if abs(value) >= 1e4 or step >= 1:
        return f"{value:,.0f}"
    digits = 0  # as many decimals as the tick step has: 0.05 -> 2
    while digits < 6 and abs(round(step * 10**digits) - step * 10**digits) > 1e-6 * 10**digits:
        digits += 1
    return f"{value:.{digits}f}"


def _rgb(hex_color: str, alpha: int = 255) -> tuple[int, int, int, int]:
    return int(hex_color[1:3], 16), int(hex_color[3:5], 16), int(hex_color[5:7], 16), alpha


def front_png(
    trials: pd.DataFrame,
    *,
    front: pd.DataFrame,
    x: str,
    y: str,
    modes: Sequence[str] = ("max", "max"),
    title: str,
    size: tuple[int, int] = (1600, 1000),
) -> bytes:
    """A PNG of ``y`` against ``x``: trials coloured by family (hollow: cut short), the front's
    trials ringed and joined by the staircase they dominate when ``x``/``y`` are the objectives."""
    from PIL import Image, ImageDraw, ImageFont

    ss = 2  # drawn at twice the size, then downsampled: antialiased marks
    width, height = size[0] * ss, size[1] * ss
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image, "RGBA")  # RGBA fills blend onto the RGB image

    def font(px: int):
        try:
            return ImageFont.load_default(size=px * ss)
        except TypeError:  # Pillow < 10.1: a fixed bitmap font
            return ImageFont.load_default()

    f_small, f_axis, f_title = font(15), font(17), font(22)
    left, right, top, bottom = 120 * ss, width - 40 * ss, 90 * ss, height - 150 * ss
    shown = trials[trials["state"] != "REJECTED"]
    xs = pd.to_numeric(shown[x], errors="coerce").to_numpy(dtype=float, na_value=np.nan) if x in shown else np.array([])
    ys = pd.to_numeric(shown[y], errors="coerce").to_numpy(dtype=float, na_value=np.nan) if y in shown else np.array([])
    ok = np.isfinite(xs) & np.isfinite(ys)
    draw.text((left, 28 * ss), title, fill="#1f2328", font=f_title)
    if not ok.any():
        draw.text((width / 2, height / 2), "no trial has both values yet", fill="#59636e", font=f_axis, anchor="mm")
        return _png_bytes(image.resize(size, Image.LANCZOS))
    x_lo, x_hi = float(xs[ok].min()), float(xs[ok].max())
    y_lo, y_hi = float(ys[ok].min()), float(ys[ok].max())
    if len(front) and x in front and y in front:  # room for the front's error bars
        (bx_lo, bx_hi), (by_lo, by_hi) = bounds(front, x), bounds(front, y)
        x_lo, x_hi = float(np.nanmin([x_lo, *bx_lo])), float(np.nanmax([x_hi, *bx_hi]))
        y_lo, y_hi = float(np.nanmin([y_lo, *by_lo])), float(np.nanmax([y_hi, *by_hi]))
    pad_x = (x_hi - x_lo) * 0.04 or abs(x_lo) * 0.05 or 1.0
    pad_y = (y_hi - y_lo) * 0.06 or abs(y_lo) * 0.05 or 0.01
    x_lo, x_hi, y_lo, y_hi = x_lo - pad_x, x_hi + pad_x, y_lo - pad_y, y_hi + pad_y

    def sx(v: float) -> float:
        return left + (v - x_lo) / (x_hi - x_lo) * (right - left)

    def sy(v: float) -> float:
        return bottom - (v - y_lo) / (y_hi - y_lo) * (bottom - top)

    xt, yt = _nice_ticks(x_lo, x_hi, 8), _nice_ticks(y_lo, y_hi, 7)
    for v in xt:
        px = sx(v)
        draw.line([(px, top), (px, bottom)], fill="#eef1f4", width=ss)
        draw.text((px, bottom + 8 * ss), _tick_text(v, xt[1] - xt[0] if len(xt) > 1 else 1.0), fill="#59636e",
                  font=f_small, anchor="mt")
    for v in yt:
        py = sy(v)
        draw.line([(left, py), (right, py)], fill="#eef1f4", width=ss)
        draw.text((left - 8 * ss, py), _tick_text(v, yt[1] - yt[0] if len(yt) > 1 else 1.0), fill="#59636e",
                  font=f_small, anchor="rm")
    draw.line([(left, top), (left, bottom), (right, bottom)], fill="#8c959f", width=ss)
    direction = {"max": "higher is better", "min": "lower is better"}
    draw.text(((left + right) / 2, bottom + 40 * ss), f"{LABELS.get(x, x)}  ({direction[modes[1]]})" if len(modes) > 1 else LABELS.get(x, x),
              fill="#1f2328", font=f_axis, anchor="mt")
    ylabel = Image.new("RGBA", (int((bottom - top)), 30 * ss), (255, 255, 255, 0))
    ImageDraw.Draw(ylabel).text((ylabel.width / 2, ylabel.height / 2), f"{LABELS.get(y, y)}  ({direction[modes[0]]})",
                                fill="#1f2328", font=f_axis, anchor="mm")
    rotated = ylabel.rotate(90, expand=True)
    image.paste(rotated, (18 * ss, int(top)), rotated)

    families = sorted(str(f) for f in trials["family"].dropna().unique()) if "family" in trials else []  # as the page: all trials
    color = {f: FAMILY_COLORS[k % len(FAMILY_COLORS)] for k, f in enumerate(families)}
    state = shown["state"].to_numpy()
    fam = shown["family"].astype(object).where(shown["family"].notna(), "").to_numpy() if "family" in shown else np.full(len(shown), "")
    n = int(ok.sum())
    r = (2.2 if n > 3000 else 3.0 if n > 500 else 4.5) * ss
    cut = np.isin(state, ["PRUNED", "FAILED"])
    for k in np.flatnonzero(ok & cut):  # cut short first (underneath), hollow
        px, py = sx(xs[k]), sy(ys[k])
        draw.ellipse([px - r, py - r, px + r, py + r], outline=_rgb(color.get(fam[k], "#6e7781"), 170), width=max(1, ss))
    for k in np.flatnonzero(ok & ~cut):
        px, py = sx(xs[k]), sy(ys[k])
        draw.ellipse([px - r, py - r, px + r, py + r], fill=_rgb(color.get(fam[k], "#6e7781"), 200))

    fx = pd.to_numeric(front[x], errors="coerce").to_numpy(dtype=float, na_value=np.nan) if len(front) and x in front else np.array([])
    fy = pd.to_numeric(front[y], errors="coerce").to_numpy(dtype=float, na_value=np.nan) if len(front) and y in front else np.array([])
    keep = np.isfinite(fx) & np.isfinite(fy)
    if keep.any():
        sgx = -1.0 if len(modes) > 1 and modes[1] == "min" else 1.0
        sgy = -1.0 if modes[0] == "min" else 1.0
        order = np.argsort(sgx * fx[keep], kind="stable")
        px_, py_ = fx[keep][order], fy[keep][order]
        # the boundary of what the front dominates: in from the x-worst edge, then trial to trial
        path = [(left if sgx > 0 else right, sy(py_[0])), (sx(px_[0]), sy(py_[0]))]
        for k in range(1, len(px_)):
            path += [(sx(px_[k - 1]), sy(py_[k])), (sx(px_[k]), sy(py_[k]))]
        path.append((sx(px_[-1]), bottom if sgy > 0 else top))
        draw.line(path, fill="#1f2328", width=2 * ss, joint="curve")
        front_fam = front["family"].astype(object).where(front["family"].notna(), "").to_numpy()[keep] if "family" in front else [""] * int(keep.sum())
        R = r + 3 * ss
        # each member's 95% intervals as error bars (search/results/intervals.py); none where unrecorded
        (x_low, x_high), (y_low, y_high) = (tuple(b[keep] for b in bounds(front, c)) for c in (x, y))
        cap = 5 * ss
        for vx, vy, a, b, c, d in zip(fx[keep], fy[keep], x_low, x_high, y_low, y_high):
            if b > a:
                draw.line([(sx(a), sy(vy)), (sx(b), sy(vy))], fill=BAR_COLOR, width=ss)
                for e in (a, b):
                    draw.line([(sx(e), sy(vy) - cap), (sx(e), sy(vy) + cap)], fill=BAR_COLOR, width=ss)
            if d > c:
                draw.line([(sx(vx), sy(c)), (sx(vx), sy(d))], fill=BAR_COLOR, width=ss)
                for e in (c, d):
                    draw.line([(sx(vx) - cap, sy(e)), (sx(vx) + cap, sy(e))], fill=BAR_COLOR, width=ss)
        tied = front["tied_with"].notna().to_numpy()[keep] if "tied_with" in front else np.zeros(int(keep.sum()), bool)
        for vx, vy, f, t in zip(fx[keep], fy[keep], front_fam, tied):
            px, py = sx(vx), sy(vy)
            draw.ellipse([px - R, py - R, px + R, py + R], fill=_rgb(color.get(f, "#6e7781")),
                         outline=TIED_COLOR if t else "#1f2328", width=(3 if t else 2) * ss)

    # legend, under the x label
    lx, ly = left, bottom + 90 * ss
    for f in families:
        draw.ellipse([lx, ly - 6 * ss, lx + 12 * ss, ly + 6 * ss], fill=color[f])
        draw.text((lx + 18 * ss, ly), f, fill="#1f2328", font=f_small, anchor="lm")
        lx += 18 * ss + draw.textlength(f, font=f_small) + 22 * ss
    draw.ellipse([lx, ly - 6 * ss, lx + 12 * ss, ly + 6 * ss], outline="#6e7781", width=2 * ss)
    draw.text((lx + 18 * ss, ly), "cut short (PRUNED / FAILED)", fill="#1f2328", font=f_small, anchor="lm")
    lx += 18 * ss + draw.textlength("cut short (PRUNED / FAILED)", font=f_small) + 22 * ss
    draw.line([(lx, ly), (lx + 24 * ss, ly)], fill="#1f2328", width=2 * ss)
    label = f"Pareto front ({count(int(keep.sum()), 'COMPLETE trial')}), bars: 95% intervals"
    draw.text((lx + 30 * ss, ly), label, fill="#1f2328", font=f_small, anchor="lm")
    lx += 30 * ss + draw.textlength(label, font=f_small) + 22 * ss
    draw.ellipse([lx, ly - 7 * ss, lx + 14 * ss, ly + 7 * ss], outline=TIED_COLOR, width=3 * ss)
    draw.text((lx + 20 * ss, ly), "tied: intervals overlap on both", fill="#1f2328", font=f_small, anchor="lm")
    return _png_bytes(image.resize(size, Image.LANCZOS))


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def _cell(value: object, column: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if column in ("throughput", "throughput_before_conversion"):
        return f"{value:,.0f}"
    if column in ("params", "flops"):
        return f"{value / 1e6:.2f}M"
    if isinstance(value, float):
        return f"{value:.4f}" if column in ("val_acc", "val_loss", "final_val_acc", "test_acc") else f"{value:.4g}"
    return str(value)


def _grid_arms(exp, study) -> dict[str, str]:
    """A grid study's trials labelled by their grid point, its knobs that vary ("k=v, ..."), so a
    figure averages each point's trials apart."""
    knobs = [k for k, values in grid_knobs(exp.spec, study).items() if len(values) > 1 and k in exp.trials]
    if not knobs:
        return {}
    return {str(row["trial_id"]): ", ".join(f"{k}={row[k]}" for k in knobs) for _, row in exp.trials.iterrows()}


def _front_table(front: pd.DataFrame, objectives: Sequence[tuple[str, str]]) -> str:
    knobs = [c for c in front.columns if c not in TRIAL_COLUMNS]
    front = front.copy()
    columns = ["trial_id", "family", "model"]
    for column, _ in objectives:  # each objective, then its 95% interval where recorded
        columns.append(column)
        if f"{column}_low" in front and front[f"{column}_low"].notna().any():
            front[f"{column} 95%"] = [f"{_cell(a, column)}-{_cell(b, column)}" if a == a and b == b else "?"
                                      for a, b in zip(front[f"{column}_low"], front[f"{column}_high"])]
            columns.append(f"{column} 95%")
    if "test_acc" in front and front["test_acc"].notna().any():  # the held-out score, selected on nothing
        front["test_acc 95%"] = [f"{_cell(a, 'test_acc')}-{_cell(b, 'test_acc')}" if a == a and b == b
                                 else "-" if v != v else "?"  # '-': not scored (set apart)
                                 for v, a, b in zip(front["test_acc"], front["test_acc_low"], front["test_acc_high"])]
        columns += ["test_acc", "test_acc 95%"]
    columns += [c for c in ("tied_with", "dominated_by", "params", "flops", "epochs_run") if c not in columns] + knobs
    columns = [c for c in columns if c in front.columns and front[c].notna().any()]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row[c], c))}</td>" for c in columns) + "</tr>"
        for _, row in front.iterrows()
    )
    return f'<table class="front-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _importance_section(study: Path) -> str:
    """The knobs ranked per objective (fANOVA on the study's Optuna journal, COMPLETE trials only),
    one table per family, each with its trial count and, below the minimum, the warning; a study
    without a journal gets a line saying so instead (the rest of the report does not need it)."""
    head = '<section class="report card" id="importance"><h3>Knob importance</h3>'
    try:
        table = knob_importance(study, max_trials=VIEW_MAX_TRIALS)
    except ConfigError as exc:
        return f'{head}<p class="note">Not available: {html.escape(str(exc))}</p></section>'
    parts = [head, '<p class="note">Each knob\'s share of the objective\'s total, by Optuna\'s fANOVA (seeded) on the '
             f"COMPLETE trials of the study's optuna.journal only; below {MIN_COMPLETE_TRIALS} COMPLETE trials "
             f"({MIN_TRIALS_PER_KNOB} per knob where that is more) a ranking is mostly noise. Per family in a conditional space. The same numbers: "
             f"<code>python -m search importance {html.escape(shlex.quote(str(study)))}</code></p>"]
    if table.empty:
        return "".join(parts) + '<p class="note">No searched knob: nothing to rank.</p></section>'
    for group in by_family(table):
        parts.append(f"<h3>{html.escape(group.heading)}</h3>")
        if group.warning:
            parts.append(f'<p class="note warning">{html.escape(group.warning)}</p>')
        if group.shares is None:
            parts.append('<p class="note">Fewer than 2 COMPLETE trials: nothing to compare.</p>')
            continue
        objectives = list(group.shares.columns)
        header = "".join(f"<th>{html.escape(o)}</th>" for o in ["knob", *objectives])
        body = "".join("<tr><td>" + html.escape(str(knob)) + "</td>"
                       + "".join(f"<td>{row[o]:.3f}</td>" for o in objectives) + "</tr>"
                       for knob, row in group.shares.iterrows())
        parts.append(f'<table class="front-table importance-table"><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>')
    return "".join(parts) + "</section>"


def _effects_section(study: Path) -> str:
    """A grid study's knob effects (search.results.effects): per objective and knob, each value's
    mean and its difference to the baseline value, by a paired t test; in place of the importance,
    which needs the Optuna journal a grid does not keep."""
    head = '<section class="report card" id="effects"><h3>Knob effects (grid)</h3>'
    try:
        table = study_effects(study)
    except ConfigError as exc:
        return f'{head}<p class="note">Not available: {html.escape(str(exc))}</p></section>'
    parts = [head, "<p class=\"note\">COMPLETE trials only. Each value's mean with its 95% t interval over its trials "
             f"(over the seeds and the other knobs' values); the difference to the baseline value by a {TEST} on "
             "trials matched by seed and every other knob's value, with its 95% interval and p-value. "
             "<b>inconclusive</b>: that interval covers 0. Another baseline, one objective, JSON or CSV: "
             f"<code>python -m search effects {html.escape(shlex.quote(str(study)))} --baseline KNOB=VALUE</code></p>"]
    if table.empty:
        return "".join(parts) + '<p class="note">No knob with more than one value: nothing to compare.</p></section>'
    for heading, columns, cells in effect_lines(table):
        parts.append(f"<h3>{html.escape(heading)}</h3>")
        header = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in cells)
        parts.append(f'<table class="front-table effects-table"><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>')
    return "".join(parts) + "</section>"


def _write_shared(path: Path, data: bytes) -> None:
    """Atomically, readable as the umask allows (atomic_write gives it a normal file's mode)."""
    atomic_write(path, lambda handle: handle.write(data))


def _report_path(out: str | os.PathLike | None) -> Path | None:
    """``out`` exactly as given, checked before any work: an .html file in a folder that is there or
    can be made (None: the default). A folder or another suffix is refused, not rewritten."""
    if out is None:
        return None
    path = Path(out)
    if str(out).strip() and path.name and not path.is_dir() and path.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"--out {out}: the report is an HTML file; pass a name ending in .html, "
                          f"such as {path.with_suffix('.html')}")
    return check_output_file(out, option="--out", example="report.html")


def write_report(study: str | os.PathLike, *, out: str | os.PathLike | None = None) -> Report:
    """Write ``out`` (default ``<study>/report.html``) and ``<out stem>-front.png`` beside it: both
    or, on an error (ConfigError), neither."""
    started = time.perf_counter()
    out_path = _report_path(out)
    study = study_dir(study)  # ConfigError, naming the fix, when it is not a study; a URI: its staging copy
    exp = load(study)
    if out_path is None:
        out_path = study / "report.html"
    png_path = out_path.with_name(out_path.stem + "-front.png")
    objectives = list(exp.objectives)
    shown = exp.front(dominated=True)
    beaten = shown[shown[DOMINATED_COLUMN].notna()]
    front = shown[shown[DOMINATED_COLUMN].isna()]
    trials = exp.trials
    y = objectives[0][0]
    x = objectives[1][0] if len(objectives) > 1 else "throughput"
    modes = [m for _, m in objectives[:2]]
    name = exp.spec.get("name") or study.name
    grid = ((exp.spec.get("spec") or {}).get("algorithm") or {}).get("name") == "grid"
    png = front_png(trials, front=front, x=x, y=y, modes=modes,
                    title=f"{name}: {count(len(front), 'trial')} on the Pareto front, of {len(trials)} finished"
                    + (f" (front: means over up to {int(front['seeds'].max())} seeds)"
                       if "seeds" in front and len(front) and front["seeds"].max() > 1 else ""))

    counts = trials["state"].value_counts().to_dict() if len(trials) else {}
    payload = studies_payload([study])
    if payload["studies"][0].get("error"):
        raise ConfigError(payload["studies"][0]["error"])
    progress = payload["studies"][0].get("progress") or {}
    volume = (progress.get("hypervolume") or [None])[-1]
    complete = trials[trials["state"] == "COMPLETE"]
    best = complete["val_acc"].max() if "val_acc" in complete and len(complete) else None
    generated = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    facts = [
        ("study", f"{name} ({study})"),
        ("objectives", ", ".join(f"{c} ({m})" for c, m in objectives)),
        ("trials", f"{len(trials)} finished" + (f" of {exp.spec['spec']['budget']['trials']}" if (exp.spec.get("spec") or {}).get("budget") else "")
         + (": " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) if counts else "")),
        ("front", f"{len(front)} COMPLETE trials in {front_groups(front, objectives)} groups the measurements separate"
         + (f"; {len(beaten)} more dominated within noise" if len(beaten) else "")),
    ]
    if best is not None and not pd.isna(best):
        facts.append(("best val_acc", f"{best:.4f}"))
    if volume is not None:
        facts.append(("hypervolume", f"{volume:,.4g} (reference point {exp.spec.get('reference_point')})"))
    facts += [("created", str(exp.spec.get("created_at", "?"))), ("git commit", str(exp.spec.get("git_commit") or "?")),
              ("report generated", generated)]
    export = (f"python -m search pareto {shlex.quote(str(study))} --where \"trial_id=='TRIAL'\" --export best.yaml"
              "\npython -m search train best.yaml")
    static_html = (
        '<section class="report card">'
        f"<h2>Report: {html.escape(name)}</h2>"
        '<table class="facts">' + "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in facts) + "</table>"
        f'<img class="front-png" alt="Pareto front of {html.escape(name)}: {html.escape(y)} against {html.escape(x)}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<h3>Pareto front ({count(len(front), 'trial')})</h3>" + _front_table(front, objectives) +
        (f"<h3>Dominated within noise ({len(beaten)})</h3><p class=\"note\">Pareto-optimal on the point values, but a "
         "member of the front (dominated_by) is level within noise on every objective and better beyond noise on one, "
         "so nothing measured favours them: not on the front.</p>" + _front_table(beaten, objectives) if len(beaten) else "") +
        f'<p class="note">Retrain one of them (replace TRIAL with its id):</p><pre class="export">{html.escape(export)}</pre>'
        '<p class="note">Below: every trial, interactive (needs JavaScript; the data is inside this file).</p>'
        "</section>" + (_effects_section(study) if grid else _importance_section(study))
        + mechanisms_section(exp.epochs, _grid_arms(exp, study) if grid else None)
        + robustness_section(trials, _grid_arms(exp, study) if grid else None)
    )
    page = render_page(data=payload, title=f"{name}: Pareto report", static_html=static_html)
    _write_shared(png_path, png)
    _write_shared(out_path, page.encode())
    return Report(html=out_path, png=png_path, trials=len(trials), front=len(front), seconds=time.perf_counter() - started)

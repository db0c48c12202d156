"""The report's figure of what the models reported of their own mechanisms in training (epochs.parquet's
``mechanisms``, trainers.hooks.ReportsMechanisms): ConViT's gates sigma(lambda), GMM's kernel widths.

One chart per mechanism (the names' first part: ``gate``, ``nonlocality``, ``sigma``), one line per
block (the second part; in a grid study per grid point and block): after each epoch, the block's mean
over its heads (and kernels), averaged over the trials that have that block. An inline SVG: the
report stays one self-contained file.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

__all__ = ["mechanism_curves", "mechanisms_section", "line_chart"]

# what the chart says each mechanism is (the paper's figure it answers), where this project knows it
MEANING = {
    "gate": "ConViT's gates sigma(lambda): the share of each GPSA head's attention paid to position "
            "(the paper's Fig. 6 sees their mean fall in training, to near 0 in the later blocks)",
    "sigma": "GMM's kernel widths abs(sigma): how far each Gaussian of the mask reaches, in patches",
    "nonlocality": "ConViT's nonlocality (the paper's Eq. 8) on the same validation images after each epoch: "
                   "how far, in patches, each block's heads look from the query (the paper's Fig. 5 sees it "
                   "grow in training in every GPSA block)",
}
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 520, 240, 48, 110, 12, 34


def _pairs(cell: Any) -> list[tuple[str, float]]:
    """A ``mechanisms`` cell as (name, value) pairs (Parquet's map reads back as pairs; null: none)."""
    if cell is None or (isinstance(cell, float) and math.isnan(cell)):
        return []
    return [(str(n), float(v)) for n, v in (cell.items() if isinstance(cell, Mapping) else cell)]


def mechanism_curves(epochs: pd.DataFrame, arms: Mapping[str, str] | None = None) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{mechanism: {line: [(epoch, mean), ...]}}: after each epoch, each trial's mean of the block's
    values, averaged over the trials reporting that block. A line is a block ("block B"), or where
    ``arms`` labels the trials (trial_id -> e.g. "local_up_to_layer=3") an arm's block ("ARM,
    block B"): a DeiT's nonlocality is not averaged with a ConViT's. Empty where no epoch reports any."""
    if epochs.empty or "mechanisms" not in epochs:
        return {}
    per_trial: dict[tuple[str, str, int, int], list[float]] = {}  # (mechanism, arm, block, epoch) -> a mean per trial
    for row in epochs.drop_duplicates(["trial_id", "epoch"], keep="last").itertuples(index=False):
        arm = (arms or {}).get(str(row.trial_id), "")
        grouped: dict[tuple[str, int], list[float]] = {}
        for name, value in _pairs(row.mechanisms):
            parts = name.split(".")
            if len(parts) >= 2 and parts[1].isdigit():
                grouped.setdefault((parts[0], int(parts[1])), []).append(value)
        for (mechanism, block), values in grouped.items():
            per_trial.setdefault((mechanism, arm, block, int(row.epoch)), []).append(sum(values) / len(values))
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for (mechanism, arm, block, epoch), means in sorted(per_trial.items()):
        line = f"{arm}, block {block}" if arm else f"block {block}"
        curves.setdefault(mechanism, {}).setdefault(line, []).append((epoch, sum(means) / len(means)))
    return curves


def line_chart(mechanism: str, lines: Mapping[str, list[tuple[int, float]]], *, x_label: str = "epoch",
               top: float | None = None) -> str:
    """An inline SVG of ``lines`` ({label: [(x, y), ...]}), y from 0 to ``top`` (default: a gate's
    whole range 0-1, else just above the largest value)."""
    epochs = [e for line in lines.values() for e, _ in line]
    values = [v for line in lines.values() for _, v in line]
    lo_x, hi_x = min(epochs), max(epochs)
    if top is None:
        top = 1.0 if mechanism == "gate" else max(values) * 1.05 or 1.0  # a gate is a share: its whole range
    right = max(RIGHT, 16 + 6 * max(len(label) for label in lines))  # the legend's room
    width = WIDTH - RIGHT + right
    plot_w, plot_h = width - LEFT - right, HEIGHT - TOP - BOTTOM

    def xy(epoch: float, value: float) -> str:
        x = LEFT + (0.5 if hi_x == lo_x else (epoch - lo_x) / (hi_x - lo_x)) * plot_w
        return f"{x:.1f},{TOP + (1 - value / top) * plot_h:.1f}"

    parts = [f'<svg class="mechanism" width="{width}" height="{HEIGHT}" viewBox="0 0 {width} {HEIGHT}" '
             f'role="img" aria-label="{html.escape(mechanism)} against {html.escape(x_label)}">',
             f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>']
    for value in (0.0, top / 2, top):
        x0, y0 = xy(lo_x, value).split(",")
        parts.append(f'<text x="{LEFT - 4}" y="{float(y0) + 4:.1f}" font-size="11" text-anchor="end">{value:.3g}</text>')
    for epoch in sorted({lo_x, hi_x} if x_label == "epoch" else set(epochs)):
        x0, _ = xy(epoch, 0.0).split(",")
        parts.append(f'<text x="{x0}" y="{HEIGHT - BOTTOM + 14}" font-size="11" text-anchor="middle">{epoch}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" font-size="11" text-anchor="middle">{html.escape(x_label)}</text>')
    for k, (label, line) in enumerate(lines.items()):
        colour = COLOURS[k % len(COLOURS)]
        dash = "" if k < len(COLOURS) else ' stroke-dasharray="5,3"'  # more lines than colours: the rest dashed
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} '
                     f'points="{" ".join(xy(e, v) for e, v in line)}"/>')
        parts.append(f'<text x="{width - right + 8}" y="{TOP + 14 * (k + 1)}" font-size="11" fill="{colour}">'
                     f'{html.escape(label)}</text>')
    return "".join(parts) + "</svg>"


def mechanisms_section(epochs: pd.DataFrame, arms: Mapping[str, str] | None = None) -> str:
    """The report's section of the mechanisms' curves ('' where the study's models report none);
    ``arms``: as `mechanism_curves`."""
    curves = mechanism_curves(epochs, arms)
    if not curves:
        return ""
    out = ['<section class="report card" id="mechanisms"><h3>Mechanisms in training</h3>',
           '<p class="note">What the models reported of their own mechanism after each epoch (epochs.parquet, column '
           "<code>mechanisms</code>): per block, the mean over its heads, averaged over the trials that have the "
           "block (in a grid study, over each grid point's trials).</p>"]
    for mechanism, blocks in curves.items():
        meaning = MEANING.get(mechanism, mechanism)
        out.append(f"<h4>{html.escape(mechanism)}</h4><p class=\"note\">{html.escape(meaning)}</p>"
                   + line_chart(mechanism, blocks))
    return "".join(out) + "</section>"

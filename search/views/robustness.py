"""The report's figure of the held-out test under corruption (trials.parquet's ``test_corrupted``,
trainers.corruptions): per grid point, the accuracy on the clean test split (severity 0) and, at
each severity 1-3, the mean over the corruptions; averaged over the point's trials. A robustness
claim (studies/claims.yaml: an effect with ``severity``) reads the same numbers per seed.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import pandas as pd

from search.views.mechanisms import _pairs, line_chart

__all__ = ["robustness_curves", "robustness_section"]


def robustness_curves(trials: pd.DataFrame, arms: Mapping[str, str] | None = None) -> dict[str, list[tuple[int, float]]]:
    """{arm: [(severity, accuracy), ...]} for severities 0-3 (0: test_acc; s: the mean over the
    corruptions at s), each the mean over the arm's trials ("all" where ``arms`` labels none)."""
    if trials.empty or "test_corrupted" not in trials:
        return {}
    per_arm: dict[str, dict[int, list[float]]] = {}
    for row in trials.itertuples(index=False):
        corrupted = dict(_pairs(row.test_corrupted))  # a map cell, as mechanisms' (Parquet reads pairs back)
        if not corrupted or pd.isna(row.test_acc):
            continue
        points = per_arm.setdefault((arms or {}).get(str(row.trial_id), "all"), {})
        points.setdefault(0, []).append(float(row.test_acc))
        for severity in (1, 2, 3):
            at = [v for name, v in corrupted.items() if name.endswith(f".{severity}")]
            if at:
                points.setdefault(severity, []).append(statistics.fmean(at))
    return {arm: [(s, statistics.fmean(v)) for s, v in sorted(points.items())] for arm, points in sorted(per_arm.items())}


def robustness_section(trials: pd.DataFrame, arms: Mapping[str, str] | None = None) -> str:
    """The report's section ('' where no trial was scored on corrupted images)."""
    curves = robustness_curves(trials, arms)
    if not curves:
        return ""
    return ('<section class="report card" id="robustness"><h3>Held-out test under corruption</h3>'
            '<p class="note">Test accuracy of the selected weights on the clean test split (severity 0) and on '
            'corrupted copies of it (trials.parquet, column <code>test_corrupted</code>): at each severity the mean '
            'over Gaussian noise, Gaussian blur and contrast (trainers.corruptions, after Hendrycks &amp; Dietterich '
            '2019), averaged over each grid point\'s trials.</p>'
            + line_chart("test accuracy", curves, x_label="severity", top=1.0) + "</section>")

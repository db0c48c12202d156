"""The report's robustness figure (search.views.robustness) against numbers worked out by hand."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from search.views.robustness import robustness_curves, robustness_section


def _trials() -> pd.DataFrame:
    return pd.DataFrame([
        # a0: clean 0.8; severity 1: noise 0.7 blur 0.6 contrast 0.5 -> 0.6; severity 3: 0.2 0.3 0.4 -> 0.3
        ("a0", 0.8, {"gaussian_noise.1": 0.7, "gaussian_blur.1": 0.6, "contrast.1": 0.5,
                     "gaussian_noise.3": 0.2, "gaussian_blur.3": 0.3, "contrast.3": 0.4}),
        # a1: clean 0.6; severity 1: 0.4 each; severity 3: 0.1 each (as Parquet reads a map back: pairs)
        ("a1", 0.6, [("gaussian_noise.1", 0.4), ("gaussian_blur.1", 0.4), ("contrast.1", 0.4),
                     ("gaussian_noise.3", 0.1), ("gaussian_blur.3", 0.1), ("contrast.3", 0.1)]),
        ("b0", 0.9, {"contrast.1": 0.85}),
        ("c0", 0.5, None),  # not scored on corrupted images: left out
    ], columns=["trial_id", "test_acc", "test_corrupted"])


def test_the_curves_average_the_corruptions_then_the_arms_trials():
    curves = robustness_curves(_trials(), {"a0": "k=1", "a1": "k=1", "b0": "k=2", "c0": "k=3"})
    assert list(curves) == ["k=1", "k=2"]
    # k=1: severity 0 (0.8 + 0.6) / 2 = 0.7; 1 (0.6 + 0.4) / 2 = 0.5; 3 (0.3 + 0.1) / 2 = 0.2
    assert curves["k=1"] == [(0, pytest.approx(0.7)), (1, pytest.approx(0.5)), (3, pytest.approx(0.2))]
    assert curves["k=2"] == [(0, pytest.approx(0.9)), (1, pytest.approx(0.85))]
    assert list(robustness_curves(_trials())) == ["all"]
    assert robustness_curves(_trials()[_trials()["trial_id"] == "c0"]) == {}


def test_the_section_draws_a_line_per_arm_on_an_accuracy_axis():
    text = robustness_section(_trials(), {"a0": "k=1", "a1": "k=1", "b0": "k=2"})
    assert text.startswith('<section class="report card" id="robustness">') and "severity" in text
    lines = re.findall(r'<polyline [^>]*points="([^"]+)"', text)
    assert len(lines) == 2
    # the axis runs 0 to 1: 0.7 sits 30% down the plot (its top 12, height 194)
    y = float(lines[0].split()[0].split(",")[1])
    assert y == pytest.approx(12 + 0.3 * 194, abs=0.05)
    assert robustness_section(_trials()[_trials()["trial_id"] == "c0"]) == ""


def test_a_grid_studys_report_holds_the_figure(tmp_path):
    from search.views.report import write_report
    from tests.search.results.test_claims import _study

    tests = {(v, s): {"test_acc": 0.8, "test_corrupted": {"contrast.1": 0.7, "contrast.3": 0.5}} for v in (0, 1) for s in range(2)}
    study = _study(tmp_path, "robust", model="ls_convit_nano", values=[0, 1],
                   accs={(v, s): 0.5 for v in (0, 1) for s in range(2)}, tests=tests)
    page = write_report(study).html.read_text()
    section = page[page.index('id="robustness"'):]
    assert "local_up_to_layer=0" in section and "local_up_to_layer=1" in section

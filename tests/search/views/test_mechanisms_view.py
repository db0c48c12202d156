"""The report's mechanisms figure (search.views.mechanisms): the curves against numbers worked out by
hand, the SVG drawn from them, and the section in a grid study's report."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from search.views.mechanisms import mechanism_curves, mechanisms_section


def _epochs() -> pd.DataFrame:
    # two trials with two GPSA blocks of 2 heads, one DeiT trial with none; t1's epoch 2 reported twice
    # (a restored trial's row replaced): the last one counts
    rows = [
        ("t0", 1, {"gate.0.0": 0.8, "gate.0.1": 0.6, "gate.1.0": 0.7, "gate.1.1": 0.5}),
        ("t0", 2, {"gate.0.0": 0.6, "gate.0.1": 0.4, "gate.1.0": 0.3, "gate.1.1": 0.1}),
        ("t1", 1, [("gate.0.0", 0.6), ("gate.0.1", 0.6), ("gate.1.0", 0.5), ("gate.1.1", 0.5)]),  # as Parquet reads back
        ("t1", 2, {"gate.0.0": 0.0, "gate.0.1": 0.0, "gate.1.0": 0.0, "gate.1.1": 0.0}),
        ("t1", 2, {"gate.0.0": 0.5, "gate.0.1": 0.3, "gate.1.0": 0.2, "gate.1.1": 0.2}),
        ("t2", 1, None),
        ("t2", 2, None),
    ]
    return pd.DataFrame(rows, columns=["trial_id", "epoch", "mechanisms"])


def test_the_curves_average_each_block_over_its_heads_then_over_the_trials():
    # block 0: epoch 1 t0 0.7, t1 0.6 -> 0.65; epoch 2 t0 0.5, t1 0.4 -> 0.45
    # block 1: epoch 1 t0 0.6, t1 0.5 -> 0.55; epoch 2 t0 0.2, t1 0.2 -> 0.2
    curves = mechanism_curves(_epochs())
    assert list(curves) == ["gate"] and list(curves["gate"]) == ["block 0", "block 1"]
    assert curves["gate"]["block 0"] == [(1, pytest.approx(0.65)), (2, pytest.approx(0.45))]
    assert curves["gate"]["block 1"] == [(1, pytest.approx(0.55)), (2, pytest.approx(0.2))]
    # each arm apart where the trials are labelled: t0 alone and t1 alone
    arms = mechanism_curves(_epochs(), {"t0": "a", "t1": "b", "t2": "c"})
    assert list(arms["gate"]) == ["a, block 0", "a, block 1", "b, block 0", "b, block 1"]
    assert arms["gate"]["a, block 0"] == [(1, pytest.approx(0.7)), (2, pytest.approx(0.5))]
    assert arms["gate"]["b, block 1"] == [(1, pytest.approx(0.5)), (2, pytest.approx(0.2))]
    assert mechanism_curves(_epochs()[_epochs()["trial_id"] == "t2"]) == {}  # none reported: no curves


def test_the_section_draws_a_line_per_block_at_its_values():
    text = mechanisms_section(_epochs())
    assert text.startswith('<section class="report card" id="mechanisms">') and "gates sigma(lambda): the share" in text
    lines = re.findall(r'<polyline [^>]*points="([^"]+)"', text)
    assert len(lines) == 2 and "block 0" in text and "block 1" in text
    # a gate's axis is 0 to 1: 0.65 and 0.45 sit 35% and 55% down the plot (its top 12, height 194)
    (x1, y1), (x2, y2) = [tuple(map(float, p.split(","))) for p in lines[0].split()]
    assert (y1, y2) == (pytest.approx(12 + 0.35 * 194, abs=0.05), pytest.approx(12 + 0.55 * 194, abs=0.05)) and x1 < x2
    assert mechanisms_section(_epochs()[_epochs()["trial_id"] == "t2"]) == ""


def test_a_grid_studys_report_holds_the_figure(tmp_path):
    from search.views.report import write_report
    from tests.search.results.test_claims import _study

    names = ["gate.0.0", "gate.0.1", "gate.1.0", "gate.1.1"]
    reported = {(1, s): (dict.fromkeys(names, 0.73), dict.fromkeys(names, 0.4)) for s in range(2)}
    study = _study(tmp_path, "gates", model="ls_convit_nano", values=[0, 1],
                   accs={(v, s): 0.5 + 0.1 * v for v in (0, 1) for s in range(2)}, mechanisms=reported)
    page = write_report(study).html.read_text()
    assert 'id="mechanisms"' in page and len(re.findall("<polyline ", page)) == 2

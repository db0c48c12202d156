"""Knob effects of a grid study (search.results.effects): the paired t test against numbers worked out
by hand, the baseline, the rows left out, and the CLI and report on a grid study's folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from search.results.effects import EFFECT_COLUMNS, TEST, knob_effects, parse_baselines
from search.views.output import effects_view as format_effects
from search.results.store import ResultsStore
from search.spec import load_spec, to_plain
from search.views.cli import main
from trainers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
KNOBS = {"arch": ["A", "B"], "null": [0, 1]}
OBJECTIVES = [("val_acc", "max")]
BASE = [0.60, 0.70, 0.65]  # each seed's own level: the spread pairing takes out
# on B only, by (seed, null): B = A + 0.05 + this, exactly
NOISE_B = {(0, 0): 0.002, (0, 1): -0.001, (1, 0): 0.000, (1, 1): 0.003, (2, 0): -0.002, (2, 1): 0.001}
T_975_5 = 2.5705818366147395  # t(0.975, 5): 6 pairs, 5 degrees of freedom (any t table)
T_975_6 = 2.4469118511449692  # t(0.975, 6): the 2 x 2 grid's residual over 3 seeds, (4 - 1)(3 - 1) df
# that residual: NOISE_B double-centred, its squares summing to 14e-6 (worked out in
# test_the_grids_pooled_residual_variance_against_the_numbers_worked_out_by_hand); a difference of
# two knob values averages 3 seeds x 2 settings of the other knob: se = sqrt(2 (14e-6 / 6) / 6)
POOLED_SE = math.sqrt(2 * (14e-6 / 6) / 6)


def _trials() -> pd.DataFrame:
    rows = []
    for seed, level in enumerate(BASE):
        for arch in KNOBS["arch"]:
            for null in KNOBS["null"]:
                acc = level + (0.05 + NOISE_B[seed, null] if arch == "B" else 0.0)
                rows.append({"trial_id": f"t{seed}{arch}{null}", "state": "COMPLETE", "seed": seed, "arch": arch,
                             "null": null, "val_acc": acc, "replicate_of": None})
    return pd.DataFrame(rows)


def _row(table: pd.DataFrame, knob: str, value) -> pd.Series:
    rows = table[(table["knob"] == knob) & (table["value"] == value)]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def test_a_known_effect_and_a_null_knob_against_the_numbers_worked_out_by_hand():
    table = knob_effects(_trials(), objectives=OBJECTIVES, knobs=KNOBS, baselines={})
    assert list(table.columns) == list(EFFECT_COLUMNS) and len(table) == 4

    # arch: B - A over the 6 pairs (seed, null) = 0.05 + NOISE_B: 0.052 0.049 0.050 0.053 0.048 0.051,
    # mean 0.0505; every point of the grid has every seed, so its error is the grid's pooled residual
    b = _row(table, "arch", "B")
    half = T_975_6 * POOLED_SE
    assert (b["baseline"], b["n"], b["seeds"], b["pairs"]) == ("A", 6, 3, 6)
    assert b["diff"] == pytest.approx(0.0505, abs=1e-12)
    assert (b["diff_low"], b["diff_high"]) == pytest.approx((0.0505 - half, 0.0505 + half), abs=1e-9)
    assert b["diff_low"] == pytest.approx(0.048342, abs=1e-6) and b["diff_high"] == pytest.approx(0.052658, abs=1e-6)
    assert b["p_value"] < 1e-6 and b["verdict"] == "better"  # t = 0.0505 / 0.000882 = 57.3
    # its marginal mean: the B trials' levels 0.65 + 0.05 + mean(NOISE_B) = 0.7005
    assert b["mean"] == pytest.approx(0.7005, abs=1e-12)
    # A's: 0.60 0.60 0.70 0.70 0.65 0.65 -> mean 0.65, sd sqrt(0.01 / 5), t interval
    a = _row(table, "arch", "A")
    a_half = T_975_5 * math.sqrt(0.01 / 5) / math.sqrt(6)
    assert a["verdict"] == "baseline" and a["mean"] == pytest.approx(0.65)
    assert (a["low"], a["high"]) == pytest.approx((0.65 - a_half, 0.65 + a_half), abs=1e-9)
    assert math.isnan(a["diff"]) and math.isnan(a["p_value"])

    # null: 1 - 0 over the 6 pairs (seed, arch): 0 0 0 on A; -0.003 +0.003 +0.003 on B. Mean 0.0005,
    # with the same pooled error
    one = _row(table, "null", 1)
    half = T_975_6 * POOLED_SE
    assert one["diff"] == pytest.approx(0.0005, abs=1e-12)
    assert (one["diff_low"], one["diff_high"]) == pytest.approx((0.0005 - half, 0.0005 + half), abs=1e-9)
    assert one["diff_low"] < 0 < one["diff_high"] and one["verdict"] == "inconclusive"
    # t = 0.0005 / 0.000882 = 0.567 on 6 degrees of freedom: two-sided p = 0.591
    assert one["p_value"] == pytest.approx(0.591, abs=0.001)

    # with a cell missing the pairs stand alone: B - A over its 5 pairs (0.049 0.050 0.053 0.048 0.051;
    # mean 0.0502, squared deviations 1.44 0.04 7.84 4.84 0.64 x 1e-6 sum to 14.8e-6) on 4 df
    alone = _row(knob_effects(_trials()[_trials()["trial_id"] != "t0B0"], objectives=OBJECTIVES, knobs=KNOBS,
                              baselines={}), "arch", "B")
    half = 2.7764451051977987 * math.sqrt(14.8e-6 / 4) / math.sqrt(5)  # t(0.975, 4)
    assert (alone["diff_low"], alone["diff_high"]) == pytest.approx((0.0502 - half, 0.0502 + half), abs=1e-9)


def test_another_baseline_turns_the_difference_round():
    table = knob_effects(_trials(), objectives=OBJECTIVES, knobs=KNOBS, baselines={"arch": "B"})
    a = _row(table, "arch", "A")
    assert a["baseline"] == "B" and a["diff"] == pytest.approx(-0.0505) and a["verdict"] == "worse"
    assert _row(table, "arch", "B")["verdict"] == "baseline"
    # a minimised objective: lower is better
    table = knob_effects(_trials().rename(columns={"val_acc": "val_loss"}), objectives=[("val_loss", "min")],
                         knobs=KNOBS, baselines={})
    assert _row(table, "arch", "B")["verdict"] == "worse"


def test_only_complete_search_trials_count_and_unmatched_trials_pair_with_nothing():
    trials = _trials()
    trials.loc[trials["trial_id"] == "t0B0", "state"] = "PRUNED"  # its pair (seed 0, null 0) is gone
    extra = {"trial_id": "r1", "state": "COMPLETE", "seed": 7, "arch": "B", "null": 0, "val_acc": 0.1,
             "replicate_of": "t1B0"}  # a replicate: not a grid trial
    off_grid = {"trial_id": "x", "state": "COMPLETE", "seed": 0, "arch": "C", "null": 0, "val_acc": 0.1,
                "replicate_of": None}
    table = knob_effects(pd.concat([trials, pd.DataFrame([extra, off_grid])]), objectives=OBJECTIVES, knobs=KNOBS,
                         baselines={})
    b = _row(table, "arch", "B")
    assert (b["n"], b["pairs"]) == (5, 5)
    assert b["diff"] == pytest.approx(0.05 + (-0.001 + 0.000 + 0.003 - 0.002 + 0.001) / 5)
    assert _row(table, "arch", "A")["n"] == 6


def test_too_few_pairs_and_no_spread_have_no_test():
    trials = _trials()
    one_seed = trials[trials["seed"] == 0]
    table = knob_effects(one_seed[one_seed["null"] == 0], objectives=OBJECTIVES, knobs=KNOBS, baselines={})
    b = _row(table, "arch", "B")
    assert b["pairs"] == 1 and b["verdict"] == "too few pairs" and math.isnan(b["p_value"])
    # a device measurement: one per architecture, the same at every seed
    trials["throughput"] = trials["arch"].map({"A": 1000.0, "B": 800.0})
    table = knob_effects(trials, objectives=[("throughput", "max")], knobs=KNOBS, baselines={})
    b, one = _row(table, "arch", "B"), _row(table, "null", 1)
    assert (b["diff"], b["verdict"]) == (-200.0, "inconclusive (no spread)") and math.isnan(b["diff_low"])
    assert (one["diff"], one["verdict"]) == (0.0, "inconclusive (no spread)")


def test_baselines_are_parsed_and_checked_in_one_line():
    knobs = {"arch": ("A", "B"), "depth": (2, 4), "lr": (0.001, 0.01), "flag": (True, False)}
    assert parse_baselines(["depth=4", "lr=1e-2", "arch=B", "flag=False"], knobs) == {
        "depth": 4, "lr": 0.01, "arch": "B", "flag": False}
    for text, message in [("depth", "expected KNOB=VALUE"), ("width=2", "'width' is not a knob of the study"),
                          ("depth=3", "'3' is not one of depth's values (2, 4)")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            parse_baselines([text], knobs)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="not one of its values"):
        knob_effects(_trials(), objectives=OBJECTIVES, knobs=KNOBS, baselines={"arch": "C"})


def test_the_table_names_the_test_and_json_carries_every_column():
    table = knob_effects(_trials(), objectives=OBJECTIVES, knobs=KNOBS, baselines={})
    text = format_effects(table, fmt="table")
    assert TEST in text and "paired t test (Student 1908;" in text and "pooled residual variance" in text
    assert "arch on val_acc (max), baseline arch=A:" in text and "inconclusive" in text and "better" in text
    records = json.loads(format_effects(table, fmt="json"))
    assert len(records) == 4 and set(records[0]) == set(EFFECT_COLUMNS)
    assert format_effects(table, fmt="csv").splitlines()[0] == ",".join(EFFECT_COLUMNS)


def _grid_study(tmp_path: Path, *, algorithm: dict) -> Path:
    """A grid study's folder as `search run` leaves it (experiment.json, trials.parquet), without a run."""
    raw = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    raw["space"] = {"local_up_to_layer": {"type": "choice", "values": [0, 1]}, "depth": {"type": "choice", "values": [2, 3]}}
    raw["algorithm"] = algorithm
    raw["budget"]["trials"] = 8
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(raw))
    spec = load_spec(tmp_path / "grid.yaml", check_model=False)
    study = tmp_path / "study"
    study.mkdir()
    (study / "experiment.json").write_text(json.dumps({
        "name": spec.name, "spec": to_plain(spec), "spec_hash": spec.spec_hash,
        "objectives": [[o.metric, o.mode] for o in spec.objectives], "reference_point": spec.reference_point}))
    store = ResultsStore(study, space={k: p.to_json() for k, p in spec.all_params().items()},
                         objectives=[(o.metric, o.mode) for o in spec.objectives], reference=spec.reference_point)
    for seed, level in enumerate([0.5, 0.6]):
        for layer in (0, 1):
            for depth in (2, 3):
                acc = level + 0.1 * layer + (0.001 if depth == 3 else 0.0) * (1 if seed else -1)
                config = {"local_up_to_layer": layer, "depth": depth}
                store.add_trial({"trial_id": f"t{seed}{layer}{depth}", "state": "COMPLETE", "seed": seed, "val_acc": acc,
                                 "throughput": 1000.0 - 100 * depth, "family": "convit", "model": "ls_convit_nano",
                                 "stop_reason": "max_epochs", "epochs_run": 1}, config)
    store.flush()
    return study


def test_the_cli_and_the_report_on_a_grid_study(tmp_path, capsys):
    study = _grid_study(tmp_path, algorithm={"name": "grid", "seeds": 2})
    assert main(["effects", str(study)]) == 0
    out = capsys.readouterr().out
    assert TEST in out and "local_up_to_layer on val_acc (max), baseline local_up_to_layer=0:" in out
    assert "depth on throughput (max), baseline depth=2:" in out

    assert main(["effects", str(study), "--objective", "val_acc", "--baseline", "depth=3", "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert {r["objective"] for r in records} == {"val_acc"} and {r["baseline"] for r in records} == {0, 3}
    layer = next(r for r in records if r["knob"] == "local_up_to_layer" and r["value"] == 1)
    assert layer["pairs"] == 4 and layer["diff"] == pytest.approx(0.1) and layer["verdict"] in ("better", "inconclusive (no spread)")

    for argv, message in [(["--baseline", "depth=9"], "'9' is not one of depth's values"),
                          (["--objective", "flops"], "--objective flops: not an objective of this study")]:
        assert main(["effects", str(study), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err

    # a grid keeps no Optuna journal: importance says so in one line
    assert main(["importance", str(study)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a grid study has no Optuna journal" in err and "effects" in err

    assert main(["report", str(study)]) == 0
    page = (study / "report.html").read_text()
    assert "Knob effects (grid)" in page and TEST in page and 'id="importance"' not in page


def test_effects_of_a_study_that_is_not_a_grid_is_a_one_line_error(tmp_path, capsys):
    study = _grid_study(tmp_path, algorithm={"name": "random", "seed": 0})
    assert main(["effects", str(study)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a grid study (algorithm: random)" in err


def test_the_grids_pooled_residual_variance_against_the_numbers_worked_out_by_hand():
    from search.results.effects import blocked_difference

    # the 2 x 2 grid of _trials over 3 seeds: the seeds' levels and arch's 0.05 are the model's, what
    # is left is NOISE_B double-centred (points x seeds; x 1e-3): A0 and A1 0 -0.5 +0.5, B0 +2 -0.5
    # -1.5, B1 -2 +1.5 +0.5 (row means 0 0 0 1, column means 0.25 0.75 -0.25, grand 0.25). Squares sum
    # to 14e-6 on (4 - 1)(3 - 1) = 6 df; B - A averages 3 seeds x 2 settings of null: var 2 s^2 / 6
    diff, se, df = blocked_difference(_trials(), objective="val_acc", knobs=KNOBS, knob="arch", value="B",
                                      baseline="A")
    assert diff == pytest.approx(0.0505, abs=1e-12) and df == 6
    assert se == pytest.approx(math.sqrt(2 * (14e-6 / 6) / 6), rel=1e-9)
    # null 1 - 0 has the same error (the same cells, the same split of them)
    assert blocked_difference(_trials(), objective="val_acc", knobs=KNOBS, knob="null", value=1,
                              baseline=0)[1:] == (pytest.approx(se, rel=1e-9), 6)
    # a point without one of the seeds, or two points only: no pooled variance (the pairs stand alone)
    trials = _trials()
    assert blocked_difference(trials[trials["trial_id"] != "t0B0"], objective="val_acc", knobs=KNOBS, knob="arch",
                              value="B", baseline="A") is None
    assert blocked_difference(trials[trials["null"] == 0], objective="val_acc", knobs={"arch": ["A", "B"], "null": [0]},
                              knob="arch", value="B", baseline="A") is None


def test_a_rounding_level_spread_is_no_spread_in_the_effects_and_the_claims_alike():
    from search.results.claims import paired

    # B - A is 0.1 at every seed, up to the rounding of the floats (0.3 - 0.2 is 0.09999999999999998)
    trials = pd.DataFrame([{"trial_id": f"{a}{s}", "state": "COMPLETE", "seed": s, "arch": arch, "val_acc": a,
                            "replicate_of": None}
                           for s, (lo, hi) in enumerate(((0.2, 0.3), (0.6, 0.7), (0.3, 0.4)))
                           for arch, a in (("A", lo), ("B", hi))])
    diffs = [0.3 - 0.2, 0.7 - 0.6, 0.4 - 0.3]
    assert len(set(diffs)) > 1  # not exactly equal: rounding's spread, not a measured one
    row = _row(knob_effects(trials, objectives=OBJECTIVES, knobs={"arch": ["A", "B"]}, baselines={}), "arch", "B")
    assert row["verdict"] == "inconclusive (no spread)" and math.isnan(row["p_value"])
    assert not paired(diffs).testable and paired(diffs).diff == pytest.approx(0.1)

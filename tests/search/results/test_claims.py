"""The claims suite (search.results.claims, search.study.suite, `python -m search claims`): the
tests against numbers worked out by hand, the verdict rules, each kind of claim on study folders
with known effects, and the CLI's page and one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from search.results.claims import (Estimate, evaluate_claim, evaluate_claims, family_adjusted, holm, load_claims, paired,
                                   verdict, welch)
from search.results.query import load
from search.results.store import ResultsStore
from search.spec import load_spec, to_plain
from search.study.suite import SuiteFailed, run_suite, study_state, suite_studies
from search.views.cli import main
from trainers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_paired_and_welch_against_the_formulas_worked_out_by_hand():
    from scipy import stats

    # paired differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, t(0.975, 2) = 4.302652729911275 (any t table)
    e = paired([0.1, 0.2, 0.3])
    (low, high), p = e.interval(), e.p_two_sided()
    assert (e.diff, e.se, e.df) == (pytest.approx(0.2), pytest.approx(0.1 / math.sqrt(3)), 2)
    assert high - e.diff == pytest.approx(4.302652729911275 * 0.1 / math.sqrt(3))
    assert low == pytest.approx(0.2 - 4.302652729911275 * 0.1 / math.sqrt(3))
    assert p == pytest.approx(2 * stats.t.sf(0.2 / (0.1 / math.sqrt(3)), 2))
    # Welch: a (n 3, var 0.01), b (n 4, var 0.0666..): se^2 = 0.01/3 + 0.2/3/4 = 0.02, df = 4.0755
    a, b = [0.1, 0.2, 0.3], [0.5, 0.7, 0.9, 1.1]
    w = welch(a, b)
    df = 0.02 ** 2 / ((0.01 / 3) ** 2 / 2 + (0.2 / 3 / 4) ** 2 / 3)
    assert w.df == pytest.approx(4.0755, abs=1e-4) and w.df == pytest.approx(df)
    half = stats.t.ppf(0.975, df) * math.sqrt(0.02)
    assert w.diff == pytest.approx(-0.6) and w.interval() == (pytest.approx(-0.6 - half), pytest.approx(-0.6 + half))
    assert w.p_two_sided() == pytest.approx(2 * stats.t.sf(0.6 / math.sqrt(0.02), df))
    # too few to test, or no spread: a difference, no interval (claims and effects alike)
    assert not paired([0.3]).testable and not welch([0.1], [0.2, 0.3]).testable and math.isnan(paired([]).diff)
    assert not paired([0.1, 0.1, 0.1]).testable and math.isnan(paired([0.1, 0.1]).interval()[0])


def test_a_claim_on_a_grid_of_three_points_uses_its_pooled_residual_variance(tmp_path):
    """K 0 (baseline), 1, 2 over seeds 0-2 (x 0.01): 50 60 55 / 62 70 66 / 58 61 60. Rows 55, 66, 59.67;
    columns 56.67, 63.67, 60.33; grand 60.22. The residuals (x 0.01 / 9) -13 14 -1 / -4 5 -1 / 17 -19 2
    square to 118 / 9 (x 1e-4) on (3 - 1)(3 - 1) = 4 df: s^2 = 118 / 36 x 1e-4. K 1 - K 0 = 0.11 with
    se sqrt(2 s^2 / 3), where its 3 pairs alone (0.12 0.10 0.11) would give sd 0.01 on 2 df."""
    from scipy import stats

    table = {0: (0.50, 0.60, 0.55), 1: (0.62, 0.70, 0.66), 2: (0.58, 0.61, 0.60)}
    _study(tmp_path, "three", model="ls_convit_nano", values=[0, 1, 2],
           accs={(k, s): acc for k, accs in table.items() for s, acc in enumerate(accs)})
    claim = _claim("three", test={"kind": "effect", "study": "three", "knob": "local_up_to_layer", "value": 1,
                                  "baseline": 0})
    r = evaluate_claim(claim, {"three": load(tmp_path / "results" / "three")})
    se = math.sqrt(2 * (118 / 36 * 1e-4) / 3)
    assert r.diff == pytest.approx(0.11) and r.estimate.df == 4 and r.estimate.se == pytest.approx(se, rel=1e-9)
    assert r.p_value == pytest.approx(2 * stats.t.sf(0.11 / se, 4)) and r.n == "3 pairs"
    assert r.test == "paired t (Student 1908), the grid's pooled residual variance"
    # the same study less K 2: two points, the pairs' own test
    _study(tmp_path, "two", model="ls_convit_nano", values=[0, 1],
           accs={(k, s): acc for k, accs in table.items() if k < 2 for s, acc in enumerate(accs)})
    r = evaluate_claim(claim.model_copy(update={"test": claim.test.model_copy(update={"study": "two"})}),
                       {"two": load(tmp_path / "results" / "two")})
    assert (r.estimate.se, r.estimate.df) == (pytest.approx(0.01 / math.sqrt(3)), 2) and r.test == "paired t (Student 1908)"


def test_two_independent_estimates_combine_by_welch_satterthwaite():
    from search.results.claims import combined

    # se^2 0.01^2 + 0.02^2 = 0.0005; df 0.0005^2 / (0.0001^2 / 4 + 0.0004^2 / 2) = 2.5e-7 / 8.25e-8 = 3.0303
    e = combined(Estimate(0.11, 0.01, 4), Estimate(0.02, 0.02, 2))
    assert (e.diff, e.se, e.df) == (pytest.approx(0.09), pytest.approx(math.sqrt(0.0005)), pytest.approx(2.5 / 0.825))
    assert not combined(Estimate(0.11, 0.01, 4), Estimate(0.02, math.nan, math.nan)).testable
    # of two sets of pairs it is Welch's test of the sets
    a, b = [0.10, 0.12, 0.11], [0.02, 0.01, 0.04, 0.03]
    w, c = welch(a, b), combined(paired(a), paired(b))
    assert (c.diff, c.se, c.df) == (pytest.approx(w.diff), pytest.approx(w.se), pytest.approx(w.df))


def test_mechanism_claims_on_the_gates_against_the_numbers_worked_out_by_hand(tmp_path):
    """Gates gate.BLOCK.HEAD of 2 blocks x 2 heads, all 0.73 after epoch 1; after epoch 2 (block 0 |
    block 1): seed 0 0.70 0.60 | 0.30 0.20, seed 1 0.72 0.64 | 0.40 0.10, seed 2 0.69 0.61 | 0.20 0.30.
    Training: means 0.45 0.465 0.45 minus 0.73 = -0.28 -0.265 -0.28: mean -0.275, sd sqrt(150e-6 / 2),
    se 0.005 on 2 df. Depth: 0.25 - 0.65, 0.25 - 0.68, 0.25 - 0.65 = -0.40 -0.43 -0.40: mean -0.41,
    sd sqrt(6e-4 / 2), se 0.01."""
    from scipy import stats

    after = {0: (0.70, 0.60, 0.30, 0.20), 1: (0.72, 0.64, 0.40, 0.10), 2: (0.69, 0.61, 0.20, 0.30)}
    names = ["gate.0.0", "gate.0.1", "gate.1.0", "gate.1.1"]
    reported = {(1, s): (dict.fromkeys(names, 0.73), dict(zip(names, g))) for s, g in after.items()}
    _study(tmp_path, "gates", model="ls_convit_nano", values=[0, 1], accs={(v, s): 0.5 for v in (0, 1) for s in range(3)},
           mechanisms=reported)  # the DeiT (0) reports none, and is not at the point
    studies = {"gates": load(tmp_path / "results" / "gates")}
    test = {"kind": "mechanism", "study": "gates", "at": {"local_up_to_layer": 1}, "mechanism": "gate"}
    training = evaluate_claim(_claim("t", expect="lower", test={**test, "contrast": "training"}), studies)
    assert training.diff == pytest.approx(-0.275) and training.estimate.se == pytest.approx(0.005)
    assert training.estimate.df == 2 and training.n == "3 trials" and training.arms == "0.4550 vs 0.7300"
    assert training.p_value == pytest.approx(2 * stats.t.sf(0.275 / 0.005, 2)) and training.verdict == "reproduced"
    depth = evaluate_claim(_claim("d", expect="lower", test={**test, "contrast": "depth"}), studies)
    assert depth.diff == pytest.approx(-0.41) and depth.estimate.se == pytest.approx(0.01)
    assert depth.arms == "0.2500 vs 0.6600" and depth.verdict == "reproduced"
    # block 0 alone (blocks: [0]): 0.65 0.68 0.65 minus 0.73 = -0.08 -0.05 -0.08: mean -0.07, sd
    # sqrt(6e-4 / 2), se 0.01
    first = evaluate_claim(_claim("b", expect="lower", test={**test, "contrast": "training", "blocks": [0]}), studies)
    assert first.diff == pytest.approx(-0.07) and first.estimate.se == pytest.approx(0.01)
    assert first.arms == "0.6600 vs 0.7300"
    with pytest.raises(Exception, match="blocks"):
        _claim("x", expect="higher", test={"kind": "effect", "study": "gates", "knob": "local_up_to_layer", "value": 1,
                                           "baseline": 0, "blocks": [0]})
    from search.views.claims_page import claims_table

    rows = claims_table([training, depth])
    assert rows[0][3] == "mean gate after the last epoch minus after the first, per trial (gates at local_up_to_layer 1)"
    assert rows[1][3].startswith("mean gate of the deepest block minus the first") and rows[0][5].startswith("-0.275 (")
    # a study whose model reports no gates: no trials, no test
    assert evaluate_claim(_claim("n", expect="lower", test={**test, "at": {"local_up_to_layer": 0},
                                                              "contrast": "training"}), studies).n == "0 trials"
    with pytest.raises(ValueError, match="a mechanism test names mechanism"):  # pydantic's, one line in a file
        _claim("x", test={"kind": "mechanism", "study": "gates", "mechanism": "gate"})


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04 times 3, 2, 1 = 0.03, 0.06, 0.04; made non-decreasing: 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, math.nan, 0.2]) == [pytest.approx(0.5), pytest.approx(math.nan, nan_ok=True), pytest.approx(0.4)]
    # the report's two "reproduced" claims among 11: 0.037 * 11 = 0.407, 0.040 * 10 = 0.40: both fail at 0.05
    eleven = holm([0.037, 0.040] + [0.5] * 9)
    assert eleven[:2] == pytest.approx([0.407, 0.407]) and min(eleven) > 0.05


def test_claims_on_the_same_trials_are_one_member_of_the_family():
    claims = [_claim("a", family="pairs"), _claim("b", family="pairs"), _claim("c")]
    # within "pairs": Bonferroni (x2): 0.02, 0.06; members' smallest 0.02 and c's 0.03: Holm 0.04, 0.04
    assert family_adjusted(claims, [0.01, 0.03, 0.03]) == pytest.approx([0.04, 0.06, 0.04])


def _claim(cid: str, **extra) -> "Claim":
    from search.results.claims import Claim

    return Claim.model_validate({"id": cid, "paper": "P", "claim": "c", "paper_result": "r", "expect": "higher",
                                 "test": {"kind": "effect", "study": "s", "knob": "k", "value": 1, "baseline": 0},
                                 **extra})


def test_tost_and_the_smallest_detectable_effect_by_hand():
    e = Estimate(diff=0.002, se=0.004, df=10)
    # TOST at +-0.02: t = (0.002 + 0.02) / 0.004 = 5.5 and (0.002 - 0.02) / 0.004 = -4.5 on 10 df:
    # p = max(P(T > 5.5), P(T < -4.5)) = max(0.000131, 0.000572) = 0.000572
    assert e.p_equivalent(0.02) == pytest.approx(0.0005715525, rel=1e-6)
    # 80% power, two-sided 0.05, se 0.01 on 4 df: (t(0.975, 4) 2.776445 + t(0.8, 4) 0.940965) * 0.01
    assert Estimate(0.0, 0.01, 4).detectable(0.05) == pytest.approx(0.0371741, abs=1e-7)


def test_seeds_for_the_sesoi_from_a_pilot_by_hand():
    """A pilot of 3 seeds: se 0.02 on 2 df. At n seeds se 0.02 sqrt(3 / n) on n - 1 df; detectable
    (t(0.975, n-1) + t(0.8, n-1)) se: n = 7: (2.446912 + 0.905697) 0.013093 = 0.043895; n = 8:
    (2.364624 + 0.896030) 0.012247 = 0.039934. For an effect of 0.04: 8 seeds."""
    pilot = Estimate(diff=0.05, se=0.02, df=2)
    assert pilot.seeds_for(0.04, seeds=3, alpha=0.05) == 8
    assert pilot.seeds_for(0.044, seeds=3, alpha=0.05) == 7
    assert pilot.seeds_for(0.5, seeds=3, alpha=0.05) == 2
    assert pilot.seeds_for(0.0001, seeds=3, alpha=0.05) is None  # more than 100
    assert Estimate(0.05, math.nan, math.nan).seeds_for(0.04, seeds=3, alpha=0.05) is None  # no spread measured


@pytest.mark.parametrize("expect,diff,p_adj,p_con,p_eq,said", [
    ("higher", 0.05, 0.01, math.nan, math.nan, "reproduced"),
    ("higher", -0.05, 0.01, math.nan, math.nan, "contradicted"),
    ("lower", -0.05, 0.01, math.nan, math.nan, "reproduced"),
    ("lower", 0.05, 0.01, math.nan, math.nan, "contradicted"),
    ("higher", 0.002, 0.6, math.nan, 0.001, "smaller than the paper's"),
    ("higher", 0.002, 0.6, math.nan, 0.2, "inconclusive"),
    ("higher", 0.002, 0.6, math.nan, math.nan, "inconclusive"),  # no sesoi: no equivalence test
    ("no_gain", 0.02, 0.01, 0.99, math.nan, "reproduced"),
    ("no_gain", 0.08, 0.99, 0.01, math.nan, "contradicted"),
    ("no_gain", 0.04, 0.3, 0.7, math.nan, "inconclusive"),
])
def test_the_verdict_rules(expect, diff, p_adj, p_con, p_eq, said):
    assert verdict(expect, Estimate(diff, 0.01, 5), p_adjusted=p_adj, p_contrary=p_con, p_equivalence=p_eq,
                   alpha=0.05) == said
    assert verdict(expect, Estimate(diff, math.nan, math.nan), p_adjusted=p_adj, p_contrary=p_con,
                   p_equivalence=p_eq, alpha=0.05) == "inconclusive"  # no test


def test_a_saturation_is_tested_against_its_margin_not_zero():
    """The old rule called a gain 'not reproduced' once its interval cleared 0; it must clear the margin."""
    # diff 0.02, se 0.004 on 2 df, margin 0.05: t = (0.02 - 0.05) / 0.004 = -7.5, P(T < -7.5) = 0.008659
    e = Estimate(0.02, 0.004, 2)
    assert e.p_below(0.05) == pytest.approx(0.0086587, rel=1e-4)
    assert e.interval()[0] > 0  # above 0, yet below the margin: reproduced, not contradicted
    assert verdict("no_gain", e, p_adjusted=e.p_below(0.05), p_contrary=e.p_above(0.05), p_equivalence=math.nan,
                   alpha=0.05) == "reproduced"
    above = Estimate(0.08, 0.004, 2)  # t = (0.08 - 0.05) / 0.004 = 7.5: P(T > 7.5) = 0.008659
    assert above.p_above(0.05) == pytest.approx(0.0086587, rel=1e-4)


def test_a_robustness_claim_reads_the_loss_under_corruption_by_hand(tmp_path):
    """Two arms (0 the CNN, 1 the T-CNN), 3 seeds. Clean test_acc and, at severity 3, the three
    corruptions' accuracies (their mean):
      seed 0: CNN 0.80 | 0.50 0.60 0.70 (0.60): loses 0.20; T-CNN 0.82 | 0.62 0.72 0.82 (0.72): loses 0.10
      seed 1: CNN 0.78 | 0.48 0.58 0.68 (0.58): 0.20;       T-CNN 0.80 | 0.65 0.65 0.65 (0.65): 0.15
      seed 2: CNN 0.79 | 0.40 0.50 0.60 (0.50): 0.29;       T-CNN 0.81 | 0.55 0.65 0.75 (0.65): 0.16
    T-CNN minus CNN of the change under corruption: +0.10, +0.05, +0.13: mean 0.09333, sd
    sqrt(((0.00667)^2 + (0.04333)^2 + (0.03667)^2) / 2) = 0.04041, se 0.02333 on 2 df. Severity 1
    is not read (set to 0 here: were it read, the answer would change)."""
    corrupted = {(0, 0): (0.80, 0.50, 0.60, 0.70), (1, 0): (0.82, 0.62, 0.72, 0.82),
                 (0, 1): (0.78, 0.48, 0.58, 0.68), (1, 1): (0.80, 0.65, 0.65, 0.65),
                 (0, 2): (0.79, 0.40, 0.50, 0.60), (1, 2): (0.81, 0.55, 0.65, 0.75)}
    tests = {key: {"test_acc": clean, "test_corrupted": {"gaussian_noise.3": a, "gaussian_blur.3": b, "contrast.3": c,
                                                          "gaussian_noise.1": 0.0}}
             for key, (clean, a, b, c) in corrupted.items()}
    _study(tmp_path, "tcnn", model="ls_convit_nano", values=[0, 1], accs={k: 0.5 for k in corrupted}, tests=tests)
    studies = {"tcnn": load(tmp_path / "results" / "tcnn")}
    claim = _claim("r", expect="higher", test={"kind": "effect", "study": "tcnn", "knob": "local_up_to_layer",
                                                "value": 1, "baseline": 0, "severity": 3})
    result = evaluate_claim(claim, studies)
    assert result.diff == pytest.approx(0.0933333) and result.estimate.se == pytest.approx(0.0233333, rel=1e-4)
    assert result.estimate.df == 2 and result.n == "3 pairs"
    with pytest.raises(Exception, match="severity"):
        _claim("x", expect="higher", test={"kind": "mechanism", "study": "tcnn", "mechanism": "gate",
                                           "contrast": "training", "severity": 3})


def _study(root: Path, name: str, *, model: str, values: list, accs: dict, epoch1: dict | None = None,
           mechanisms: dict | None = None, tests: dict | None = None, fraction: float | None = None) -> Path:
    """A grid study's folder as `search run` leaves it: one knob (local_up_to_layer) with ``values``,
    ``accs[(value, seed)]`` its final val_acc, ``epoch1[(value, seed)]`` its val_acc after epoch 1,
    ``mechanisms[(value, seed)]`` what the model reported after epochs 1 and 2, ``tests[(value, seed)]``
    its held-out score (store.add_test's)."""
    raw = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    raw.update(name=name, space={"local_up_to_layer": {"type": "choice", "values": values}},
               algorithm={"name": "grid", "seeds": len({s for _, s in accs})})
    raw["model"] = {"name": model}
    if fraction is not None:
        raw["dataset"]["train_fraction"] = fraction
    raw["budget"].pop("trials", None)
    raw.pop("profiles", None), raw.pop("default_profile", None)
    spec_file = root / "specs" / f"{name}.yaml"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(yaml.safe_dump(raw))
    spec = load_spec(spec_file, check_model=False)
    study = root / "results" / name
    study.mkdir(parents=True)
    (study / "experiment.json").write_text(json.dumps({
        "name": spec.name, "spec": to_plain(spec), "spec_hash": spec.spec_hash,
        "objectives": [[o.metric, o.mode] for o in spec.objectives], "reference_point": spec.reference_point}))
    store = ResultsStore(study, space={k: p.to_json() for k, p in spec.all_params().items()},
                         objectives=[(o.metric, o.mode) for o in spec.objectives], reference=spec.reference_point)
    for (value, seed), acc in accs.items():
        tid = f"{name[:3]}{value}{seed}"
        store.add_trial({"trial_id": tid, "state": "COMPLETE", "seed": seed, "val_acc": acc, "throughput": 1000.0,
                         "family": "convit", "model": model, "stop_reason": "max_epochs", "epochs_run": 2,
                         "started_at": None, "ended_at": None}, {"local_up_to_layer": value})
        reported = (mechanisms or {}).get((value, seed), (None, None))
        for epoch, at in ((1, (epoch1 or {}).get((value, seed), acc - 0.1)), (2, acc)):
            store.add_epoch({"trial_id": tid, "epoch": epoch, "val_acc": at, "train_loss": 1 - at,
                             "mechanisms": reported[epoch - 1]})
        if tests and (value, seed) in tests:
            store.add_test(tid, {"test_images": 10_000, "test_epoch": 2, "test_loss": 0.5, **tests[(value, seed)]})
    store.flush()
    return study


GAPS_SMALL = {0: 0.10, 1: 0.12, 2: 0.11}  # seed -> ConViT minus DeiT, little data
GAPS_LARGE = {0: 0.02, 1: 0.01, 2: 0.03}


def _suite(tmp_path: Path) -> Path:
    """Claims over three studies with known effects: a gap of 0.11 on little data, 0.02 on more,
    and a control study of another model; the claims file next to their specs."""
    base = {0: 0.50, 1: 0.60, 2: 0.55}
    _study(tmp_path, "small", model="ls_convit_nano", values=[0, 1],
           accs={**{(0, s): b for s, b in base.items()}, **{(1, s): b + GAPS_SMALL[s] for s, b in base.items()}},
           epoch1={(1, s): 0.3 for s in base} | {(0, s): 0.4 for s in base})
    _study(tmp_path, "large", model="ls_convit_nano", values=[0, 1],
           accs={**{(0, s): b + 0.2 for s, b in base.items()}, **{(1, s): b + 0.2 + GAPS_LARGE[s] for s, b in base.items()}})
    _study(tmp_path, "control", model="ls_convit_nano", values=[0], accs={(0, s): 0.40 + 0.01 * s for s in base})
    claims = {"claims": [
        {"id": "small", "paper": "P, Table 2", "claim": "B beats A at small data", "paper_result": "59.6 vs 48.0",
         "expect": "higher", "test": {"kind": "effect", "study": "small", "knob": "local_up_to_layer", "value": 1,
                                      "baseline": 0}},
        {"id": "shrinks", "paper": "P", "claim": "the gap shrinks", "paper_result": "+11.6 to +1.5", "expect": "higher",
         "test": {"kind": "shrinks", "study": "small", "then": "large", "knob": "local_up_to_layer", "value": 1,
                  "baseline": 0}},
        {"id": "versus", "paper": "P", "claim": "B beats the control", "paper_result": "95.06 vs 93.65",
         "expect": "higher", "test": {"kind": "versus", "study": "small", "at": {"local_up_to_layer": 1},
                                      "control": "control"}},
        {"id": "early", "paper": "P", "claim": "B learns faster", "paper_result": "261 vs 300 epochs",
         "expect": "higher", "test": {"kind": "effect", "study": "small", "knob": "local_up_to_layer", "value": 1,
                                      "baseline": 0, "epoch": 1}},
        {"id": "saturates", "paper": "P", "claim": "more data adds little to the gap", "paper_result": "-",
         "expect": "no_gain", "margin": 0.05, "test": {"kind": "effect", "study": "large", "knob": "local_up_to_layer",
                                                        "value": 1, "baseline": 0}},
    ]}
    path = tmp_path / "specs" / "claims.yaml"
    path.write_text(yaml.safe_dump(claims, sort_keys=False))
    return path


def test_each_kind_of_claim_on_studies_with_known_effects(tmp_path):
    from scipy import stats

    claims = load_claims(_suite(tmp_path))
    studies = {n: load(tmp_path / "results" / n) for n in ("small", "large", "control")}
    results = {c.id: evaluate_claim(c, studies) for c in claims.claims}

    small = results["small"]  # the seeds' levels (0.50/0.60/0.55) cancel in the pairs
    assert small.diff == pytest.approx(0.11) and small.n == "3 pairs" and small.verdict == "reproduced"
    assert small.p_value == pytest.approx(stats.ttest_rel([0.60, 0.72, 0.66], [0.50, 0.60, 0.55]).pvalue)
    assert small.arms == "0.6600 vs 0.5500"

    shrinks = results["shrinks"]  # 0.11 minus 0.02, Welch over the two sets of pairs
    assert shrinks.diff == pytest.approx(0.09) and shrinks.n == "3 vs 3 pairs" and shrinks.verdict == "reproduced"
    assert shrinks.p_value == pytest.approx(stats.ttest_ind([0.10, 0.12, 0.11], [0.02, 0.01, 0.03], equal_var=False).pvalue)

    versus = results["versus"]  # 0.60/0.72/0.66 against the control's 0.40/0.41/0.42, unpaired
    assert versus.diff == pytest.approx(0.66 - 0.41) and versus.n == "3 vs 3 seeds" and versus.verdict == "reproduced"
    # paired by seed: 0.20 0.31 0.24, mean 0.25, squared deviations 0.0025 0.0036 0.0001: sd sqrt(0.0062 / 2)
    by_seed = evaluate_claim(claims.claims[2].model_copy(update={"test": claims.claims[2].test.model_copy(
        update={"paired": True})}), studies)
    assert by_seed.diff == pytest.approx(0.25) and by_seed.n == "3 pairs (by seed)" and by_seed.estimate.df == 2
    assert by_seed.estimate.se == pytest.approx(math.sqrt(0.0062 / 2) / math.sqrt(3))
    assert by_seed.p_value == pytest.approx(stats.ttest_rel([0.60, 0.72, 0.66], [0.40, 0.41, 0.42]).pvalue)

    early = results["early"]  # after epoch 1 B (0.3) is behind A (0.4) at every seed: no spread, not an interval
    assert early.diff == pytest.approx(-0.1) and math.isnan(early.low) and early.verdict == "inconclusive"

    saturates = results["saturates"]  # gap 0.02 +- 0.025: below the 0.05 margin as a whole
    assert saturates.diff == pytest.approx(0.02) and saturates.high < 0.05 and saturates.verdict == "reproduced"

    missing = evaluate_claim(claims.claims[1], {"small": studies["small"]})
    assert missing.verdict == "not run" and math.isnan(missing.diff)


def test_the_cli_writes_the_page_from_the_studies_there_are(tmp_path, capsys):
    path = _suite(tmp_path)
    page = tmp_path / "claims.md"
    assert main(["claims", str(path), "--storage", str(tmp_path / "results"), "--no-run", "--out", str(page)]) == 0
    out = capsys.readouterr().out
    assert "small: reproduced" in out and f"wrote {page}" in out
    text = page.read_text()
    assert text.startswith("# The papers' claims, reproduced on this platform")
    assert "**5 claims: 4 reproduced, 1 inconclusive.**" in text  # early: no spread, no interval
    assert "| small | B beats A at small data | 59.6 vs 48.0 [P, Table 2] |" in text
    assert "+11.00 pp (" in text and "paired t (Student 1908)" in text and "Welch t (Welch 1947)" in text
    assert "| control | ls_convit_nano |" in text  # the studies' table
    assert not list(tmp_path.glob(".claims.md.tmp"))

    # one claim only; a study not there is "not run", and nothing is run with --no-run
    (tmp_path / "results" / "large").rename(tmp_path / "elsewhere")
    assert main(["claims", str(path), "--storage", str(tmp_path / "results"), "--no-run", "--out", str(page),
                 "--only", "shrinks"]) == 0
    assert "shrinks: not run" in capsys.readouterr().out and "**1 claims: 1 not run.**" in page.read_text()


def test_the_page_reads_each_study_from_its_own_experiment_json_not_the_yaml_or_head(tmp_path, capsys):
    path = _suite(tmp_path)
    for name, commit, dirty in (("small", "abcdef0123456789", True), ("large", "1234567890abcdef", False)):
        meta_path = tmp_path / "results" / name / "experiment.json"
        meta = json.loads(meta_path.read_text())
        meta.update(git_commit=commit, git_dirty=dirty)
        meta_path.write_text(json.dumps(meta))
    # the small study's spec edited since it ran: the page says what ran, and that it is stale
    raw = yaml.safe_load((path.parent / "small.yaml").read_text())
    raw["dataset"]["train_fraction"], raw["budget"]["max_epochs"] = 0.5, 30
    (path.parent / "small.yaml").write_text(yaml.safe_dump(raw))
    page = tmp_path / "claims.md"
    assert main(["claims", str(path), "--storage", str(tmp_path / "results"), "--no-run", "--out", str(page)]) == 0
    capsys.readouterr()
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in page.read_text().splitlines()
            if line.startswith(("| small |", "| large |", "| control |"))}
    small, large, control = rows["small"], rows["large"], rows["control"]
    # study, model, data, epochs, grid, COMPLETE, epochs run, final train loss, wall, device, commit, spec
    assert small[2] == "100% of synthetic" and small[3] == "12"  # as it ran (the YAML says 50%, 30 now)
    assert small[10] == "abcdef0 +changes" and large[10] == "1234567" and control[10] == "-"
    assert small[11].startswith("**stale**: ran ") and "small.yaml is now" in small[11]
    assert large[11].rstrip(" |") == "as the spec"
    # every trial ran 2 epochs; its last train loss (1 - its accuracy here) 0.50 0.40 0.45 / 0.40 0.28 0.34
    assert small[6] == "2" and small[7] == "0.400 (0.280-0.500)"


def test_a_study_records_the_commit_and_whether_tracked_files_differed_from_it(tmp_path, monkeypatch):
    import types

    import search.study.experiment as experiment
    from search.results.location import StudyLocation

    spec = load_spec(ROOT / "spaces" / "synthetic_smoke.yaml", check_model=False)
    data = types.SimpleNamespace(content_hash="c" * 64, counts={"train": 1, "val": 1, "test": 1})
    for dirty in (True, False, None):  # None: not a git checkout
        monkeypatch.setattr(experiment, "tracked_files_modified", lambda dirty=dirty: dirty)
        (tmp_path / "s").mkdir(exist_ok=True)
        experiment.write_experiment(spec, StudyLocation(tmp_path / "s"), data, "f" * 40)
        meta = json.loads((tmp_path / "s" / "experiment.json").read_text())
        assert meta["git_commit"] == "f" * 40 and meta["git_dirty"] is dirty


@pytest.mark.parametrize("change,message", [
    (lambda c: c["claims"][0].update(expect="bigger"), "expect"),
    (lambda c: c["claims"][0]["test"].update(study="nowhere"), "study 'nowhere' has no spec"),
    (lambda c: c["claims"][0]["test"].pop("baseline"), "names knob, value and baseline"),
    (lambda c: c["claims"].append(dict(c["claims"][0])), "an id is listed twice"),
    (lambda c: c["claims"][0].update(colour="red"), "colour"),
    (lambda c: c["claims"][0]["test"].update(paired=True), "only a versus test pairs two studies by seed"),
])
def test_a_bad_claims_file_is_one_line_and_exit_2(tmp_path, capsys, change, message):
    path = _suite(tmp_path)
    claims = yaml.safe_load(path.read_text())
    change(claims)
    path.write_text(yaml.safe_dump(claims, sort_keys=False))
    with pytest.raises(ConfigError):
        load_claims(path)
    assert main(["claims", str(path), "--no-run", "--out", str(tmp_path / "c.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "c.md").exists()


def test_only_an_unknown_claim_is_one_line(tmp_path, capsys):
    assert main(["claims", str(_suite(tmp_path)), "--no-run", "--only", "nope"]) == 2
    assert "--only nope: no such claim; use one of small, shrinks" in capsys.readouterr().err


def test_the_suite_skips_a_finished_study_and_runs_or_resumes_the_others_as_commands(tmp_path, capfd):
    path = _suite(tmp_path)
    specs = [path.parent / f"{n}.yaml" for n in ("small", "large")]
    studies = suite_studies(specs, profile=None, storage=str(tmp_path / "results"))
    assert [study_state(s) for s in studies] == [("done", 6), ("done", 6)]
    assert run_suite(studies, profile=None) == {}  # both done: nothing run
    assert "claims: small: done (6 trials in" in capfd.readouterr().out

    # a study with no folder is run as `python -m search run SPEC --storage DIR`: for real, so its
    # failure (a dataset folder that does not exist, refused before Ray starts) stops the suite
    raw = yaml.safe_load(specs[0].read_text())
    raw.update(name="fresh", dataset={"name": "fashion_mnist", "data_dir": str(tmp_path / "no-such-data")})
    (path.parent / "fresh.yaml").write_text(yaml.safe_dump(raw))
    fresh = suite_studies([path.parent / "fresh.yaml"], profile=None, storage=str(tmp_path / "results"))
    assert study_state(fresh[0]) == ("missing", 0)
    with pytest.raises(SuiteFailed, match=r"study fresh: `python -m search run .*fresh.yaml --storage .*` exited 2"):
        run_suite(fresh, profile=None)
    assert "claims: fresh: running: -m search run" in capfd.readouterr().out

    # a study with fewer trials than planned is resumed (this one has no Tune state: resume refuses it)
    small = load_spec(specs[0], check_model=False)
    partial = tmp_path / "results" / "partial"
    (tmp_path / "results" / "small").rename(partial)
    raw = yaml.safe_load(specs[0].read_text())
    raw.update(name="partial", algorithm={"name": "grid", "seeds": 4})
    (path.parent / "partial.yaml").write_text(yaml.safe_dump(raw))
    meta = json.loads((partial / "experiment.json").read_text())  # its own record plans the 8 trials too,
    meta["spec"].update(name="partial", algorithm=raw["algorithm"])  # so resume has something to do
    meta["spec_hash"] = load_spec(path.parent / "partial.yaml", check_model=False).spec_hash  # and it is not stale
    (partial / "experiment.json").write_text(json.dumps(meta))
    unfinished = suite_studies([path.parent / "partial.yaml"], profile=None, storage=str(tmp_path / "results"))
    assert study_state(unfinished[0]) == ("unfinished", 6) and small.planned_trials == 6
    with pytest.raises(SuiteFailed, match=r"study partial: `python -m search resume .*partial` exited"):
        run_suite(unfinished, profile=None)
    assert "claims: partial: resuming (6 trials so far)" in capfd.readouterr().out


def test_a_study_whose_spec_changed_since_it_ran_is_stale_set_aside_and_run_again(tmp_path, capfd):
    path = _suite(tmp_path)
    spec_file = path.parent / "small.yaml"
    [study] = suite_studies([spec_file], profile=None, storage=str(tmp_path / "results"))
    assert study_state(study) == ("done", 6)
    ran_with = json.loads((tmp_path / "results" / "small" / "experiment.json").read_text())["spec_hash"]
    # the spec edited since (another dataset: another study), its data folder one that does not exist,
    # so the new run is refused before Ray starts and the suite stops there
    as_ran = spec_file.read_text()
    raw = yaml.safe_load(as_ran)
    raw["dataset"] = {"name": "fashion_mnist", "data_dir": str(tmp_path / "no-such-data")}
    spec_file.write_text(yaml.safe_dump(raw))
    [stale] = suite_studies([spec_file], profile=None, storage=str(tmp_path / "results"))
    assert stale.spec.spec_hash != ran_with and study_state(stale) == ("stale", 6)
    with pytest.raises(SuiteFailed, match=r"study small: `python -m search run .*small.yaml --storage .*` exited 2"):
        run_suite([stale], profile=None)
    out = capfd.readouterr().out
    kept = tmp_path / "results" / f"small.stale-{ran_with}"
    assert f"claims: small: stale (run with spec hash {ran_with}" in out and f"its 6 trials moved to {kept}" in out
    assert "claims: small: running: -m search run" in out
    assert len(load(kept).trials) == 6  # kept whole, never deleted
    assert study_state(stale) == ("missing", 0)  # the next run of the suite starts it anew
    # the spec as it was: done again, nothing run (a hash that matches is not stale)
    (tmp_path / "results" / "small").mkdir()
    for name in ("experiment.json", "trials.parquet", "epochs.parquet"):
        if (kept / name).exists():
            (tmp_path / "results" / "small" / name).write_bytes((kept / name).read_bytes())
    [same] = suite_studies([spec_file], profile=None, storage=str(tmp_path / "results"))
    assert study_state(same) == ("stale", 6)
    spec_file.write_text(as_ran)
    [back] = suite_studies([spec_file], profile=None, storage=str(tmp_path / "results"))
    assert back.spec.spec_hash == ran_with and study_state(back) == ("done", 6) and run_suite([back], profile=None) == {}


def test_the_claims_file_metric_is_what_every_claim_reads_unless_its_test_names_one(tmp_path):
    path = _suite(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["metric"] = "throughput"  # 1000.0 in every trial: every difference it reads is 0
    raw["claims"][3]["test"]["objective"] = "val_acc"  # "early" keeps its own
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    claims = load_claims(path)
    assert [c.test.metric for c in claims.claims] == ["throughput"] * 3 + ["val_acc", "throughput"]
    studies = {n: load(tmp_path / "results" / n) for n in ("small", "large", "control")}
    results = {r.claim.id: r for r in evaluate_claims(claims.claims, studies)}
    assert results["small"].diff == 0 and results["early"].diff == pytest.approx(-0.1)
    # a column the studies lack says so, naming it; one their trials did not record (the held-out
    # test accuracy of studies run before it was scored) says that
    raw["metric"] = "test_loss_of_nothing"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match="no column 'test_loss_of_nothing'"):
        evaluate_claims(load_claims(path).claims, studies)
    raw["metric"] = "test_acc"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match="'test_acc' is not recorded for .* COMPLETE trials.*run the study again"):
        evaluate_claims(load_claims(path).claims, studies)
    # left out: val_acc, as before the key existed
    assert load_claims(_suite(tmp_path / "again")).claims[0].test.metric == "val_acc"


def test_the_convit_arms_keep_a_plain_block_on_top_and_the_class_token():
    """ls_convit with GPSA in every block (local_up_to_layer == depth) drops the class token and
    averages the patches: an arm there would differ from the DeiT in its head too."""
    import timm

    import trainers.models  # noqa: F401  (registers ls_convit_*)

    studied = 0
    for path in sorted((ROOT / "studies").glob("*.yaml")):
        if path.name == "claims.yaml":
            continue
        for profile in ("cpu", "gpu"):
            spec = load_spec(path, profile=profile, check_model=False)
            model = spec.candidates[0]
            if not model.name.startswith("ls_convit") or "local_up_to_layer" not in spec.space:
                continue
            studied += 1
            for point in spec.grid_points():
                args = {**model.args, **point}
                net = timm.create_model(model.name, **{k: v for k, v in args.items() if k != "embed_dim"},
                                        embed_dim=16)  # the head does not depend on the width
                assert net.global_pool == "token" and net.cls_token is not None, (path.name, profile, point)
    assert studied == 10  # small data, 5% and 10%, more data, the ablation; two profiles each


def test_the_studies_and_claims_in_the_repository_are_valid():
    claims = load_claims(ROOT / "studies" / "claims.yaml")
    assert len(claims.claims) >= 8
    for study in claims.studies():
        for profile in ("cpu", "gpu"):
            spec = load_spec(ROOT / "studies" / f"{study}.yaml", profile=profile, check_model=False)
            assert spec.is_grid and spec.algorithm.seeds >= 3, (study, profile)


def test_a_slope_and_its_standard_error_by_hand():
    from search.results.claims import slope

    # x 0 1 2, y 1 2 4: Sxx 2, Sxy 3, slope 1.5; residuals 1/6, -1/3, 1/6: s^2 (1/36 + 1/9 + 1/36) / 1 = 1/6,
    # se sqrt(1/6 / 2) on 1 degree of freedom
    e = slope([0.0, 1.0, 2.0], [1.0, 2.0, 4.0])
    assert e.diff == pytest.approx(1.5) and e.se == pytest.approx(math.sqrt(1 / 12)) and e.df == 1
    assert not slope([0.0, 1.0], [1.0, 2.0]).testable and not slope([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]).testable
    assert not slope([0.0, 1.0, 2.0], [1.0, 2.0, 3.0]).testable  # on the line exactly: no residual spread


def test_a_trend_claim_fits_the_gap_over_log10_of_each_studys_x(tmp_path):
    from scipy import stats

    # gaps per seed at x 0.01, 0.1, 1 (log10 -2, -1, 0): 0.10 0.12 0.11, 0.06 0.05 0.07, 0.02 0.01 0.03.
    # By hand: mean x -1, mean y 0.57 / 9; Sxx 6, Sxy -(0.33 - 0.19) + (0.06 - 0.19) = -0.27: slope -0.045 a
    # tenfold x. Residual SS: 0.0006 within the studies + 3 (0.001667^2 + 0.003333^2 + 0.001667^2) = 0.00065,
    # s^2 0.00065 / 7, se sqrt(s^2 / 6) on 7 degrees of freedom
    base = {0: 0.50, 1: 0.60, 2: 0.55}
    gaps = {"tiny": (0.01, [0.10, 0.12, 0.11]), "some": (0.1, [0.06, 0.05, 0.07]), "all": (1.0, [0.02, 0.01, 0.03])}
    for name, (x, g) in gaps.items():
        _study(tmp_path, name, model="ls_convit_nano", values=[0, 1], fraction=x,
               accs={**{(0, s): b for s, b in base.items()}, **{(1, s): b + g[s] for s, b in base.items()}})
    claims = {"claims": [{"id": "curve", "paper": "P, Table 2", "claim": "the gap shrinks as the data grows",
                          "paper_result": "-9.3 pp a tenfold", "expect": "lower",
                          "test": {"kind": "trend", "study": "tiny", "knob": "local_up_to_layer", "value": 1,
                                   "baseline": 0, "over": ["all", "tiny", "some"]}}]}
    path = tmp_path / "specs" / "claims.yaml"
    path.write_text(yaml.safe_dump(claims, sort_keys=False))
    claim = load_claims(path).claims[0]
    assert claim.test.studies == ("tiny", "all", "some")
    result = evaluate_claim(claim, {n: load(tmp_path / "results" / n) for n in gaps})
    assert result.diff == pytest.approx(-0.045) and result.estimate.df == 7
    assert result.estimate.se == pytest.approx(math.sqrt(0.00065 / 7 / 6))
    fit = stats.linregress([-2] * 3 + [-1] * 3 + [0] * 3, [0.10, 0.12, 0.11, 0.06, 0.05, 0.07, 0.02, 0.01, 0.03])
    assert result.estimate.se == pytest.approx(fit.stderr) and result.p_value == pytest.approx(fit.pvalue)
    assert result.verdict == "reproduced" and result.n == "9 pairs over 3 studies"
    assert result.arms == "+0.1100 at 0.01, +0.0600 at 0.1, +0.0200 at 1"


@pytest.mark.parametrize("test, says", [
    ({"kind": "trend", "study": "a", "knob": "k", "value": 1, "baseline": 0, "over": ["a", "b", "a"]},
     "at least 3 studies"),
    ({"kind": "trend", "study": "a", "knob": "k", "value": 1, "baseline": 0, "over": ["b", "c", "d"]},
     "its study among them"),
    ({"kind": "effect", "study": "a", "knob": "k", "value": 1, "baseline": 0, "over": ["a", "c", "d"]},
     "only a trend test"),
])
def test_a_trend_names_three_studies_or_more(tmp_path, test, says):
    from search.results.claims import ClaimTest
    from search.spec.validation import SpecLocation, from_plain

    with pytest.raises(ConfigError, match=says):
        from_plain(ClaimTest, test, SpecLocation("claims.yaml"))


def test_the_suites_time_adds_the_studies_walls_up_by_hand():
    """Study a: trials 10:00-10:30 and 10:10-10:45 (wall 45 min; training 30 + 35 = 65 min), a
    replicate at 11:00-11:20 left out (a search's span); study b: 12:00-12:15 (15 min, 15 min); c
    not run. The suite: 60 min = 1.00 h of wall, 80 min = 1.33 h of training."""
    from types import SimpleNamespace

    import pandas as pd

    from search.views.claims_page import suite_line

    def trials(rows, device):
        return pd.DataFrame([{"started_at": f"2026-11-29T{a}:00", "ended_at": f"2026-11-29T{b}:00", "duration_s": d,
                              "replicate_of": r, "throughput_device": device} for a, b, d, r in rows])

    loaded = {"a": SimpleNamespace(trials=trials([("10:00", "10:30", 1800.0, None), ("10:10", "10:45", 2100.0, None),
                                                  ("11:00", "11:20", 1200.0, "t0")], "cpu: X")),
              "b": SimpleNamespace(trials=trials([("12:00", "12:15", 900.0, None)], "cpu: Y"))}
    studies = [SimpleNamespace(name=n) for n in ("a", "b", "c")]
    line = suite_line(studies, loaded)
    assert line.startswith("The suite: 2 of 3 studies run, 1.00 h of wall time in all"), line
    assert "1.33 h of training; on cpu: X, cpu: Y;" in line
    assert line.endswith("between 2026-11-29 10:00 and 2026-11-29 12:15 UTC."), line
    assert suite_line(studies[2:], loaded) == "The suite: no study has run yet."


def test_claims_read_only_finished_studies_of_their_spec(tmp_path, capsys):
    """With --no-run, a stale study (its spec edited since) is listed as it ran, and the claims
    resting on it are "not run": its numbers answer another protocol."""
    path = _suite(tmp_path)
    raw = yaml.safe_load((path.parent / "small.yaml").read_text())
    raw["budget"]["max_epochs"] = 30
    (path.parent / "small.yaml").write_text(yaml.safe_dump(raw))
    page = tmp_path / "claims.md"
    assert main(["claims", str(path), "--storage", str(tmp_path / "results"), "--no-run", "--out", str(page)]) == 0
    out = capsys.readouterr().out
    for claim in ("small", "shrinks", "versus", "early"):
        assert f"{claim}: not run" in out, out
    assert "saturates: not run" not in out and "saturates: " in out  # on the large study alone
    assert "| small | ls_convit_nano |" in page.read_text() and "**stale**" in page.read_text()

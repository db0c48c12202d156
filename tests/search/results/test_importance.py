"""Knob importance (search.results.importance) on studies whose Optuna journal is a real file."""

from __future__ import annotations

import math

import pandas as pd
import pytest

import search
from search.views.output import importance_view as format_importance
from search.results.importance import (MIN_COMPLETE_TRIALS, MIN_TRIALS_PER_KNOB, by_family,
                                      importance_warnings, knob_importance)
from tests.search.results.journal_study import UNIT, make_journal_study
from trainers.errors import ConfigError

EVALUATORS = ["fanova", "ped-anova"]
KNOBS = {"a": UNIT, "b": UNIT, "z": UNIT}


def _ranked(table: pd.DataFrame, objective: str, family: str | None = None) -> list[str]:
    rows = table[table["objective"] == objective]
    if family is not None:
        rows = rows[rows["family"] == family]
    return list(rows.sort_values("rank")["knob"])


def _driven(params) -> tuple[float, float]:
    # val_acc: a alone; throughput: b mostly, a a little; z drives nothing
    return params["a"], 3.0 * params["b"] + 0.5 * params["a"]


@pytest.mark.parametrize("evaluator", EVALUATORS)
def test_the_knob_that_alone_drives_an_objective_ranks_first_for_it(tmp_path, evaluator):
    study = make_journal_study(tmp_path / "s", objective=_driven, complete=80, shared=KNOBS)
    table = knob_importance(study, evaluator=evaluator)
    assert _ranked(table, "val_acc")[0] == "a"
    assert _ranked(table, "throughput")[0] == "b"  # the second objective is values[1], not values[0]
    assert set(table["knob"]) == {"a", "b", "z"} and (table["evaluator"] == evaluator).all()
    for objective in ("val_acc", "throughput"):
        shares = table.loc[table["objective"] == objective, "importance"]
        assert math.isclose(shares.sum(), 1.0)


@pytest.mark.parametrize("evaluator", EVALUATORS)
def test_a_knob_that_is_pure_noise_ranks_last(tmp_path, evaluator):
    study = make_journal_study(tmp_path / "s", objective=lambda p: (2.0 * p["a"] + p["b"], p["b"] + 0.5 * p["a"]),
                               complete=80, shared=KNOBS)
    table = knob_importance(study, evaluator=evaluator)
    assert _ranked(table, "val_acc")[-1] == "z"
    assert _ranked(table, "throughput")[-1] == "z"
    z = table[table["knob"] == "z"]["importance"]
    assert (z < 0.1).all()


def test_fanova_is_seeded_the_same_journal_gives_the_same_numbers(tmp_path):
    study = make_journal_study(tmp_path / "s", objective=_driven, complete=30, shared=KNOBS)
    first, again = knob_importance(study), knob_importance(study)
    pd.testing.assert_frame_equal(first, again)
    other = knob_importance(study, seed=1)
    assert not first["importance"].equals(other["importance"])  # the seed is what makes it repeat


def test_only_complete_trials_count(tmp_path):
    # PRUNED and FAIL trials carry no values in the journal; they must not be counted as evidence
    study = make_journal_study(tmp_path / "s", objective=_driven, complete=25, pruned=9, failed=4, shared=KNOBS)
    table = knob_importance(study)
    assert (table["complete_trials"] == 25).all()
    assert _ranked(table, "val_acc")[0] == "a"


def test_a_conditional_space_is_ranked_per_family_on_that_family_s_knobs(tmp_path):
    models = {"ls_convit_nano": {"strength": UNIT, "gate": UNIT}, "ls_gmm_nano": {"kernels": UNIT, "sigma": UNIT}}

    def objective(p):
        if p["model"] == "ls_convit_nano":  # strength drives accuracy, gate the speed
            return p["strength"], 1000.0 * p["gate"]
        return p["sigma"], 1000.0 * p["kernels"]

    study = make_journal_study(tmp_path / "s", objective=objective, complete=90, models=models, shared={"lr": UNIT})
    table = knob_importance(study)
    convit, gmm = table[table["family"] == "convit"], table[table["family"] == "gmm"]
    assert set(convit["knob"]) == {"strength", "gate", "lr"} and set(gmm["knob"]) == {"kernels", "sigma", "lr"}
    assert (convit["model"] == "ls_convit_nano").all() and (gmm["model"] == "ls_gmm_nano").all()
    assert _ranked(table, "val_acc", "convit")[0] == "strength" and _ranked(table, "throughput", "convit")[0] == "gate"
    assert _ranked(table, "val_acc", "gmm")[0] == "sigma" and _ranked(table, "throughput", "gmm")[0] == "kernels"
    # each family rests on its own COMPLETE trials, which together are all of them
    per_family = table.groupby("family")["complete_trials"].first()
    assert per_family.sum() == 90 and (per_family > 0).all()


def test_below_the_minimum_a_warning_names_the_count(tmp_path):
    few = knob_importance(make_journal_study(tmp_path / "few", objective=_driven, complete=MIN_COMPLETE_TRIALS - 1,
                                             shared=KNOBS))
    enough = knob_importance(make_journal_study(tmp_path / "enough", objective=_driven, complete=MIN_COMPLETE_TRIALS,
                                                shared=KNOBS))
    (line,) = importance_warnings(few)
    assert f"{MIN_COMPLETE_TRIALS - 1} COMPLETE trials" in line and f"fewer than {MIN_COMPLETE_TRIALS}" in line
    assert line in format_importance(few, fmt="table")
    assert importance_warnings(enough) == [] and "warning" not in format_importance(enough, fmt="table")


def test_with_many_knobs_the_minimum_grows_with_them(tmp_path):
    knobs = {f"k{i}": UNIT for i in range(8)}
    enough_for_few_knobs = MIN_COMPLETE_TRIALS + 5  # fewer than 4 per knob for 8 knobs
    table = knob_importance(make_journal_study(tmp_path / "s", objective=lambda p: (p["k0"], p["k1"]),
                                               complete=enough_for_few_knobs, shared=knobs))
    (group,) = by_family(table)
    assert group.minimum == MIN_TRIALS_PER_KNOB * 8 > enough_for_few_knobs
    assert importance_warnings(table) == [group.warning]
    assert f"fewer than {MIN_TRIALS_PER_KNOB * 8} ({MIN_TRIALS_PER_KNOB} per knob)" in group.warning


def test_a_family_with_one_complete_trial_gets_no_importance(tmp_path):
    models = {"ls_convit_nano": {"strength": UNIT}, "ls_gmm_nano": {"sigma": UNIT}}
    # one COMPLETE trial: one family has it, the other none
    study = make_journal_study(tmp_path / "s", objective=lambda p: (p.get("strength", p.get("sigma")), 1.0),
                               complete=1, models=models)
    table = knob_importance(study)
    lonely = table[table["complete_trials"] < 2]
    assert len(lonely) and lonely["importance"].isna().all() and lonely["rank"].isna().all()
    assert "nothing to compare" in format_importance(table, fmt="table")


def test_a_folder_that_is_not_a_study_or_has_no_journal_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no trials.parquet"):
        knob_importance(tmp_path)
    study = make_journal_study(tmp_path / "s", objective=_driven, complete=3, shared=KNOBS)
    with pytest.raises(ConfigError, match="evaluator 'shap'"):
        knob_importance(study, evaluator="shap")
    (study / "optuna.journal").unlink()
    with pytest.raises(ConfigError, match="no optuna.journal"):
        knob_importance(study)
    assert not (study / "optuna.journal").exists()  # reading never creates a journal


def test_a_view_s_bound_on_the_trials_is_a_config_error_naming_the_command(tmp_path):
    study = make_journal_study(tmp_path / "s", objective=_driven, complete=12, shared=KNOBS)
    assert len(knob_importance(study, max_trials=12))  # at the bound: computed
    with pytest.raises(ConfigError, match=r"12 COMPLETE trials, more than the 11 .*python -m search importance"):
        knob_importance(study, max_trials=11)


def test_exposed_with_the_other_results_functions():
    assert search.results.knob_importance is knob_importance and search.knob_importance is knob_importance

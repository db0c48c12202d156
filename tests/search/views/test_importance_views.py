"""Knob importance as the views show it: `python -m search importance` and the report's section."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest

from search.results.importance import IMPORTANCE_COLUMNS, MIN_COMPLETE_TRIALS
from search.views.cli import main
from search.views.report import write_report
from tests.search.results.journal_study import UNIT, make_journal_study
from tests.search.views.conftest import http_get

KNOBS = {"a": UNIT, "b": UNIT, "z": UNIT}


def _objective(p):
    return p["a"], 3.0 * p["b"]  # val_acc: a; throughput: b; z nothing


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return make_journal_study(tmp_path_factory.mktemp("imp") / "s", objective=_objective, complete=40, pruned=5,
                              shared=KNOBS)


@pytest.fixture(scope="module")
def few(tmp_path_factory):
    return make_journal_study(tmp_path_factory.mktemp("imp") / "few", objective=_objective,
                              complete=MIN_COMPLETE_TRIALS // 2, shared=KNOBS)


def test_table(study, capsys):
    assert main(["importance", str(study)]) == 0
    out = capsys.readouterr().out
    assert "fANOVA" in out and "40 COMPLETE trials" in out and "warning" not in out
    rows = [line.split() for line in out.splitlines() if line.strip().split()[:1] in (["a"], ["b"], ["z"])]
    assert sorted(r[0] for r in rows) == ["a", "b", "z"] and rows[0][0] == "a"  # sorted by the first objective
    assert float(rows[0][1]) > 0.8  # a's share of val_acc


def test_json_and_csv(study, capsys):
    assert main(["importance", str(study), "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records and set(records[0]) == set(IMPORTANCE_COLUMNS)
    top = {r["objective"]: r["knob"] for r in records if r["rank"] == 1}
    assert top == {"val_acc": "a", "throughput": "b"}
    assert all(r["complete_trials"] == 40 for r in records)  # the 5 PRUNED trials do not count

    assert main(["importance", str(study), "--format", "csv", "--evaluator", "ped-anova"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert list(table.columns) == list(IMPORTANCE_COLUMNS) and (table["evaluator"] == "ped-anova").all()
    assert table[(table["objective"] == "val_acc") & (table["rank"] == 1)]["knob"].item() == "a"


def test_warning_below_the_minimum(few, capsys):
    assert main(["importance", str(few)]) == 0
    out = capsys.readouterr().out
    assert f"importance rests on {MIN_COMPLETE_TRIALS // 2} COMPLETE trials, fewer than {MIN_COMPLETE_TRIALS}" in out
    assert main(["importance", str(few), "--format", "json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout stays JSON; the warning goes to stderr
    assert captured.err.startswith("warning:") and f"fewer than {MIN_COMPLETE_TRIALS}" in captured.err


def test_not_a_study_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["importance", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no trials.parquet" in err
    with pytest.raises(SystemExit) as exited:  # argparse's refusal: the same one line and exit code
        main(["importance", str(tmp_path), "--evaluator", "shap"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: ") and "invalid choice: 'shap'" in err


def test_report_has_the_importance_section(study, tmp_path):
    text = write_report(study, out=tmp_path / "r.html").html.read_text()
    start = text.index('id="importance"')
    section = text[start:text.index("</section>", start)]
    assert "fANOVA" in section and "40 COMPLETE trials" in section
    body = section[section.index("<tbody>"):]
    assert body.index("<td>a</td>") < body.index("<td>z</td>")  # most important first
    assert "warning" not in section


def test_report_section_warns_below_the_minimum_and_says_when_there_is_no_journal(few, tmp_path):
    text = write_report(few, out=tmp_path / "r.html").html.read_text()
    section = text[text.index('id="importance"'):]
    assert f"fewer than {MIN_COMPLETE_TRIALS}" in section[:section.index("</section>")]
    (few / "optuna.journal").rename(few / "journal.bak")
    try:
        text = write_report(few, out=tmp_path / "r2.html").html.read_text()  # still written
    finally:
        (few / "journal.bak").rename(few / "optuna.journal")
    section = text[text.index('id="importance"'):]
    assert "no optuna.journal" in section[:section.index("</section>")]


# -- the Pareto page's panel ----------------------------------------------------------------
def _get(server, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    return http_get(server, path, headers, timeout=60)  # the first answer fits fANOVA


def test_server_answers_the_importance_as_json_and_304_until_the_journal_changes(study, few, tmp_path, serve):
    server = serve([study, few, tmp_path / "not_yet"])
    status, headers, body = _get(server, "/api/importance")
    assert status == 200 and headers["Content-Type"] == "application/json"
    ranked, small, missing = json.loads(body)["studies"]
    (family,) = ranked["families"]
    assert family["complete_trials"] == 40 and family["warning"] is None and family["knobs"][0] == "a"
    assert family["objectives"] == ["val_acc", "throughput"] and family["shares"]["val_acc"][0] > 0.8
    assert family["minimum"] == MIN_COMPLETE_TRIALS  # 3 knobs: the floor
    assert f"fewer than {MIN_COMPLETE_TRIALS}" in small["families"][0]["warning"]
    assert missing["families"] == [] and "no trials.parquet" in missing["error"]
    assert _get(server, "/api/importance", {"If-None-Match": headers["ETag"]})[0] == 304
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(few / "optuna.journal")))
    trial = optuna.load_study(study_name="journal_fixture", storage=storage).ask()  # a new trial sampled: new numbers
    storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
    assert _get(server, "/api/importance", {"If-None-Match": headers["ETag"]})[0] == 200


@pytest.mark.chromium
def test_page_shows_the_importance_panel(study, few, serve, tmp_path):
    from dashboards.browser import Browser, BrowserError

    server = serve([study, few])
    try:
        browser = Browser(width=1400, height=1500)
    except BrowserError as exc:
        pytest.skip(f"chromium would not start here: {exc}")
    try:
        browser.navigate(server.url + "?poll=200")
        browser.wait_for("window.__dashboard && window.__dashboard.importanceRenders >= 1", timeout=60)
        text = browser.evaluate("document.getElementById('importance-panel').textContent")
        first = browser.evaluate("document.querySelector('#importance-panel table td.mono').textContent")
        assert browser.evaluate("document.getElementById('importance-card').hidden") is False
    finally:
        browser.close()
    assert "40 COMPLETE trials" in text and first == "a"
    assert f"{MIN_COMPLETE_TRIALS // 2} COMPLETE trials, fewer than {MIN_COMPLETE_TRIALS}" in text

"""Bad input to every command gives one line and exit code 2, before any work and without leaving
files behind: damaged study files, output paths that cannot be written, bad flags, a study named
twice, URIs without a bucket. And the messages say what is true: why a front is empty, what
`resume` can do with a study Tune saved nothing for."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from search.views.cli import main
from tests.search.views.test_select_cli import ROOT, SPEC, TRIALS, _run, _user_error, _write_study


@pytest.fixture
def study(tmp_path) -> Path:
    return _write_study(tmp_path / "tiny", SPEC, TRIALS)


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


# -- damaged study files -------------------------------------------------------------------------

DAMAGE = {
    "trials cut in half": ("trials.parquet", lambda b: b[: len(b) // 2], "not a readable Parquet file"),
    "trials empty": ("trials.parquet", lambda b: b"", "not a readable Parquet file"),
    "epochs not Parquet": ("epochs.parquet", lambda b: b"not parquet\n", "not a readable Parquet file"),
    "progress not Parquet": ("progress.parquet", lambda b: b"oops\n", "not a readable Parquet file"),
    "experiment not JSON": ("experiment.json", lambda b: b"{not json", "not valid JSON"),
    "experiment a list": ("experiment.json", lambda b: b"[1, 2]", "a JSON list"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_study_files_give_one_line(study, tmp_path, capsys, damage):
    name, mangle, message = DAMAGE[damage]
    (study / name).write_bytes(mangle((study / name).read_bytes()))
    other = _write_study(tmp_path / "other", dict(SPEC, name="other"), TRIALS[:3])
    before = _files(tmp_path)
    commands = [("report", study, "--out", tmp_path / "r.html")]
    if name in ("trials.parquet", "experiment.json"):  # (pareto and compare read neither epochs nor progress)
        commands += [("pareto", study), ("compare", study, other)]
    for argv in commands:
        err = _user_error(capsys, *argv)
        assert message in err and name in err, (argv, err)
    assert _files(tmp_path) == before  # no report, no PNG


def test_a_study_whose_files_disagree_names_the_missing_columns(study, capsys):
    pq.write_table(pa.table({"x": [1, 2]}), study / "trials.parquet")
    err = _user_error(capsys, "pareto", study)
    assert "no column 'trial_id', 'state', 'val_acc', 'throughput'" in err
    meta = json.loads((study / "experiment.json").read_text())
    for objectives in ([["val_acc", "sideways"]], "val_acc", []):
        (study / "experiment.json").write_text(json.dumps(dict(meta, objectives=objectives)))
        assert "not a list of [column, min|max] pairs" in _user_error(capsys, "pareto", study)


# -- output paths --------------------------------------------------------------------------------


def test_report_checks_its_out_path_first_and_writes_both_files_or_neither(study, tmp_path, capsys):
    (tmp_path / "folder.html").mkdir()
    (tmp_path / "afile").write_text("x")
    before = _files(tmp_path)
    assert "is a folder" in _user_error(capsys, "report", study, "--out", tmp_path / "folder.html")
    assert "not a file name" in _user_error(capsys, "report", study, "--out", "")
    assert "is a file, not a folder" in _user_error(capsys, "report", study, "--out", tmp_path / "afile" / "r.html")
    assert "ending in .html" in _user_error(capsys, "report", study, "--out", tmp_path / "new" / "r")  # not renamed
    assert _files(tmp_path) == before
    code, out, err = _run(capsys, "report", study, "--out", tmp_path / "new" / "r.html")  # a missing folder is made
    assert code == 0, err
    assert (tmp_path / "new" / "r.html").is_file() and (tmp_path / "new" / "r-front.png").is_file()


def test_export_checks_its_path_before_printing_the_trial(study, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    cases = [("", "not a file name"), (tmp_path, "is a folder"),
             (tmp_path / "afile" / "b.yaml", "is a file, not a folder")]
    for path, message in cases:
        code, out, err = _run(capsys, "pareto", study, "--export", path)
        assert code == 2 and out == "" and message in err and err.count("\n") == 1, (path, out, err)
    code, out, err = _run(capsys, "pareto", study, "--export", tmp_path / "new" / "deep" / "b.yaml")
    assert code == 0 and (tmp_path / "new" / "deep" / "b.yaml").is_file(), err


def test_run_checks_storage_and_cache_before_its_data(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = ROOT / "spaces" / "synthetic_smoke.yaml"
    (tmp_path / "afile").write_text("x")
    for storage in ("s3://", "file:///"):
        assert "no bucket or path after" in _user_error(capsys, "run", spec, "--storage", storage)
    assert "is a file, not a folder" in _user_error(capsys, "run", spec, "--storage", tmp_path / "afile")
    err = _user_error(capsys, "run", spec, "--storage", tmp_path / "st", "--cache-dir", tmp_path / "afile")
    assert "dataset cache" in err and "is a file, not a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no ./s3:, no study folder
    assert "no bucket or path after" in _user_error(capsys, "pareto", "s3://")


def test_train_checks_its_out_folder_before_training(study, tmp_path, capsys):
    code, _, err = _run(capsys, "pareto", study, "--export", tmp_path / "best.yaml")
    assert code == 0, err
    (tmp_path / "afile").write_text("x")
    err = _user_error(capsys, "train", tmp_path / "best.yaml", "--out", tmp_path / "afile" / "sub")
    assert "is a file, not a folder" in err
    assert "is a folder; pass the YAML file" in _user_error(capsys, "train", tmp_path)


# -- flags and arguments -------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["run", "x.yaml", "--trials", "abc"], "python -m search run: argument --trials: invalid int value"),
    (["pareto", "s", "--format", "xml"], "invalid choice: 'xml'"),
    (["run", "x.yaml", "--bogus"], "python -m search run: unrecognized arguments: --bogus; see python -m search run --help"),
    (["pareto", "s", "--bogus", "x"], "python -m search pareto: unrecognized arguments: --bogus x"),
    (["dashboard", "s", "--port", "-1"], "'-1' is not a port"),
    (["dashboard", "s", "--port", "70000"], "'70000' is not a port"),
])
def test_argument_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err and "--help" in err, err


def test_select_takes_numeric_columns_only(study, capsys):
    err = _user_error(capsys, "pareto", study, "--select", "max:family")
    assert "'family' is not a numeric column" in err and "val_acc" in err


def test_compare_refuses_a_study_named_twice(study, capsys):
    for twice in (study, study.parent / ".." / study.parent.name / study.name):
        assert "are the same study" in _user_error(capsys, "compare", study, twice)


def test_check_rejects_an_unknown_dataset_and_the_source_key(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text((ROOT / "spaces" / "synthetic_smoke.yaml").read_text().replace("name: synthetic", "name: mnist"))
    assert "unknown dataset 'mnist'" in _user_error(capsys, "check", spec)
    spec.write_text("name: x\nsource: y\n")
    assert "source: unknown key; it is set from the file name" in _user_error(capsys, "check", spec)
    spec.write_text("name: x\nbudgett: {}\n")
    assert " source," not in _user_error(capsys, "check", spec)  # not among the allowed keys


# -- messages that say what is true ---------------------------------------------------------------


def test_an_empty_front_says_why(study, tmp_path, capsys):
    code, out, _ = _run(capsys, "pareto", study, "--where", "val_acc>2")
    assert code == 0 and "no COMPLETE trial passes --where 'val_acc>2'" in out
    failed = _write_study(tmp_path / "failed", dict(SPEC, name="failed"), [t for t in TRIALS if t[2] != "COMPLETE"])
    code, out, _ = _run(capsys, "pareto", failed)
    assert code == 0 and "none of its finished trials completed (1 PRUNED, 1 FAILED)" in out


def test_resume_of_a_study_tune_saved_nothing_for_does_not_say_delete(tmp_path, capsys):
    unfinished = _write_study(tmp_path / "tiny", SPEC, TRIALS[:-1])  # a trial short: something to resume
    err = _user_error(capsys, "resume", unfinished)
    assert "cannot be resumed" in err and "delete" not in err


def test_reading_a_uri_with_no_study_leaves_no_staging_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache" / "datasets"))
    missing = f"file://{tmp_path}/nowhere"
    assert "no trials.parquet there" in _user_error(capsys, "pareto", missing)
    assert "no experiment.json" in _user_error(capsys, "resume", missing)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("damage", ["experiment a list", "experiment not JSON", "progress not Parquet"])
def test_the_dashboard_shows_a_damaged_study_as_an_error(study, damage):
    from search.views.dashboard.server import study_payload

    name, mangle, message = DAMAGE[damage]
    (study / name).write_bytes(mangle((study / name).read_bytes()))
    payload = study_payload(study)
    assert payload["n"] == 0 and message in payload["error"] and name in payload["error"]

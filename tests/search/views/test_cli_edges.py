"""The CLI's edges: a reader that goes away, --out honoured exactly, every spec checked, --version,
the exit codes in --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from search.results.store import ResultsStore
from search.views.cli import EXIT_BROKEN_PIPE, main, version
from tests.search.results.test_intervals import OBJECTIVES, _row

ROOT = Path(__file__).resolve().parents[3]


def _study(folder: Path, n: int) -> Path:
    """A study whose front holds all ``n`` trials (a trade-off curve, intervals far apart)."""
    store = ResultsStore(folder, space={}, objectives=OBJECTIVES)
    for i in range(n):
        row = _row(i, 0.99 - i * 1e-4, 1_000.0 + 10.0 * i)
        row.update(val_acc_low=None, val_acc_high=None, throughput_low=None, throughput_high=None)
        store.add_trial(row, {})
    store.flush()
    (folder / "experiment.json").write_text(json.dumps({"objectives": [list(o) for o in OBJECTIVES]}))
    return folder


def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(tmp_path):
    study = _study(tmp_path, 3000)  # a table far larger than a pipe's buffer
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "search", "pareto", str(study)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"Pareto front")  # as `| head -1` reads
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr


def test_report_out_is_honoured_exactly_or_refused(tmp_path, capsys):
    study = _study(tmp_path / "study", 3)
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(["report", str(study), "--out", str(folder)]) == 2
    assert "is a folder" in capsys.readouterr().err and not (tmp_path / "out.html").exists()
    assert main(["report", str(study), "--out", str(tmp_path / "x.txt")]) == 2
    assert "ending in .html" in capsys.readouterr().err
    assert not (tmp_path / "x.txt").exists() and not (tmp_path / "x.html").exists()
    assert main(["report", str(study), "--out", str(tmp_path / "mine.htm")]) == 0
    assert (tmp_path / "mine.htm").is_file() and (tmp_path / "mine-front.png").is_file()


def test_check_checks_every_file_and_reports_each(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    code = main(["check", str(bad), str(ROOT / "spaces/synthetic_smoke.yaml"), str(tmp_path / "missing.yaml")])
    out, err = capsys.readouterr()
    assert code == 2
    assert "synthetic_smoke.yaml: ok" in out  # checked although the file before it failed
    assert err.count("\n") == 2 and str(bad) in err and "missing.yaml" in err  # one line per failed file
    assert main(["check", str(ROOT / "spaces/synthetic_smoke.yaml")]) == 0


def test_version_and_the_exit_codes_in_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip().endswith(f"{version()} (locality-search)")
    assert version() != "unknown"
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "exit codes:" in help_text and "141" in help_text and "  2 " in help_text


def test_an_absurd_trial_count_is_refused_before_anything_runs(tmp_path, capsys):
    storage = tmp_path / "results"
    code = main(["run", str(ROOT / "spaces/synthetic_smoke.yaml"), "--trials", "1000000000000", "--storage", str(storage)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "at most 100,000" in err
    assert not storage.exists()

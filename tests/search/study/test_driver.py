"""One driver per study (search.study.driver): a live driver is named to the second one, a killed one
leaves nothing to wait on, and what it left mid-append to the Optuna journal is cleared."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from search.results.location import JOURNAL_FILE
from search.study.driver import DRIVER_LOCK, JOURNAL_LOCK, driving
from trainers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]

HOLD = """
import sys, time
from search.study.driver import driving
with driving(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def other_driver(tmp_path):
    """A process driving ``tmp_path / "study"`` until the test ends (or kills it)."""
    folder = tmp_path / "study"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "held"
    yield folder, proc
    proc.kill()
    proc.wait()


def test_optuna_locks_its_journal_with_the_link_the_next_driver_clears(tmp_path):
    journal = tmp_path / JOURNAL_FILE
    backend = JournalFileBackend(str(journal))
    assert isinstance(backend._lock, JournalFileSymlinkLock)  # Optuna's default: a link beside the journal
    assert backend._lock.acquire()
    assert (tmp_path / JOURNAL_LOCK).is_symlink()
    backend._lock.release()


def test_a_second_driver_is_refused_with_the_first_ones_pid(other_driver):
    folder, proc = other_driver
    with pytest.raises(ConfigError, match=rf"another driver is running this study \(pid {proc.pid} on "):
        with driving(folder):
            pass
    assert json.loads((folder / DRIVER_LOCK).read_text())["pid"] == proc.pid  # the refused one wrote nothing


def test_a_sigkilled_driver_leaves_nothing_to_wait_on(other_driver):
    folder, proc = other_driver
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with driving(folder):
        assert json.loads((folder / DRIVER_LOCK).read_text())["pid"] == os.getpid()


def test_a_forked_child_does_not_keep_the_study_driven(tmp_path):
    """A child forked while the lock is held (a worker pool, a data conversion) may outlive the
    driver; the study must not look driven by it."""
    started, tell = os.pipe()
    with driving(tmp_path):
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            os.write(tell, b"x")  # the fork's hooks have run
            time.sleep(60)
            os._exit(0)
        assert os.read(started, 1) == b"x"
    try:
        with driving(tmp_path):
            pass
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def _journal_with_one_trial(folder: Path) -> None:
    storage = JournalStorage(JournalFileBackend(str(folder / JOURNAL_FILE)))
    study = optuna.create_study(study_name="s", storage=storage)
    study.tell(study.ask(), 1.0)


def test_the_journal_lock_and_torn_record_a_killed_driver_left_are_cleared(tmp_path):
    """The study folder moved after its driver was killed mid-append: Optuna's lock is a link to
    the journal's old path, and the record being written has no line end."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    _journal_with_one_trial(old)
    old.rename(new)
    (new / JOURNAL_LOCK).symlink_to(old / JOURNAL_FILE)  # dangles: Optuna would wait on it forever
    (new / f"{JOURNAL_LOCK}0b1c.rename").symlink_to(old / JOURNAL_FILE)
    whole = (new / JOURNAL_FILE).read_bytes()
    with open(new / JOURNAL_FILE, "ab") as f:
        f.write(b'{"op_code":6,"worker_id":"x","trial_id":')

    with driving(new):
        assert not (new / JOURNAL_LOCK).is_symlink() and not list(new.glob("*.rename"))
        assert (new / JOURNAL_FILE).read_bytes() == whole
        storage = JournalStorage(JournalFileBackend(str(new / JOURNAL_FILE)))
        study = optuna.load_study(study_name="s", storage=storage)
        study.tell(study.ask(), 2.0)
    reread = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(str(new / JOURNAL_FILE))))
    assert [t.value for t in reread.trials] == [1.0, 2.0]


def test_resume_of_a_study_being_driven_says_so_in_one_line(other_driver):
    folder, proc = other_driver
    (folder / "experiment.json").write_text("{}")
    done = subprocess.run([sys.executable, "-m", "search", "resume", str(folder)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and f"pid {proc.pid}" in done.stderr, done.stderr
    assert done.stdout == ""


def test_a_filesystem_without_locks_runs_unguarded_with_a_warning(tmp_path, monkeypatch, capsys):
    """(An NFS mount without a lock service answers ENOLCK.) A dangling journal lock is still
    cleared -- it is no one's lock on this journal -- but a live-looking one is left to Optuna."""
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    _journal_with_one_trial(tmp_path)
    (tmp_path / JOURNAL_LOCK).symlink_to(tmp_path / "gone" / JOURNAL_FILE)
    with driving(tmp_path):
        assert not (tmp_path / JOURNAL_LOCK).is_symlink()
        (tmp_path / JOURNAL_LOCK).symlink_to(tmp_path / JOURNAL_FILE)
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "cannot lock driver.lock" in err and "start only one" in err, err
    with driving(tmp_path):
        assert (tmp_path / JOURNAL_LOCK).is_symlink()  # it may be a live driver's


def test_a_folder_the_driver_cannot_write_in_is_a_one_line_error(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(ConfigError, match=r"cannot write the study's files there \(Not a directory\)"):
        with driving(not_a_folder):
            pass

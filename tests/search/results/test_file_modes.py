"""Files a team can read: what the store writes gets the mode a plainly created file would
(0666 less the umask), not mkstemp's private 0600."""

from __future__ import annotations

import datetime as dt
import os
import stat
import threading
from pathlib import Path

import pytest

from search.results.location import StudyLocation
from search.results.store import ResultsStore, write_json_atomic
from trainers._atomic import atomic_write, current_umask

SPACE = {"lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2}}
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
STORE_FILES = ("trials.parquet", "epochs.parquet", "pareto.parquet", "progress.parquet", "experiment.json")


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=lambda m: f"umask-{m:03o}")
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _write_study(store: ResultsStore, folder: Path) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    store.add_epoch({"trial_id": "t0", "epoch": 1, "val_acc": 0.5, "reported_at": now})
    store.add_trial({"trial_id": "t0", "state": "COMPLETE", "val_acc": 0.5, "throughput": 10.0}, {"lr": 1e-3})
    store.add_progress(trial_id="t0", state="COMPLETE", elapsed_s=1.0, at=now)
    write_json_atomic({"name": "modes"}, folder / "experiment.json")
    store.flush()


def test_store_files_follow_the_umask(tmp_path, umask):
    _write_study(ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES), tmp_path)
    expected = 0o666 & ~umask
    assert {name: oct(_mode(tmp_path / name)) for name in STORE_FILES} == {name: oct(expected) for name in STORE_FILES}
    assert not list(tmp_path.glob(".*.tmp"))


def test_rewritten_file_takes_the_umask_of_the_rewrite(tmp_path):
    # a file written before (say 0600 by an older version) is replaced, mode included
    path = tmp_path / "trials.parquet"
    path.write_bytes(b"old")
    path.chmod(0o600)
    old = os.umask(0o022)
    try:
        atomic_write(path, lambda handle: handle.write(b"new"))
    finally:
        os.umask(old)
    assert _mode(path) == 0o644 and path.read_bytes() == b"new"


def test_files_uploaded_to_and_pulled_from_a_uri_follow_the_umask(tmp_path, umask, monkeypatch):
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache" / "datasets"))  # staging beside it
    remote = tmp_path / "shared" / "study"
    location = StudyLocation(f"file://{remote}")
    location.local.mkdir(parents=True)
    _write_study(ResultsStore(location.local, space=SPACE, objectives=OBJECTIVES, location=location), location.local)
    expected = 0o666 & ~umask
    assert {name: _mode(remote / name) for name in STORE_FILES} == {name: expected for name in STORE_FILES}
    for name in STORE_FILES:
        (location.local / name).unlink()
    assert sorted(location.pull()) == sorted(STORE_FILES)
    assert {name: _mode(location.local / name) for name in STORE_FILES} == {name: expected for name in STORE_FILES}


def test_umask_is_read_without_changing_it():
    old = os.umask(0o027)
    try:
        seen = []
        # another thread creating files meanwhile must never see a different umask
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen.append(current_umask())

        watcher = threading.Thread(target=watch)
        watcher.start()
        for _ in range(200):
            assert current_umask() == 0o027
        stop.set()
        watcher.join()
        assert set(seen) == {0o027}
        assert os.umask(0o027) == 0o027  # still the one set
    finally:
        os.umask(old)

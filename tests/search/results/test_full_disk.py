"""A full disk: the store's write that does not fit stops with one line saying so, every file that
was there reads as before, no temporary file is left, and the write succeeds once there is room.

The study lives on a small tmpfs mounted for the test (root only: elsewhere skipped, saying why)."""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from search.results.store import ResultsStore, write_json_atomic
from trainers.errors import DiskFullError

SPACE = {"lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2}}
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
PARQUET = ("trials.parquet", "epochs.parquet", "pareto.parquet", "progress.parquet")


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str):
    """A tmpfs of ``size`` (mount's -o size=) at ``mount``, unmounted on leaving; the test is
    skipped, saying why, where this process may not mount one."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs); run as root to test a full disk")
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}); a container without "
                    "CAP_SYS_ADMIN: run where mount works to test a full disk")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_fs(tmp_path):
    """A 512 KiB tmpfs at tmp_path/fs."""
    with mounted_tmpfs(tmp_path / "fs", "512k") as mount:
        yield mount


def fill(folder: Path) -> Path:
    """A file taking every free byte of ``folder``'s file system."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 16, 4096, 512, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def _add(store: ResultsStore, first: int, count: int) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    for i in range(first, first + count):
        # incompressible text per row: the files grow with the rows whatever Parquet's encoding
        note = os.urandom(64).hex()
        store.add_trial({"trial_id": f"t{i}", "state": "COMPLETE", "val_acc": i / 1000, "throughput": 1000.0 - i,
                         "error": note, "started_at": now}, {"lr": 1e-3})
        store.add_epoch({"trial_id": f"t{i}", "epoch": 1, "val_acc": i / 1000, "reported_at": now})
        store.add_progress(trial_id=f"t{i}", state="COMPLETE", elapsed_s=float(i), at=now)


def _tables(folder: Path) -> dict[str, pa.Table]:
    return {name: pq.read_table(folder / name) for name in PARQUET}


def test_a_store_write_that_does_not_fit(small_fs):
    study = small_fs / "study"
    store = ResultsStore(study, space=SPACE, objectives=OBJECTIVES)
    write_json_atomic({"name": "study"}, study / "experiment.json")
    _add(store, 0, 5)
    store.flush()
    before = _tables(study)
    experiment = (study / "experiment.json").read_bytes()
    listing = sorted(p.name for p in study.iterdir())

    filler = fill(small_fs)
    _add(store, 5, 50)  # more rows than the space left: the next file does not fit
    with pytest.raises(DiskFullError) as info:
        store.flush()
    message = str(info.value)
    assert "\n" not in message and "the disk is full" in message
    assert f"python -m search resume {study}" in message  # the fix, with the study's place

    # every file as before the failed write, and nothing half-written beside them
    assert sorted(p.name for p in study.iterdir()) == listing
    after = _tables(study)
    assert {n: after[n].equals(before[n]) for n in PARQUET} == {n: True for n in PARQUET}
    assert (study / "experiment.json").read_bytes() == experiment

    filler.unlink()  # room again: the same store writes everything it holds
    store.flush()
    trials = pq.read_table(study / "trials.parquet")
    assert trials.num_rows == 55 and sorted(trials.column("trial_id").to_pylist()) == sorted(f"t{i}" for i in range(55))
    assert pq.read_table(study / "epochs.parquet").num_rows == 55
    assert not list(study.glob(".*.tmp"))


def test_a_new_study_on_a_full_disk_leaves_nothing_half_written(small_fs):
    store = ResultsStore(small_fs / "study", space=SPACE, objectives=OBJECTIVES)
    _add(store, 0, 5)
    fill(small_fs)
    with pytest.raises(DiskFullError, match="the disk is full") as info:
        store.flush()
    assert "\n" not in str(info.value)
    assert [p.name for p in (small_fs / "study").iterdir()] == []

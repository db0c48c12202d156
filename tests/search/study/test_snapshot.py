"""Tune's snapshot kept whole (search.study.snapshot): a complete snapshot is copied, a half-written
one is not, and a resume puts the last complete one back where a full disk cut the newest short."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyarrow import fs as pafs

from search.study.snapshot import LAST_GOOD, SnapshotKeeper, restore_last_good, snapshot_files
from trainers.errors import ConfigError

SESSION = "2026-11-28_10-01-36"


def _write_snapshot(folder: Path, trials: int, *, made: int | None = None, session: str = SESSION,
                    state_text: str | None = None) -> None:
    """Tune's files of a snapshot: the trials (``trials`` of them) and the searcher's (``made``)."""
    state = folder / f"experiment_state-{session}.json"
    state.write_text(state_text if state_text is not None else json.dumps({"trial_data": [["{}", "{}"]] * trials}))
    (folder / f"search_gen_state-{session}.json").write_bytes(pickle.dumps({"counter": trials if made is None else made}))
    (folder / f"searcher-state-{session}.pkl").write_bytes(b"searcher")


def _step(keeper: SnapshotKeeper, folder: Path, filesystem=None) -> None:
    storage = SimpleNamespace(experiment_fs_path=str(folder), storage_filesystem=filesystem or pafs.LocalFileSystem())
    keeper.on_step_end(iteration=0, trials=[SimpleNamespace(storage=storage)])


def _counter(path: Path) -> int:
    return pickle.loads(path.read_bytes())["counter"]


def test_the_keeper_copies_complete_snapshots_only(tmp_path):
    keeper = SnapshotKeeper()
    _step(keeper, tmp_path)  # nothing written yet: nothing kept
    assert not (tmp_path / LAST_GOOD).exists()
    _write_snapshot(tmp_path, 1)
    _step(keeper, tmp_path)
    kept = snapshot_files(tmp_path / LAST_GOOD)
    assert [f.name for f in kept] == [f.name for f in snapshot_files(tmp_path)]
    assert json.loads(kept[0].read_text())["trial_data"] == [["{}", "{}"]]

    # copied half: the trials' file new, the searcher's not yet (it made 1, the file lists 2): not kept
    state = tmp_path / f"experiment_state-{SESSION}.json"
    _write_snapshot(tmp_path, 2, made=1)
    _step(keeper, tmp_path)
    assert len(json.loads((tmp_path / LAST_GOOD / state.name).read_text())["trial_data"]) == 1
    _write_snapshot(tmp_path, 2)  # the copy done: kept
    _step(keeper, tmp_path)
    assert _counter(tmp_path / LAST_GOOD / f"search_gen_state-{SESSION}.json") == 2

    # a state cut short (the disk filled while Tune wrote it): the good copy stays
    _write_snapshot(tmp_path, 3, state_text='{"trial_data": [["{\\n  \\"stub')
    _step(keeper, tmp_path)
    assert len(json.loads((tmp_path / LAST_GOOD / state.name).read_text())["trial_data"]) == 2
    assert not list(tmp_path.glob(LAST_GOOD + ".*"))

    # a study at a URI is not watched (Tune uploads whole snapshots only)
    other = tmp_path / "uri"
    other.mkdir()
    _write_snapshot(other, 1)
    _step(SnapshotKeeper(), other, filesystem=pafs.SubTreeFileSystem(str(other), pafs.LocalFileSystem()))
    assert not (other / LAST_GOOD).exists()


def test_a_resume_puts_the_last_complete_snapshot_back(tmp_path):
    keeper = SnapshotKeeper()
    _write_snapshot(tmp_path, 2)
    _step(keeper, tmp_path)
    assert restore_last_good(tmp_path) is None  # the newest reads whole: nothing to do

    _write_snapshot(tmp_path, 3, state_text='{"trial_data": [["{\\n  \\"stub')  # cut short, same session
    _write_snapshot(tmp_path, 3, session="2026-11-28_10-09-00", state_text="{")  # and a later session's
    said = restore_last_good(tmp_path)
    assert said and "cut short" in said and "resuming from the last complete one (2 trials)" in said
    files = snapshot_files(tmp_path)
    assert files[0].name == f"experiment_state-{SESSION}.json"
    assert len(json.loads(files[0].read_text())["trial_data"]) == 2
    assert _counter(tmp_path / f"search_gen_state-{SESSION}.json") == 2
    damaged = sorted(p.name for p in (tmp_path / ".damaged").iterdir())  # moved aside, not deleted
    assert damaged == sorted([f"experiment_state-{SESSION}.json", f"search_gen_state-{SESSION}.json",
                              f"searcher-state-{SESSION}.pkl", "experiment_state-2026-11-28_10-09-00.json",
                              "search_gen_state-2026-11-28_10-09-00.json", "searcher-state-2026-11-28_10-09-00.pkl"])
    assert restore_last_good(tmp_path) is None


def test_a_cut_snapshot_without_a_copy_is_one_line(tmp_path):
    _write_snapshot(tmp_path, 1, state_text="{")
    with pytest.raises(ConfigError, match="cut short .* no complete copy was kept, .* --name NEW_NAME"):
        restore_last_good(tmp_path)


def test_an_error_pickle_a_full_disk_left_empty_is_dropped_and_the_others_kept(tmp_path):
    from search.study.snapshot import drop_cut_error_pickles

    (tmp_path / "t1").mkdir()
    (tmp_path / "t2").mkdir()
    (tmp_path / "t1" / "error.pkl").write_bytes(b"")  # cut off by the full disk
    (tmp_path / "t1" / "error.txt").write_text("OSError: [Errno 28] No space left on device")
    (tmp_path / "t2" / "error.pkl").write_bytes(b"\x80\x04N.")  # a whole pickle stays
    assert drop_cut_error_pickles(tmp_path) == 1
    assert not (tmp_path / "t1" / "error.pkl").exists() and (tmp_path / "t1" / "error.txt").exists()
    assert (tmp_path / "t2" / "error.pkl").exists() and drop_cut_error_pickles(tmp_path) == 0

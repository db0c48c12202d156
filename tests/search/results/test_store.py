"""The results store: typed Parquet files, written whole, readable without this project."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from search.results.store import EPOCH_COLUMNS, PROGRESS_COLUMNS, TRIAL_COLUMNS, ResultsStore

ROOT = Path(__file__).resolve().parents[3]

SPACE = {
    "locality_strength": {"type": "uniform", "low": 0.1, "high": 3.0},
    "local_up_to_layer": {"type": "int", "low": 0, "high": 6},
    "act": {"type": "choice", "values": ["gelu", "relu"]},
}
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]


def _trial(i: int, state: str, acc: float | None, tput: float | None) -> dict:
    now = dt.datetime.now(dt.timezone.utc)
    return {
        "trial_id": f"t{i}", "trial_name": f"t{i}_x", "experiment": "e", "model": "m", "family": "convit",
        "state": state, "stop_reason": "max_epochs", "epochs_run": 2, "val_acc": acc, "throughput": tput,
        "params": 1000 + i, "flops": 10**6, "seed": 0, "started_at": now, "ended_at": now, "duration_s": 1.0,
    }


def test_files_round_trip_through_independent_readers(tmp_path):
    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    store.flush()
    for name in ("trials", "epochs", "pareto"):
        table = pq.read_table(tmp_path / f"{name}.parquet")
        assert table.num_rows == 0  # empty but typed from the start
    store.add_epoch({"trial_id": "t0", "epoch": 1, "val_acc": 0.5, "reported_at": dt.datetime.now(dt.timezone.utc)})
    store.add_trial(_trial(0, "COMPLETE", 0.9, 100.0), {"locality_strength": 1.5, "local_up_to_layer": 3, "act": "gelu"})
    store.add_trial(_trial(1, "COMPLETE", 0.8, 50.0), {"locality_strength": 0.5, "local_up_to_layer": 0, "act": "relu"})
    store.add_trial(_trial(2, "PRUNED", 0.99, 1e6), {"locality_strength": 0.2, "local_up_to_layer": 1, "act": "relu"})
    store.add_trial(_trial(3, "FAILED", None, None) | {"error": "NonFiniteLossError: nan"}, {"locality_strength": 2.0, "local_up_to_layer": 2, "act": "gelu"})
    store.flush()

    con = duckdb.connect()
    rows = con.execute(f"select trial_id, state, val_acc, local_up_to_layer from '{tmp_path}/trials.parquet' order by trial_id").fetchall()
    assert rows == [("t0", "COMPLETE", 0.9, 3), ("t1", "COMPLETE", 0.8, 0), ("t2", "PRUNED", 0.99, 1), ("t3", "FAILED", None, 2)]
    # Only COMPLETE trials compete for the front; the pruned one is not there despite its numbers.
    front = con.execute(f"select trial_id from '{tmp_path}/pareto.parquet'").fetchall()
    assert front == [("t0",)]
    schema = pq.read_schema(tmp_path / "trials.parquet")
    assert set(TRIAL_COLUMNS) <= set(schema.names)
    assert str(schema.field("local_up_to_layer").type) == "int64"
    assert str(schema.field("act").type) == "string"
    assert set(pq.read_schema(tmp_path / "epochs.parquet").names) == set(EPOCH_COLUMNS)


def test_a_models_mechanisms_round_trip_as_a_map_per_epoch_and_survive_a_resume(tmp_path):
    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    gates = {"gate.0.0": 0.73, "gate.0.1": 0.2}
    store.add_epoch({"trial_id": "t0", "epoch": 1, "val_acc": 0.5, "mechanisms": gates})
    store.add_epoch({"trial_id": "t1", "epoch": 1, "val_acc": 0.5, "mechanisms": None})  # a model without them
    store.flush()
    con = duckdb.connect()  # a reader that knows nothing of this project
    rows = con.execute(f"select trial_id, mechanisms['gate.0.0'] from '{tmp_path}/epochs.parquet' order by trial_id")
    assert rows.fetchall() == [("t0", 0.73), ("t1", None)]
    again = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)  # a resumed driver takes the rows up
    again.load_existing()
    again.add_epoch({"trial_id": "t0", "epoch": 2, "val_acc": 0.6, "mechanisms": {"gate.0.0": 0.5}})
    again.flush()
    table = pq.read_table(tmp_path / "epochs.parquet").to_pylist()
    assert {(r["trial_id"], r["epoch"]): r["mechanisms"] for r in table} == {
        ("t0", 1): list(gates.items()), ("t1", 1): None, ("t0", 2): [("gate.0.0", 0.5)]}


def test_space_keys_may_not_shadow_result_columns(tmp_path):
    with pytest.raises(ValueError, match="clash"):
        ResultsStore(tmp_path, space={"params": {"type": "int", "low": 1, "high": 2}}, objectives=OBJECTIVES)


def test_readers_never_see_a_partial_file(tmp_path):
    """A reader polling while the writer rewrites the files only ever opens whole files."""
    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    store.flush()
    stop = threading.Event()
    seen, errors = [], []

    def reader():
        while not stop.is_set():
            try:
                with pa.OSFile(str(tmp_path / "trials.parquet")) as handle:  # one open: one version
                    seen.append(pq.read_table(handle).num_rows)
            except Exception as exc:  # a half-written file would land here
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(60):
        store.add_trial(_trial(i, "COMPLETE", 0.5 + i / 1000, 100.0 - i), {"locality_strength": 1.0, "local_up_to_layer": 1, "act": "gelu"})
        store.flush()
    stop.set()
    thread.join()
    assert not errors
    assert seen == sorted(seen) and seen[-1] <= 60
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary files left behind


def test_a_script_that_reads_the_store_exits_cleanly(tmp_path):
    """search's reader opens the file with pyarrow, not as a Python file object: with one, pyarrow
    26 closes it from a thread still running at interpreter exit, and the script aborted (exit
    134, "terminate called without an active exception") in about 4 runs of 5 here."""
    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    store.add_trial(_trial(0, "COMPLETE", 0.9, 100.0), {"locality_strength": 1.0, "local_up_to_layer": 3, "act": "gelu"})
    store.flush()
    # exits right after the read (the abort needs the reader's thread still busy: a print after
    # the read gave it time and hid the bug)
    script = "import sys; from search.results.store import read_table; sys.exit(read_table(sys.argv[1]).num_rows != 1)"
    for _ in range(5):
        run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "trials.parquet")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert (run.returncode, run.stderr) == (0, "")


def test_docs_document_every_column():
    readme = (ROOT / "docs" / "store.md").read_text()
    for name, (typ, meaning) in [*TRIAL_COLUMNS.items(), *EPOCH_COLUMNS.items(), *PROGRESS_COLUMNS.items()]:
        assert f"| `{name}` | {typ} | {meaning} |" in readme, f"docs/store.md's schema tables lack {name}"


def test_conditional_knobs_are_null_where_they_do_not_apply(tmp_path):
    space = {"locality_strength": {"type": "uniform", "low": 0.1, "high": 3.0},
             "num_kernels": {"type": "int", "low": 1, "high": 5},
             "model": {"type": "choice", "values": ["a", "b"]}}
    store = ResultsStore(tmp_path, space=space, objectives=OBJECTIVES)
    store.add_trial(_trial(0, "COMPLETE", 0.9, 10.0) | {"model": "ls_convit_micro"}, {"model": "ls_convit_micro", "locality_strength": 1.0})
    store.add_trial(_trial(1, "COMPLETE", 0.8, 20.0) | {"model": "ls_gmm_micro"}, {"model": "ls_gmm_micro", "num_kernels": 3})
    store.flush()
    rows = duckdb.connect().execute(
        f"select model, locality_strength, num_kernels from '{tmp_path}/trials.parquet' order by trial_id").fetchall()
    assert rows == [("ls_convit_micro", 1.0, None), ("ls_gmm_micro", None, 3)]


def test_a_trial_recorded_again_as_it_ended_keeps_its_progress_row(tmp_path):
    """A resumed study's Tune re-reports a trial the killed driver had recorded; other trials may
    have finished meanwhile. Its progress row stays the one of when it first finished."""
    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    for i, acc in enumerate((0.7, 0.8, 0.75)):
        store.add_trial(_trial(i, "COMPLETE", acc, 100.0 * (i + 1)), {})
        store.add_progress(trial_id=f"t{i}", state="COMPLETE", elapsed_s=float(i), at=None)
    store.add_trial(_trial(1, "COMPLETE", 0.8, 200.0), {})  # t1 again, after t2
    store.add_progress(trial_id="t1", state="COMPLETE", elapsed_s=9.0, at=None)
    store.flush()
    rows = pq.read_table(tmp_path / "progress.parquet").to_pylist()
    assert sorted((r["trial_id"], r["finished"], r["elapsed_s"]) for r in rows) == [
        ("t0", 1, 0.0), ("t1", 2, 1.0), ("t2", 3, 2.0)]
    store.add_trial(_trial(1, "PRUNED", None, 200.0), {})  # a changed end is a new standing
    assert store.add_progress(trial_id="t1", state="PRUNED", elapsed_s=9.0, at=None)["finished"] == 3

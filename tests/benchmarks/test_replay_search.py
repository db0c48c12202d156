"""The search-efficiency replay (benchmarks.replay_search) on a small made-up recording: budgets
are kept, fronts hold only full-budget trials, and the recording's points are what is searched."""

from __future__ import annotations

import itertools

import pyarrow as pa
import pytest

from benchmarks.record_curves import schema
from benchmarks.replay_search import METHODS, at_epochs, epochs_to_reach, load_curves, replay
from search.results.hypervolume import hypervolume
from search.results.store import write_atomic

GRID = {"depth": [1, 2, 3], "embed_dim": [16, 32], "lr": [0.001, 0.004]}
EPOCHS = 4


def _recording(tmp_path):
    rows = []
    for config_id, (depth, width, lr) in enumerate(itertools.product(*GRID.values())):
        final = 0.5 + 0.05 * depth + 0.001 * width + (0.02 if lr > 0.002 else 0.0)
        for epoch in range(1, EPOCHS + 1):
            acc = final * epoch / EPOCHS
            rows.append({"config_id": config_id, "depth": depth, "embed_dim": width, "lr": lr, "epoch": epoch,
                         "max_epochs": EPOCHS, "val_acc": acc, "best_val_acc": acc, "val_loss": 1 - acc,
                         "params": depth * width, "throughput": 1e5 / (depth * width), "epoch_time_s": 1.0,
                         "throughput_device": "cpu: test"})
    path = tmp_path / "curves.parquet"
    write_atomic(pa.Table.from_pylist(rows, schema=schema(GRID)), path)
    return path


@pytest.mark.parametrize("method", [m for m in METHODS if not m.startswith("syne")])
def test_every_method_keeps_the_budget_and_fronts_hold_full_budget_trials_only(tmp_path, method):
    curves, epochs = load_curves(_recording(tmp_path), GRID)
    assert len(curves) == 12 and epochs == EPOCHS
    finals = [[c["best"][-1], c["log_throughput"]] for c in curves.values()]
    reference = [min(p[0] for p in finals), min(p[1] for p in finals)]
    true = hypervolume(finals, modes=["max", "max"], reference=reference)
    history = replay(method, curves=curves, grid=GRID, epochs=epochs, budget=6 * EPOCHS, seed=3, reference=reference)
    spent = [s for s, _ in history]
    assert spent == sorted(spent) and spent[-1] == 6 * EPOCHS  # the budget, all of it, no more
    assert all(0.0 <= v <= true * (1 + 1e-9) for _, v in history)
    if "ASHA" not in method:  # no early stopping: every trial runs the full budget
        assert spent == [EPOCHS * (i + 1) for i in range(6)]
    assert at_epochs(history, 0) == 0.0 and at_epochs(history, spent[-1]) == history[-1][1]
    assert epochs_to_reach(history, history[-1][1]) <= spent[-1] and epochs_to_reach(history, 2 * true) is None


def test_a_search_is_the_same_for_the_same_seed(tmp_path):
    curves, epochs = load_curves(_recording(tmp_path), GRID)
    runs = [replay("tpe+MO-ASHA", curves=curves, grid=GRID, epochs=epochs, budget=40, seed=1, reference=[0.0, 0.0])
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_syne_tune_reads_its_rung_ranking_as_indices_and_the_fix_as_ranks():
    pytest.importorskip("syne_tune")
    from benchmarks.replay_search import syne_tune_ranking_check

    assert syne_tune_ranking_check() == {"as shipped": "STOP", "fixed": "CONTINUE"}

"""The kill soak, short: one small real study SIGKILLed at a random moment and resumed,
checked (trial count, no duplicate epochs, states, readable files, the Optuna journal). The soak
itself (`python -m benchmarks kill_soak --runs N`) runs many; see benchmarks/kill_soak.py."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.kill_soak import PHASES, check_study, soak

pytestmark = pytest.mark.ray


@pytest.mark.ray(seconds=75)
def test_a_random_kill_resumes_to_a_whole_study(tmp_path):
    result = soak(1, trials=2, max_epochs=1, window=25.0, seed=61, poll=0.05, folder=tmp_path)
    assert result["failures"] == [], result["failures"]
    assert sum(result["phases"].values()) == 1 and set(result["phases"]) == set(PHASES)
    assert all(r["polls"] > 0 for r in result["records"])

    # the checks can fail: the same study with one epoch row twice, or a trial missing
    record = result["records"][-1]
    study, name = Path(record["study"]), Path(record["study"]).name
    assert check_study(study, name, 2, 1) == []
    epochs = pq.read_table(study / "epochs.parquet")
    pq.write_table(pa.concat_tables([epochs, epochs.slice(0, 1)]), study / "epochs.parquet")
    assert any("duplicate (trial_id, epoch)" in p for p in check_study(study, name, 2, 1))
    assert any("3 requested" in p for p in check_study(study, name, 3, 1))

"""benchmarks.trial_profile: a warm trial profiled, with the loader's hand-out as its own range."""

import gzip
import json

import pytest

from benchmarks.trial_profile import trial_profile


@pytest.mark.ffcv
def test_a_profiled_trial_splits_host_time_and_writes_its_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache"))
    trace = tmp_path / "trace.json.gz"
    r = trial_profile(device="cpu", model="ls_convit_nano", dataset="synthetic", train_fraction=0.5, epochs=1,
                      batch_size=64, num_workers=1, compile=False, cuda_graph=False, trace=str(trace))
    steps = r["training_steps"]
    assert steps == r["config"]["train_images"] // 64 >= 10  # the last partial batch dropped
    assert r["next_batch"]["calls"] == steps + 1  # one hand-out per step, and the epoch's end
    assert r["next_batch"]["cpu_total_ms"] > 0
    names = [row["name"] for row in r["top_host"]]
    assert any("adamw" in name.lower() for name in names)  # the optimizer's step is among the costs
    epoch, = r["epochs"]
    assert 0 <= epoch["train_loader_wait_s"] <= epoch["train_time_s"] <= epoch["epoch_time_s"]
    assert r["host_ms_per_training_step"] == pytest.approx(1e3 * epoch["train_time_s"] / steps)
    assert len(r["loader_alone_images_per_s"]) == 3 and min(r["loader_alone_images_per_s"]) > 0
    assert "top_gpu" not in r  # a CPU trial
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "ls::next_batch" for e in events)

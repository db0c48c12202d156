"""Throughput measured on different devices never shares a front unless the user asks."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import search
from search import ResultsStore
from search.results.pareto import device_groups, pareto_mask
from trainers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
META = {"name": "two_devices", "objectives": [list(o) for o in OBJECTIVES],
        "spec": {"name": "two_devices", "objectives": [{"metric": m, "mode": mode} for m, mode in OBJECTIVES]}}
GPU, CPU = "NVIDIA H100 80GB HBM3", "Intel(R) Xeon(R) Processor"
# trial, device, val_acc, throughput: every GPU trial is faster than every CPU trial, so one
# mixed front would hold only GPU trials (and the CPU's best-accuracy trial).
TRIALS = [
    ("g0", GPU, 0.90, 9000.0),
    ("g1", GPU, 0.80, 12000.0),
    ("g2", GPU, 0.70, 11000.0),  # dominated by g1 on the GPU
    ("c0", CPU, 0.95, 400.0),
    ("c1", CPU, 0.85, 800.0),
    ("c2", CPU, 0.75, 700.0),  # dominated by c1 on the CPU
]


def _study(tmp_path: Path) -> Path:
    store = ResultsStore(tmp_path, space={}, objectives=OBJECTIVES, reference=[0.0, 0.0])
    now = dt.datetime.now(dt.timezone.utc)
    for trial_id, device, acc, tput in TRIALS:
        store.add_trial({"trial_id": trial_id, "state": "COMPLETE", "val_acc": acc, "throughput": tput,
                         "throughput_device": device}, {})
        store.add_progress(trial_id=trial_id, state="COMPLETE", elapsed_s=1.0, at=now)
    store.flush()
    (tmp_path / "experiment.json").write_text(json.dumps(META))
    return tmp_path


def test_group_masks_are_the_union_of_per_group_fronts():
    rng = np.random.default_rng(0)
    values = rng.random((200, 2))
    groups = rng.choice(["a", "b", "c"], size=200)
    mask = pareto_mask(values, modes=["max", "max"], groups=groups)
    for g in "abc":
        rows = groups == g
        assert (mask[rows] == pareto_mask(values[rows], modes=["max", "max"])).all()
    assert device_groups(["a", "a"], OBJECTIVES) is None  # one device: nothing to split
    assert device_groups(["a", "b"], [("val_acc", "max"), ("params", "min")]) is None  # no device metric
    assert device_groups(["a", "b"], OBJECTIVES, mix_devices=True) is None
    assert list(device_groups(["a", None], OBJECTIVES)) == ["a", ""]


def test_front_is_one_per_device(tmp_path):
    exp = search.load(_study(tmp_path))
    assert exp.devices == [GPU, CPU] or exp.devices == [CPU, GPU]
    front = exp.front()
    assert sorted(front["trial_id"]) == ["c0", "c1", "g0", "g1"]
    assert list(front["throughput_device"]) == sorted(front["throughput_device"])  # grouped by device
    mixed = exp.front(mix_devices=True)
    assert sorted(mixed["trial_id"]) == ["c0", "g0", "g1"]  # the CPU's fast trials lose to the GPU's
    assert sorted(exp.front(device=CPU)["trial_id"]) == ["c0", "c1"]
    with pytest.raises(ConfigError, match="2 devices"):
        exp.select(rule="knee")
    assert exp.select(rule="max-acc", device=GPU)["trial_id"] == "g0"
    with pytest.raises(ConfigError, match="--device NAME"):
        exp.hypervolume(reference=[0.0, 0.0])
    assert exp.hypervolume(reference=[0.0, 0.0], device=CPU) == pytest.approx(0.95 * 400 + 0.85 * 400)
    with pytest.raises(ConfigError, match="no trial was measured there"):
        exp.front(device="TPU")


def test_store_files_split_by_device(tmp_path):
    _study(tmp_path)
    pareto = pq.read_table(tmp_path / "pareto.parquet").to_pylist()
    assert sorted(r["trial_id"] for r in pareto) == ["c0", "c1", "g0", "g1"]
    last = pq.read_table(tmp_path / "progress.parquet").to_pylist()[-1]
    assert last["front_size"] == 4
    # 3 trials each: the first device to reach 3 (the GPU) is the main one
    assert last["hypervolume_device"] == GPU
    assert last["hypervolume"] == pytest.approx(0.9 * 9000 + 0.8 * 3000)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "search", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_pareto_per_device(tmp_path):
    study = str(_study(tmp_path))
    out = _cli("pareto", study)
    assert out.returncode == 0, out.stderr
    assert "2 fronts, one per device" in out.stdout
    assert "c1" in out.stdout and "g1" in out.stdout
    out = _cli("pareto", study, "--select", "knee")
    assert out.returncode == 2 and "--device NAME" in out.stderr and "Traceback" not in out.stderr
    out = _cli("pareto", study, "--device", CPU, "--select", "max-throughput", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["trial_id"] == "c1"
    out = _cli("pareto", study, "--mix-devices", "--format", "json")
    assert sorted(r["trial_id"] for r in json.loads(out.stdout)) == ["c0", "g0", "g1"]

"""The GPU study's device script at a tiny size on the CPU, so it cannot rot between GPU sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchmarks.gpu_study import derived_spec, main, summarise_packings
from search.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spaces" / "convit_locality.yaml"


def _derived(tmp_path: Path, **overrides) -> Path:
    source = yaml.safe_load(SPEC.read_text())
    args = dict(profile="gpu", packing=4, device="cuda", cpus=16, trials=64, max_epochs=12, grace_epochs=2,
                time_limit_s=200, smoke=False) | overrides
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(derived_spec(source, **args), sort_keys=False))
    return path


def test_a_packing_shares_the_gpu_and_the_host_cpus_and_keeps_the_profile_valid(tmp_path):
    spec = load_spec(_derived(tmp_path), profile="gpu")
    assert spec.resources.gpus == 0.25 and spec.resources.cpus == 4
    assert (spec.budget.trials, spec.budget.max_epochs, spec.budget.grace_epochs) == (64, 12, 2)
    assert spec.budget.time_limit_s == 200
    assert spec.dataset.train_fraction == 1.0 and "patch_size" in spec.all_params()  # the profile's own study
    one = load_spec(_derived(tmp_path, packing=1), profile="gpu")
    assert one.resources.gpus == 1.0 and one.resources.cpus == 16


def test_the_smoke_variant_is_synthetic_and_on_the_cpu(tmp_path):
    spec = load_spec(_derived(tmp_path, smoke=True, device="cpu", cpus=2, packing=2), profile="gpu")
    assert spec.dataset.name == "synthetic" and spec.resources.gpus == 0 and spec.resources.cpus == 1
    assert "patch_size" not in spec.all_params()  # the base space: small models


def test_the_packings_summary_says_whether_the_targets_hold():
    runs = [{"packing": 1, "trials_per_hour": 100.0, "gpu_busy_pct": {"whole_run": 60.0}},
            {"packing": 4, "trials_per_hour": 170.0, "gpu_busy_pct": {"whole_run": 85.0}}]
    summary = summarise_packings(runs)
    assert summary["trials_per_hour_vs_first"] == {"1": 1.0, "4": 1.7}
    assert summary["packing_target_1_5x_met"] is True and summary["gpu_busy_target_80_met"] is True
    cpu = summarise_packings([{"packing": 2, "trials_per_hour": 50.0, "gpu_busy_pct": {"whole_run": None}}])
    assert cpu["gpu_busy_target_80_met"] is None and cpu["packing_target_1_5x_met"] is None


def test_the_dry_run_checks_each_packing(capsys):
    main(["--dry-run", "--cpus", "16"])
    out = capsys.readouterr().out
    assert "each trial asks for 16 CPUs, 1 GPU" in out
    assert "each trial asks for 4 CPUs, 0.25 GPU (4 trials share a GPU)" in out


@pytest.mark.ray(seconds=60)
@pytest.mark.ffcv
def test_the_study_runs_at_a_tiny_size_on_the_cpu(tmp_path):
    main(["--results-dir", str(tmp_path), "--smoke", "--packings", "2", "--trials", "2", "--max-epochs", "1", "--grace-epochs", "1",
          "--cpus", "2", "--time-limit-s", "600"])
    (path,) = tmp_path.glob("gpu_study-*.json")
    record = json.loads(path.read_text())
    (run,) = record["runs"]
    assert run["packing"] == 2 and run["resources"] == {"cpus": 1, "gpus": 0}
    assert run["trials"]["finished"] == 2 and run["trials_per_hour"] > 0
    assert run["front_size"] >= 1 and run["hypervolume"] > 0 and 0 < run["best_val_acc"] <= 1
    assert run["gpu_busy_pct"]["whole_run"] is None  # no GPU sampled on the CPU
    assert run["seconds"]["to_first_epoch_start"] is not None

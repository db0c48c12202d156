"""Throughput first: constraints reject a configuration before training, measurements are cached
per architecture, only full-budget trials count as done, and progress.parquet tracks the front."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import timm
import torch
import yaml

import trainers.models  # noqa: F401
from search.results.hypervolume import hypervolume
from search.results.store import PROGRESS_COLUMNS, ResultsStore
from search.study.searcher import optuna_state_for
from trainers import throughput
from trainers.config import Constraint, SettingError, ThroughputSettings, TrainSettings, TrialConfig
from trainers.data import DatasetRequest, prepare_dataset
from trainers.throughput import architecture_fingerprint, implementation_fingerprint, measure_model, measure_throughput
from trainers.train import train_trial

ROOT = Path(__file__).resolve().parents[3]


# -- constraints ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,value,violated", [
    ("throughput >= 5000", 6000.0, False),
    ("throughput >= 5000", 4000.0, True),
    ("params <= 5e6", 5e6, False),
    ("params<5e6", 5e6, True),
    ("flops > 1e6", 2e6, False),
])
def test_constraint_parse_and_check(text, value, violated):
    c = Constraint.parse(text)
    assert (c.violation(value) > 0) == violated
    assert Constraint.parse(str(c)) == c


def test_constraint_violation_grows_with_the_distance():
    c = Constraint.parse("throughput >= 1000")
    assert c.violation(900) == pytest.approx(0.1) and c.violation(500) == pytest.approx(0.5)


@pytest.mark.parametrize("text,match", [
    ("val_acc >= 0.9", "not known before training"),
    ("throughput => 5", "not a constraint"),
    ("throughput >= lots", "not a constraint"),
    ("__import__('os').system('x') > 1", "not a constraint"),
    ("params <= inf", "not a constraint"),
    ("params <= 1e999", "finite"),
])
def test_bad_constraints_name_the_fix(text, match):
    with pytest.raises(SettingError, match=match):
        Constraint.parse(text)


# -- the per-architecture measurement cache ------------------------------------------------

def test_fingerprint_ignores_training_knobs_and_sees_architecture():
    base = architecture_fingerprint(timm.create_model("ls_convit_nano", locality_strength=1.0, gate_lr_mult=1.0))
    assert architecture_fingerprint(timm.create_model("ls_convit_nano", locality_strength=2.5, gate_lr_mult=9.0)) == base
    assert architecture_fingerprint(timm.create_model("ls_convit_nano", depth=3)) != base
    assert architecture_fingerprint(timm.create_model("ls_convit_nano", local_up_to_layer=0)) != base
    tcnn = timm.create_model("ls_tcnn_nano", reparam_epoch=1)
    cnn_print = architecture_fingerprint(tcnn)
    assert architecture_fingerprint(timm.create_model("ls_tcnn_nano", reparam_epoch=2, reparam_alpha=5.0)) == cnn_print
    tcnn.reparametrise()
    assert architecture_fingerprint(tcnn) != cnn_print


def test_measure_model_caches_per_architecture(tmp_path):
    kwargs = dict(input_shape=(1, 28, 28), batch_size=8, warmup=1, repeats=2, cache_dir=tmp_path)
    first = measure_model(timm.create_model("ls_convit_nano", locality_strength=1.0), **kwargs)
    again = measure_model(timm.create_model("ls_convit_nano", locality_strength=2.0), **kwargs)
    other = measure_model(timm.create_model("ls_convit_nano", depth=3), **kwargs)
    assert not first["throughput_cached"] and again["throughput_cached"] and not other["throughput_cached"]
    assert again["throughput"] == first["throughput"] and again["params"] == first["params"]
    assert other["params"] > first["params"]
    bigger_batch = measure_model(timm.create_model("ls_convit_nano"), **{**kwargs, "batch_size": 16})
    assert not bigger_batch["throughput_cached"]  # another measurement setting: another entry
    assert len(list(tmp_path.glob("*.json"))) == 3
    uncached = measure_model(timm.create_model("ls_convit_nano"), **{**kwargs, "cache_dir": None})
    assert not uncached["throughput_cached"]


def _scripted_rounds(monkeypatch, rounds, beside=()):
    """Replace the timed rounds: `rounds` (seconds per batch, CPU share) for a model timed on its
    own, in order; `beside` (model's seconds, reference's seconds, share) for one timed beside a
    reference. Returns the seconds per batch of the rounds timed alone, as they are timed."""
    alone, beside = iter(rounds), iter(beside)
    calls = []

    def timed_round(model, x, repeats, device, reference=None):
        if reference is None:
            per_batch, share = next(alone)
            calls.append(per_batch)
            return [per_batch] * repeats, [], share
        per_batch, reference_per_batch, share = next(beside)
        return [per_batch] * repeats, [reference_per_batch] * repeats, share

    monkeypatch.setattr(throughput, "_timed_round", timed_round)
    monkeypatch.setattr(throughput, "CPU_RETRY_PAUSE_S", 0.0)
    return calls


def test_cpu_throughput_is_timed_again_when_another_process_took_cores(monkeypatch):
    """A round timed while another process held a core (the share of CPU time this process got is
    below the floor: Ray starting beside a study's first trial halved one measurement) does not
    count: CPU_ROUNDS rounds with the CPU to itself are timed after it, and the fastest is kept."""
    calls = _scripted_rounds(monkeypatch, [(0.4, 0.64), (0.2, 0.99), (0.15, 1.0), (0.3, 0.95), (0.01, 1.0)])
    result = measure_throughput(timm.create_model("ls_convit_nano"), input_shape=(1, 28, 28), batch_size=8,
                                warmup=0, repeats=3)
    assert throughput.CPU_ROUNDS == 3 and calls == [0.4, 0.2, 0.15, 0.3]  # stopped at the third uncontended round
    assert result.images_per_s == pytest.approx(8 / 0.15) and result.kept_round == 3 and result.cpu_share == 1.0
    assert result.rounds == 4


def test_cpu_throughput_is_the_fastest_round_so_a_slow_phase_does_not_set_it(monkeypatch):
    """A VM's slow phase (a round 2.4x slower, the CPU share unchanged, as one measured here) is
    outvoted by the rounds around it."""
    calls = _scripted_rounds(monkeypatch, [(0.242, 0.99), (0.098, 0.98), (0.101, 0.99), (0.001, 1.0)])
    result = measure_throughput(timm.create_model("ls_convit_nano"), input_shape=(1, 28, 28), batch_size=8,
                                warmup=0, repeats=3)
    assert calls == [0.242, 0.098, 0.101]
    assert result.images_per_s == pytest.approx(8 / 0.098) and result.kept_round == 2 and result.rounds == 3


def test_cpu_throughput_keeps_the_fastest_round_when_the_cpu_stays_busy(monkeypatch):
    calls = _scripted_rounds(monkeypatch, [(0.5, 0.6), (0.3, 0.7), (0.4, 0.6), (0.35, 0.6), (0.45, 0.6), (0.33, 0.6),
                                           (0.1, 1.0)])
    result = throughput.measure_throughput(timm.create_model("ls_convit_nano"), input_shape=(1, 28, 28),
                                           batch_size=8, warmup=0, repeats=3)
    assert len(calls) == throughput.CPU_ATTEMPTS == 6  # bounded: a busy machine costs a few rounds, not more
    assert result.images_per_s == pytest.approx(8 / 0.3) and result.kept_round == 2 and result.cpu_share == 0.7


def test_cost_ratio_to_the_reference_is_the_median_over_counted_rounds(monkeypatch):
    """A slow phase slows both alike (round 2: both 2x), and a contended round does not count."""
    _scripted_rounds(monkeypatch, [], [(0.2, 0.1, 0.99), (0.4, 0.2, 0.98), (0.9, 0.1, 0.5), (0.21, 0.1, 0.99)])
    result = measure_throughput(timm.create_model("ls_convit_nano"), input_shape=(1, 28, 28), batch_size=8,
                                warmup=0, repeats=3, reference=timm.create_model("ls_convit_nano", depth=3))
    assert result.rounds == 4 and result.reference_ratio == pytest.approx(2.0)
    assert result.images_per_s == pytest.approx(8 / 0.2)  # as timed: its own fastest round


def test_a_model_timed_beside_the_reference_gets_the_reference_number_over_their_cost_ratio(tmp_path, monkeypatch):
    """The reference is measured on its own once (80 img/s); a model timed later, in a phase where
    both ran 1.5x slow, costs 2x the reference: 40 img/s, though its own rounds read 26.7."""
    _scripted_rounds(monkeypatch, [(0.1, 1.0)] * 6, beside=[(0.3, 0.15, 1.0)] * 6)
    kwargs = dict(input_shape=(1, 28, 28), batch_size=8, warmup=0, repeats=3, cache_dir=tmp_path)
    reference = timm.create_model("ls_convit_nano")
    record = measure_model(timm.create_model("ls_convit_nano", depth=3), reference=reference, **kwargs)
    assert record["throughput"] == pytest.approx(40.0) and record["throughput_timed"] == pytest.approx(8 / 0.3)
    assert record["throughput_reference"] == architecture_fingerprint(reference) != record["architecture"]
    own = measure_model(timm.create_model("ls_convit_nano", locality_strength=2.0), reference=reference, **kwargs)
    assert own["throughput"] == pytest.approx(80.0) and own["throughput_cached"]  # the reference's own trial
    assert own["throughput_reference"] == own["architecture"]
    again = measure_model(timm.create_model("ls_convit_nano", depth=3), reference=reference, **kwargs)
    assert again["throughput_cached"] and again["throughput"] == record["throughput"]
    plain = measure_model(timm.create_model("ls_convit_nano", depth=3), **kwargs)  # alone: another entry
    assert not plain["throughput_cached"] and plain["throughput"] == pytest.approx(80.0)
    assert plain["throughput_reference"] is None


def test_a_reference_timed_in_a_slow_phase_is_timed_again_before_any_trial_uses_it(tmp_path, monkeypatch):
    """The reference's first timing falls in a 4x slow phase (20 img/s); beside the first model its
    own batches run at 80 img/s, so it is timed again (80) and the model, at 2x its cost, reads 40,
    not 10. The cache keeps the faster reference for the next trial; a cached reference is not
    re-checked (a study's trials keep one scale)."""
    _scripted_rounds(monkeypatch, [(0.4, 1.0)] * 3 + [(0.1, 1.0)] * 3, beside=[(0.2, 0.1, 1.0)] * 6)
    kwargs = dict(input_shape=(1, 28, 28), batch_size=8, warmup=0, repeats=3, cache_dir=tmp_path)
    reference = timm.create_model("ls_convit_nano")
    with pytest.warns(UserWarning, match="reference model read 20 img/s .* timed again: 80"):
        record = measure_model(timm.create_model("ls_convit_nano", depth=3), reference=reference, **kwargs)
    assert record["throughput"] == pytest.approx(40.0)
    own = measure_model(timm.create_model("ls_convit_nano", locality_strength=2.0), reference=reference, **kwargs)
    assert own["throughput_cached"] and own["throughput"] == pytest.approx(80.0)
    assert own["throughput_retimed_from"] == pytest.approx(20.0)
    again = measure_model(timm.create_model("ls_convit_nano", depth=3), reference=reference, **kwargs)
    assert again["throughput_cached"] and again["throughput"] == pytest.approx(40.0)


def test_a_reference_confirmed_beside_the_model_is_not_timed_again(tmp_path, monkeypatch):
    calls = _scripted_rounds(monkeypatch, [(0.1, 1.0)] * 3, beside=[(0.2, 0.09, 1.0)] * 3)  # 11% faster: noise
    kwargs = dict(input_shape=(1, 28, 28), batch_size=8, warmup=0, repeats=3, cache_dir=tmp_path)
    record = measure_model(timm.create_model("ls_convit_nano", depth=3), reference=timm.create_model("ls_convit_nano"),
                           **kwargs)
    assert len(calls) == 3 and record["throughput"] == pytest.approx(80.0 / (0.2 / 0.09))


def test_cpu_share_of_a_real_round(monkeypatch):
    """The share is measured, not assumed: a real round reports a positive share and which round it kept."""
    result = measure_throughput(timm.create_model("ls_convit_nano"), input_shape=(1, 28, 28), batch_size=8,
                                warmup=1, repeats=2)
    assert result.cpu_share > 0 and 1 <= result.kept_round <= result.rounds and result.images_per_s > 0
    assert throughput.CPU_ROUNDS <= result.rounds <= throughput.CPU_ATTEMPTS


def test_measure_model_measures_again_when_the_model_code_changes(tmp_path, monkeypatch):
    """A cached number belongs to the code that was timed: edit the model's source, get a new measurement."""
    source = tmp_path / "edited_model.py"
    source.write_text("import torch\n\nclass Edited(torch.nn.Linear):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_model

    kwargs = dict(input_shape=(1, 4, 4), batch_size=8, warmup=1, repeats=2, cache_dir=tmp_path / "cache")
    model = torch.nn.Sequential(torch.nn.Flatten(), edited_model.Edited(16, 3))
    first = measure_model(model, **kwargs)
    assert measure_model(model, **kwargs)["throughput_cached"]
    before = implementation_fingerprint(model)
    source.write_text(source.read_text() + "# a faster forward\n")
    assert implementation_fingerprint(model) != before
    again = measure_model(model, **kwargs)
    assert not first["throughput_cached"] and not again["throughput_cached"]
    assert implementation_fingerprint(timm.create_model("ls_convit_nano")) == implementation_fingerprint(
        timm.create_model("ls_convit_nano", locality_strength=2.0))


def test_the_c_kernels_are_part_of_the_implementation_fingerprint(tmp_path, monkeypatch):
    """The attention kernels are C++ the models compile at run time: a faster kernel is new code too."""
    sources = tmp_path / "kernels"
    shutil.copytree(throughput.KERNEL_SOURCES, sources, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(throughput, "KERNEL_SOURCES", sources)
    model = timm.create_model("ls_convit_nano")
    before = implementation_fingerprint(model)
    kernel = sources / "csrc" / "attention_core_fp32.cpp"
    kernel.write_text(kernel.read_text() + "// a faster kernel\n")
    assert implementation_fingerprint(model) != before


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return prepare_dataset(DatasetRequest(name="synthetic", val_fraction=0.2), cache_dir=tmp_path_factory.mktemp("cache"))


def test_a_rejected_trial_trains_nothing(synthetic, tmp_path):
    reports = []
    cfg = TrialConfig(model="ls_convit_nano", model_args={}, data=synthetic, epochs=3,
                      train=TrainSettings(batch_size=64, num_workers=1),
                      throughput=ThroughputSettings(batch_size=8, warmup=1, repeats=2),
                      constraints=(Constraint.parse("params <= 1000"),), throughput_cache_dir=str(tmp_path))
    outcome = train_trial(cfg, on_epoch=lambda metrics, get_state: reports.append((metrics, get_state)))
    assert outcome.epochs_run == 0 and outcome.stop_reason == "constraint"
    ((metrics, get_state),) = reports
    assert get_state is None and metrics["epoch"] == 0
    assert metrics["rejected"].startswith("params=") and "params <= 1000" in metrics["rejected"]
    assert metrics["constraint_violation"] > 0 and math.isnan(metrics["best_val_acc"])


def test_a_tcnn_is_judged_as_the_model_it_becomes(synthetic, tmp_path):
    # the CNN has fewer parameters than the converted model; a bound between them rejects a
    # trial that would convert, and accepts one that stays a CNN
    cnn = timm.create_model("ls_tcnn_nano", num_classes=4, in_chans=1)
    bound = sum(p.numel() for p in cnn.parameters()) + 1
    common = dict(data=synthetic, epochs=1, train=TrainSettings(batch_size=64, num_workers=1),
                  throughput=ThroughputSettings(batch_size=8, warmup=1, repeats=2),
                  constraints=(Constraint.parse(f"params <= {bound}"),), throughput_cache_dir=str(tmp_path))
    converting = train_trial(TrialConfig(model="ls_tcnn_nano", model_args={"reparam_fraction": 0.0}, **common))
    assert converting.stop_reason == "constraint"
    staying = train_trial(TrialConfig(model="ls_tcnn_nano", model_args={"reparam_fraction": 1.0}, **common))
    assert staying.stop_reason == "max_epochs" and staying.epochs_run == 1


# -- what Optuna is told ---------------------------------------------------------------------

METRICS = ["best_val_acc", "throughput"]


@pytest.mark.parametrize("result,error,expected", [
    ({"best_val_acc": 0.9, "throughput": 100.0, "stop_reason": "max_epochs", "epoch": 4}, False, ("COMPLETE", [0.9, 100.0])),
    ({"best_val_acc": 0.8, "throughput": 100.0, "stop_reason": "patience", "epoch": 2}, False, ("COMPLETE", [0.8, 100.0])),
    ({"best_val_acc": 0.7, "throughput": 100.0, "epoch": 1}, False, ("PRUNED", None)),  # cut by the scheduler
    ({"best_val_acc": 0.7, "throughput": 100.0, "epoch": 1}, True, ("FAIL", None)),  # raised after a report
    ({"best_val_acc": math.nan, "throughput": 100.0, "stop_reason": "max_epochs"}, False, ("FAIL", None)),
    ({"best_val_acc": 0.5, "throughput": math.inf, "stop_reason": "max_epochs"}, False, ("FAIL", None)),
    ({"rejected": "params=9 breaks params <= 1", "stop_reason": "constraint", "best_val_acc": math.nan}, False, ("PRUNED", None)),
    (None, True, ("FAIL", None)),
    (None, False, ("PRUNED", None)),
])
def test_only_full_budget_trials_are_complete_for_optuna(result, error, expected):
    assert optuna_state_for(result, error=error, metrics=METRICS) == expected


# -- progress.parquet ------------------------------------------------------------------------

def test_progress_rows_track_the_fronts_hypervolume(tmp_path):
    store = ResultsStore(tmp_path, space={}, objectives=[("val_acc", "max"), ("throughput", "max")], reference=[0.0, 0.0])
    rows = [
        ("a", "COMPLETE", 0.5, 100.0, 4),
        ("b", "PRUNED", 0.9, 900.0, 1),  # cut short: not on the front, adds no volume
        ("c", "COMPLETE", 0.8, 50.0, 4),
        ("d", "REJECTED", None, 10.0, 0),
        ("e", "COMPLETE", 0.4, 80.0, 4),  # dominated by a
    ]
    for i, (tid, state, acc, tput, epochs) in enumerate(rows):
        store.add_trial({"trial_id": tid, "state": state, "val_acc": acc, "throughput": tput, "epochs_run": epochs}, {})
        store.add_progress(trial_id=tid, state=state, elapsed_s=float(i), at=None)
    store.flush()
    progress = pq.read_table(open(tmp_path / "progress.parquet", "rb")).to_pylist()
    assert set(progress[0]) == set(PROGRESS_COLUMNS)
    assert [p["finished"] for p in progress] == [1, 2, 3, 4, 5]
    assert [p["epochs_spent"] for p in progress] == [4, 5, 9, 9, 13]
    assert [p["front_size"] for p in progress] == [1, 1, 2, 2, 2]
    expected = hypervolume([[0.5, 100.0], [0.8, 50.0]], modes=["max", "max"], reference=[0.0, 0.0])
    assert progress[2]["hypervolume"] == pytest.approx(expected) == pytest.approx(0.5 * 100 + 0.3 * 50)
    assert progress[0]["hypervolume"] == pytest.approx(50.0) and progress[1]["hypervolume"] == pytest.approx(50.0)
    assert progress[-1]["hypervolume"] == pytest.approx(expected)
    assert progress[-1]["best_val_acc"] == 0.8


# -- a real search with a constraint ---------------------------------------------------------

@pytest.mark.ray(seconds=125)
def test_search_rejects_configs_before_training_and_reuses_measurements(tmp_path):
    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec.update(name="constrained", storage=str(tmp_path / "results"), constraints=["params <= 50000"],
                algorithm={"name": "random", "seed": 1},
                scheduler={"name": "mo_asha"})  # wired through the spec (one epoch: no rung to judge at)
    spec["space"] = {"depth": {"type": "choice", "values": [2, 6]},  # 26.5k / 77k parameters
                     "lr": {"type": "choice", "values": [2.0e-3, 3.0e-3]}}
    spec["model"]["args"] = {"local_up_to_layer": 1}
    spec["budget"].update(trials=6, max_epochs=1)
    path = tmp_path / "constrained.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, LOCALITY_SEARCH_CACHE=str(tmp_path / "cache"))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "search", "run", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Ray dashboard" not in proc.stdout  # the suite starts Ray without it (tests/conftest.py)
    exp = tmp_path / "results" / "constrained"
    trials = pq.read_table(open(exp / "trials.parquet", "rb")).to_pylist()
    epochs = pq.read_table(open(exp / "epochs.parquet", "rb")).to_pylist()
    progress = pq.read_table(open(exp / "progress.parquet", "rb")).to_pylist()
    assert len(trials) == 6 and len(progress) == 6
    for row in trials:
        if row["depth"] == 6:
            assert row["state"] == "REJECTED" and row["stop_reason"] == "constraint"
            assert row["epochs_run"] == 0 and row["val_acc"] is None
            assert "params <= 50000" in row["rejected_by"] and row["params"] == 76952
            assert not any(e["trial_id"] == row["trial_id"] for e in epochs)
        else:
            assert row["state"] == "COMPLETE" and row["epochs_run"] == row["epochs_budget"] == 1
    assert {r["depth"] for r in trials} == {2, 6}, "the seed should sample both depths"
    # one measurement per architecture: every trial of a depth has the same number
    for depth in (2, 6):
        same = [r for r in trials if r["depth"] == depth]
        assert len({r["throughput"] for r in same}) == 1 and len({r["architecture"] for r in same}) == 1
        # measured by its first trial, or (the model as named, default arguments) as the reference
        # an earlier trial of the other depth was timed beside
        fresh = sum(not r["throughput_cached"] for r in same)
        assert fresh == 1 or (fresh == 0 and same[0]["throughput_reference"] == same[0]["architecture"])
    assert "rejected: params=" in proc.stdout
    front = pq.read_table(open(exp / "pareto.parquet", "rb")).to_pylist()
    assert front and all(r["state"] == "COMPLETE" for r in front)
    volumes = [p["hypervolume"] for p in progress]
    assert all(b >= a for a, b in zip(volumes, volumes[1:])) and volumes[-1] > 0

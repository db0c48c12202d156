"""The study's Ray metrics: registered with ``ray.util.metrics`` and updated during a real (tiny)
Tune run, then read back from Ray's own Prometheus endpoint, as Prometheus would scrape them."""

from __future__ import annotations

import io
import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from search.results.store import ResultsStore
from search.study.callbacks import StoreCallback
from search.study.metrics import METRIC_PREFIX, STUDY_METRICS, TRIAL_METRICS, MetricsCallback

pytestmark = pytest.mark.ray

EXPERIMENT = "metrics_probe"
CONFIGS = [{"x": 0.5, "tput": 3000.0}, {"x": 1.0, "tput": 1000.0}]


def _make_trainable():
    # A closure, so Ray pickles it by value: workers cannot import this test module.
    def fake_trainable(config):
        from ray import tune

        cfg = config["cfg"]
        for epoch in (1, 2):
            acc = 0.4 * cfg["x"] + 0.1 * epoch
            result = {"epoch": epoch, "val_acc": acc, "best_val_acc": acc, "throughput": cfg["tput"], "family": "fake"}
            if epoch == 2:
                result["stop_reason"] = "max_epochs"
            tune.report(result)

    return fake_trainable


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
        mp.delenv("RAY_ADDRESS", raising=False)
        started = not ray.is_initialized()
        if started:
            # Export every second (Ray's floor), not every 10 s: the test reads the endpoint.
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=True,
                     logging_level="WARNING", _system_config={"metrics_report_interval_ms": 1000})
        yield ray
        if started:
            ray.shutdown()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _series(text: str, name: str) -> dict[frozenset, float]:
    """{labels: value} of the Prometheus series ``name`` (exact name, any labels)."""
    out = {}
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", text, re.M):
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        out[labels] = float(match.group(2))
    return out


def test_metrics_are_registered_and_updated_in_a_real_run(ray_cluster, tmp_path):
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    ray = ray_cluster
    store = ResultsStore(tmp_path / "study", space={}, objectives=[("val_acc", "max"), ("throughput", "max")], reference=[0.0, 0.0])
    store_cb = StoreCallback(store, experiment=EXPERIMENT, model="fake", spec_hash="h", git_commit=None, seed=0,
                             total_trials=len(CONFIGS), time_limit_s=None, max_epochs=2, out=io.StringIO())
    metrics = MetricsCallback(store, experiment=EXPERIMENT, total_trials=len(CONFIGS))
    tuner = tune.Tuner(
        _make_trainable(),
        param_space={"cfg": tune.grid_search(CONFIGS)},
        tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(name="run", storage_path=str(tmp_path), verbose=0,
                                  callbacks=[store_cb, metrics, JsonLoggerCallback()]),
    )
    grid = tuner.fit()
    assert not grid.errors, grid.errors

    # what the callback set: study counts, front and hypervolume from the store, per-trial values
    assert metrics.value("trials", state="COMPLETE") == 2
    assert metrics.value("trials", state="PRUNED") == 0 and metrics.value("trials", state="RUNNING") == 0
    assert metrics.value("trials_budget") == 2
    assert metrics.value("best_val_acc") == pytest.approx(0.6)
    assert metrics.value("front_size") == 2  # (0.4, 3000) and (0.6, 1000): neither dominates
    assert metrics.value("hypervolume") == pytest.approx(store.progress[-1]["hypervolume"])
    trial_ids = [t["trial_id"] for t in store.trials]
    for tid in trial_ids:
        assert metrics.value("trial_epoch", trial_id=tid, family="fake") == 2
    assert sorted(metrics.value("trial_throughput", trial_id=t, family="fake") for t in trial_ids) == [1000.0, 3000.0]
    assert metrics._gauges is not None and set(metrics._gauges) == set(STUDY_METRICS) | set(TRIAL_METRICS)

    # ... and what Ray exports to Prometheus: ray_-prefixed, tagged with the experiment
    port = ray._private.worker._global_node.metrics_export_port
    deadline, text = time.monotonic() + 40, ""
    name = f"ray_{METRIC_PREFIX}trials"
    while time.monotonic() < deadline:
        try:
            text = _scrape(port)
        except OSError:
            text = ""
        if any(("state", "COMPLETE") in k and v == 2 for k, v in _series(text, name).items()):
            break
        time.sleep(1)
    trials = _series(text, name)
    assert any(("experiment", EXPERIMENT) in k and ("state", "COMPLETE") in k and v == 2 for k, v in trials.items()), \
        f"{name} not exported on :{port}/metrics; got {sorted(trials.items())[:5]}"
    front = _series(text, f"ray_{METRIC_PREFIX}front_size")
    assert any(("experiment", EXPERIMENT) in k and v == 2 for k, v in front.items())
    epochs = _series(text, f"ray_{METRIC_PREFIX}trial_epoch")
    assert {dict(k)["trial_id"] for k in epochs if ("experiment", EXPERIMENT) in k} == set(trial_ids)


def test_grafana_dashboard_queries_the_exported_names():
    board = json.loads((Path(__file__).resolve().parents[3] / "dashboards" / "grafana" / "locality_search.json").read_text())
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p.get("targets", []))
    for name in [*STUDY_METRICS, *TRIAL_METRICS]:
        assert f"ray_{METRIC_PREFIX}{name}" in exprs, name
    assert "experiment=~\"$experiment\"" in exprs.replace(" ", "")


class _FakeGauge:
    def __init__(self):
        self.sets = []

    def set(self, value, tags=None):
        self.sets.append((value, dict(tags or {})))


def test_gauges_are_set_again_while_live_and_let_go_a_minute_after_a_trial_ends():
    # Ray's agent drops a gauge that was not set again within two export intervals.
    from types import SimpleNamespace

    store = ResultsStore("/nonexistent", space={}, objectives=[("val_acc", "max"), ("throughput", "max")])
    cb = MetricsCallback(store, experiment="e", total_trials=3)
    cb._gauges = {name: _FakeGauge() for name in [*STUDY_METRICS, *TRIAL_METRICS]}
    cb.setup()
    running, done = SimpleNamespace(trial_id="run1"), SimpleNamespace(trial_id="done1")
    for trial in (running, done):
        cb.on_trial_result(1, [], trial, {"epoch": 1, "val_acc": 0.5, "throughput": 10.0, "family": "f"})
    cb.on_trial_complete(1, [], done)
    ended = cb._finished_at["done1"]
    assert cb.refresh(now=ended + 1) == len(cb.values)  # everything, shortly after
    cb._gauges["trial_epoch"].sets.clear()
    later = cb.refresh(now=ended + 120)
    assert later == len(cb.values) - 3  # the finished trial's three series are let go
    assert [tags["trial_id"] for _, tags in cb._gauges["trial_epoch"].sets] == ["run1"]
    assert cb._gauges["trials_budget"].sets[-1] == (3.0, {})

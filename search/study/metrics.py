"""Ray metrics of a running study (``ray.util.metrics``), set from a Tune callback on the driver.

Ray exports them, with its ``ray_`` prefix, on each node's Prometheus endpoint; Ray's dashboard
shows them in its Metrics view once Prometheus and Grafana run (docs/cluster.md#watching-a-clusters-study),
and ``dashboards/grafana/locality_search.json`` is a Grafana dashboard for them. Every series
carries the ``experiment`` tag (the study name), so studies sharing a cluster stay apart.

    ray_locality_search_trials{experiment, state}       trials per state: COMPLETE, PRUNED, REJECTED,
                                                        FAILED (finished) and RUNNING, PENDING (Tune's)
    ray_locality_search_trials_budget{experiment}       trials the study will run (budget.trials)
    ray_locality_search_best_val_acc{experiment}        best val_acc of the COMPLETE trials
    ray_locality_search_front_size{experiment}          COMPLETE trials on the Pareto front
    ray_locality_search_hypervolume{experiment}         the front's hypervolume (spec's reference point)
    ray_locality_search_trial_epoch{experiment, trial_id, family}       epochs the trial has reported
    ray_locality_search_trial_val_acc{experiment, trial_id, family}     its last epoch's validation accuracy
    ray_locality_search_trial_throughput{experiment, trial_id, family}  its inference images/s

The study-level numbers are the results store's (the same front and hypervolume as
progress.parquet), so this callback goes after :class:`search.study.callbacks.StoreCallback` in the
callback list: Tune calls callbacks in order, and the store has the trial's row by then.
Metrics are a view: if recording fails (an old or minimal Ray), a warning is printed once and
the study goes on without them.

Ray (2.60, OpenTelemetry) exports a gauge only while the process keeps setting it: the metrics
agent drops a value not set again within two export intervals (``metrics_report_interval_ms``,
10 s by default). So the callback sets its gauges again every half interval, from Tune's step
loop: the study's numbers for as long as the study runs, a trial's for as long as it runs and a
minute after it ends (its series then stops, as the trial has).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

from ray.tune import Callback

from search.results.store import ResultsStore

__all__ = ["MetricsCallback", "METRIC_PREFIX", "STUDY_METRICS", "TRIAL_METRICS"]

METRIC_PREFIX = "locality_search_"
# name -> (description, extra tag keys); every metric also has the "experiment" tag.
STUDY_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "trials": ("Trials of the study per state (finished: COMPLETE, PRUNED, REJECTED, FAILED; Tune's: RUNNING, PENDING)", ("state",)),
    "trials_budget": ("Trials the study will run (budget.trials)", ()),
    "best_val_acc": ("Best validation accuracy of the COMPLETE trials", ()),
    "front_size": ("COMPLETE trials on the Pareto front", ()),
    "hypervolume": ("Hypervolume of the Pareto front (the spec's reference point)", ()),
}
TRIAL_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "trial_epoch": ("Epochs the trial has reported", ("trial_id", "family")),
    "trial_val_acc": ("Validation accuracy of the trial's last reported epoch", ("trial_id", "family")),
    "trial_throughput": ("Inference images/s of the trial's architecture", ("trial_id", "family")),
}
FINISHED_STATES = ("COMPLETE", "PRUNED", "REJECTED", "FAILED")
TUNE_STATES = ("RUNNING", "PENDING")
FINISHED_TRIAL_KEEP_S = 60.0  # a finished trial's series is refreshed this long (a scrape sees its last value)


def _refresh_interval_s() -> float:
    """Half of Ray's metrics export interval: the agent keeps a gauge for two intervals."""
    try:
        import ray

        return max(1.0, ray._config.metrics_report_interval_ms() / 2000.0)
    except Exception:  # an older Ray: its default interval, 10 s
        return 5.0


class MetricsCallback(Callback):
    """Sets the study's Ray metrics from Tune's events; ``values`` keeps what was last set
    (``{(metric, ((tag, value), ...)): number}``), for tests and for a look in a debugger."""

    def __init__(self, store: ResultsStore, *, experiment: str, total_trials: int) -> None:
        self.store = store
        self.experiment = experiment
        self.total_trials = total_trials
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._gauges: dict[str, Any] | None = None
        self._broken = False
        self._finished_at: dict[str, float] = {}  # trial_id -> when it ended (monotonic)
        self._last_refresh = 0.0
        self._refresh_s: float | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles callbacks with the experiment state; the gauges are made again after a resume.
        state = dict(self.__dict__)
        # monotonic times mean nothing in another process; the values come back from the store
        state.update(_gauges=None, values={}, _finished_at={}, _last_refresh=0.0, _refresh_s=None)
        return state

    # -- recording -------------------------------------------------------------------------
    def _ensure(self) -> dict[str, Any] | None:
        if self._gauges is None and not self._broken:
            try:
                from ray.util.metrics import Gauge

                self._gauges = {
                    name: Gauge(METRIC_PREFIX + name, description=description, tag_keys=("experiment", *tags))
                    .set_default_tags({"experiment": self.experiment})
                    for name, (description, tags) in {**STUDY_METRICS, **TRIAL_METRICS}.items()
                }
            except Exception as exc:  # metrics are a view; the study must not die for them
                self._disable(exc)
        return self._gauges

    def _disable(self, exc: BaseException) -> None:
        self._broken = True
        self._gauges = None
        print(f"warning: Ray metrics are off for this study ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)

    def _set(self, name: str, value: float | int | None, **tags: str) -> None:
        if value is None or value != value:  # None or NaN: nothing known, keep the last value
            return
        gauges = self._ensure()
        if gauges is None:
            return
        try:
            gauges[name].set(float(value), tags=tags or None)
        except Exception as exc:
            self._disable(exc)
            return
        self.values[(name, tuple(sorted({"experiment": self.experiment, **tags}.items())))] = float(value)

    def refresh(self, *, now: float | None = None) -> int:
        """Set every live gauge again to its last value (see the module doc); how many were set."""
        now = time.monotonic() if now is None else now
        count = 0
        for (name, tags), value in list(self.values.items()):
            labels = dict(tags)
            trial_id = labels.get("trial_id")
            if trial_id is not None and now - self._finished_at.get(trial_id, now) > FINISHED_TRIAL_KEEP_S:
                continue  # that trial ended a while ago: let its series end too
            labels.pop("experiment")
            self._set(name, value, **labels)
            count += 1
        return count

    def value(self, name: str, **tags: str) -> float | None:
        """What ``name`` was last set to for ``tags`` (``experiment`` is implied)."""
        return self.values.get((name, tuple(sorted({"experiment": self.experiment, **tags}.items()))))

    # -- study and trial numbers ----------------------------------------------------------
    def _publish_study(self, trials: list | None) -> None:
        rows = self.store.trials
        counts = Counter(row["state"] for row in rows)
        for state in FINISHED_STATES:
            self._set("trials", counts.get(state, 0), state=state)
        if trials is not None:
            self._publish_tune_states(trials)
        self._set("trials_budget", self.total_trials)
        progress = self.store.progress
        if progress:
            last = progress[-1]
            self._set("front_size", last.get("front_size"))
            self._set("hypervolume", last.get("hypervolume"))
            self._set("best_val_acc", last.get("best_val_acc"))

    def _publish_tune_states(self, trials: list) -> None:
        statuses = Counter(getattr(t, "status", None) for t in trials)
        for state in TUNE_STATES:
            self._set("trials", statuses.get(state, 0), state=state)

    def _publish_trial(self, trial: Any, result: dict) -> None:
        tags = {"trial_id": str(trial.trial_id), "family": str(result.get("family") or "")}
        self._set("trial_epoch", result.get("epoch"), **tags)
        self._set("trial_val_acc", result.get("val_acc"), **tags)
        self._set("trial_throughput", result.get("throughput"), **tags)

    # -- Tune events -----------------------------------------------------------------------
    def setup(self, **info: Any) -> None:
        """Start of ``fit()`` (fresh or resumed): the counts of the rows already in the store."""
        self._publish_study(None)

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._publish_tune_states(trials)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if not result.get("rejected"):
            self._publish_trial(trial, result)
        self._publish_tune_states(trials)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._finished_at[str(trial.trial_id)] = time.monotonic()
        self._publish_study(trials)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._finished_at[str(trial.trial_id)] = time.monotonic()
        self._publish_study(trials)

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if self._refresh_s is None:
            self._refresh_s = _refresh_interval_s()
        now = time.monotonic()
        if now - self._last_refresh >= self._refresh_s:
            self._last_refresh = now
            self.refresh(now=now)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self._publish_study(trials)  # RUNNING back to 0

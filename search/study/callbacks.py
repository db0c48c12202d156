"""A Ray Tune callback on the driver: trial events -> rows in the results store, progress lines."""

from __future__ import annotations

import contextlib
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ray.tune import Callback

from search.results.intervals import wilson_interval
from search.results.location import JOURNAL_FILE
from search.results.replicates import REPLICATE_COLUMN
from search.results.store import TRIAL_VALUE_OF, ResultsStore
from search.study.searcher import nonfinite_objectives, prune_running_trials, trial_state
from search.study.trainable import EARLIER_EPOCHS, REPLICATE_KEY, SEED_KEY
from trainers.errors import DiskFullError

__all__ = ["StoreCallback", "PrintingCallback", "error_line"]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def error_line(error: BaseException | str | None) -> str:
    """The last meaningful line of a (possibly remote) exception, e.g.
    'NonFiniteLossError: training loss became nan at epoch 2, ...'."""
    if error is None:
        return "unknown error"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith(("File ", "^", "~")):
            # 'trainers.train.NonFiniteLossError: msg' -> 'NonFiniteLossError: msg'
            head, sep, rest = line.partition(": ")
            if sep and "." in head and " " not in head:
                head = head.rsplit(".", 1)[1]
            return (head + sep + rest)[:500]
    return type(error).__name__ if isinstance(error, BaseException) else "unknown error"


EPOCH_FLUSH_S = 2.0  # the least time between two writes of the files for epoch results


class PrintingCallback(Callback):
    """A Tune callback that prints to ``self.out``. Tune pickles its callbacks with the experiment
    state and a stream does not pickle: it is left out, and a restored one prints to stdout."""

    out: TextIO

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "out": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.out = self.out or sys.stdout


class StoreCallback(PrintingCallback):
    def __init__(
        self,
        store: ResultsStore,
        *,
        experiment: str,
        model: str,
        spec_hash: str,
        git_commit: str | None,
        seed: int,
        total_trials: int,
        time_limit_s: float | None,
        max_epochs: int | None = None,
        objective_keys: list[str] | None = None,
        replicates: bool = False,  # the confirmation stage's callback (search.study.confirm)
        out: TextIO | None = None,  # None: sys.stdout when called (not when imported)
    ) -> None:
        self.store = store
        self.replicates = replicates
        self.max_epochs = max_epochs
        # the result keys a COMPLETE trial must have finite (those of the objectives)
        self.objective_keys = list(objective_keys) if objective_keys is not None else [TRIAL_VALUE_OF["val_acc"]]
        self.common = {"experiment": experiment, "model": model, "spec_hash": spec_hash, "git_commit": git_commit, "seed": seed}
        self.total_trials = total_trials
        self.time_limit_s = time_limit_s
        self.out = out or sys.stdout
        self._started: dict[str, dt.datetime] = {}
        self._study_start = time.monotonic()
        self._finished = 0

    @property
    def elapsed_s(self) -> float:
        """Seconds since the study started (a resumed study counts on); the progress bar shows it."""
        return time.monotonic() - self._study_start

    # -- Tune events ------------------------------------------------------------------------
    def setup(self, **info: Any) -> None:
        """Start of ``fit()``, fresh or resumed: take up the rows already written."""
        self.store.load_existing()
        self._finished = len(self._stage_rows())
        self._study_start = time.monotonic() - self.store.elapsed_s  # elapsed counts on
        self._reconciled = False
        self._disk_full = None

    # A full disk met inside a hook that Tune wraps (on_trial_complete: Tune logs the exception with
    # its traceback and carries on) is raised at the next step instead, where nothing catches it:
    # the driver stops with the one line of StudyRun.fit (search.study.tuning).
    @contextlib.contextmanager
    def _disk_full_deferred(self):
        try:
            yield
        except DiskFullError as exc:
            self._disk_full = getattr(self, "_disk_full", None) or exc

    def _raise_disk_full(self) -> None:
        if getattr(self, "_disk_full", None) is not None:
            raise self._disk_full

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        self._raise_disk_full()

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        self._raise_disk_full()
        if getattr(self, "_reconciled", True):
            return
        self._reconciled = True
        gone = self.store.forget_trials({t.trial_id for t in trials}, replicates=self._replicates)
        if gone:
            self._finished = len(self._stage_rows())
            self.store.flush()
            print(f"resume: {len(gone)} trial(s) finished after Tune's last snapshot ({', '.join(gone)}); "
                  "their slots are sampled again", file=self.out, flush=True)
        # ... and the other way: trials Tune's snapshot has as ended whose rows never reached the
        # files (the driver stopped between the two: a kill, or a full disk failing the write)
        recorded = {row["trial_id"] for row in self._stage_rows()}
        for trial in trials:
            if trial.trial_id not in recorded and trial.status in ("TERMINATED", "ERROR"):
                print(f"resume: trial {trial.trial_id} ended before the driver stopped but was not recorded; "
                      "recorded now from Tune's snapshot", file=self.out, flush=True)
                if trial.status == "ERROR":
                    self.on_trial_error(iteration, trials, trial)
                else:
                    self.on_trial_complete(iteration, trials, trial)

    @property
    def _replicates(self) -> bool:
        return getattr(self, "replicates", False)  # a snapshot taken before confirmation existed

    def _stage_rows(self) -> list[dict[str, Any]]:
        """The store's rows of this callback's stage: the search's trials, or the replicates."""
        return [t for t in self.store.trials if (t.get(REPLICATE_COLUMN) is not None) == self._replicates]

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._started.setdefault(trial.trial_id, _now())

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        with self._disk_full_deferred():
            self._record_epoch(trial, result)

    def _record_epoch(self, trial: Any, result: dict) -> None:
        if result.get("rejected"):
            return  # no epoch was trained
        for earlier in result.get(EARLIER_EPOCHS) or ():  # a restored trial's epochs the store may lack
            self.store.add_epoch({**earlier, "trial_id": trial.trial_id}, replace=False)
        row = dict(result)
        row["trial_id"] = trial.trial_id
        row["reported_at"] = _now()
        self.store.add_epoch(row)
        # Readers (dashboards, `pareto` during a run) see epochs at most a few seconds late; the
        # interval grows with the cost of writing the files, so big studies spend < 5% on it.
        now = time.monotonic()
        if now - getattr(self, "_flushed_at", 0.0) >= max(EPOCH_FLUSH_S, 20 * getattr(self, "_flush_cost", 0.0)):
            self.store.flush()
            self._flushed_at, self._flush_cost = time.monotonic(), time.monotonic() - now

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        with self._disk_full_deferred():
            self._complete(trial)

    def _complete(self, trial: Any) -> None:
        result = trial.last_result or {}
        state = trial_state(result, error=False, metrics=self.objective_keys)
        error = None
        if state == "REJECTED":
            reason = "constraint"
        elif state == "COMPLETE":
            reason = result["stop_reason"]
        elif state == "FAILED":  # finished, but an objective is missing or not finite
            reason = "error"
            error = "non-finite objective: " + ", ".join(nonfinite_objectives(result, metrics=self.objective_keys))
        else:
            reason = "time_limit" if self._timed_out() else "scheduler"
        self._finish(trial, state=state, stop_reason=reason, error=error)

    def _timed_out(self) -> bool:
        return self.time_limit_s is not None and time.monotonic() - self._study_start >= self.time_limit_s

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        # Tune has just written the error (with its traceback) to the trial's local folder; its
        # copy in storage (trial.get_error()) may not be synced yet.
        error: BaseException | str | None
        try:
            path = trial.error_file
            error = Path(path).read_text() if path else trial.get_error()
        except Exception as exc:  # an unreadable error file: the trial still failed
            error = exc
        with self._disk_full_deferred():
            self._finish(trial, state="FAILED", stop_reason="error", error=error_line(error))

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self._timed_out():
            # Tune stops the trials still running when the time budget runs out without an
            # on_trial_complete: recorded here, as the time limit's, with the epochs they ran
            recorded = {row["trial_id"] for row in self._stage_rows()}
            for trial in trials:
                if trial.trial_id in self._started and trial.trial_id not in recorded:
                    self._finish(trial, state="PRUNED", stop_reason="time_limit", error=None)
            # ... and in the Optuna study, which Tune did not tell either (before the flush, which
            # uploads the journal with the Parquet files); replicates are not in it
            if not self._replicates:
                prune_running_trials(self.store.directory / JOURNAL_FILE, study_name=self.common["experiment"],
                                     reason="time_limit")
        self._raise_disk_full()
        self.store.flush()

    # -- rows -------------------------------------------------------------------------------
    def _finish(self, trial: Any, *, state: str, stop_reason: str, error: str | None) -> None:
        result = trial.last_result or {}
        ended = _now()
        started = self._started.get(trial.trial_id, ended)
        row: dict[str, Any] = {
            **self.common,
            "model": trial.config.get("model", self.common["model"]),
            **{k: result.get(k) for k in (
                "family", "throughput", "throughput_device", "throughput_batch", "throughput_precision",
                "throughput_threads", "train_precision", "torch_version", "params", "flops", "node_ip", "hostname", "node_id",
                "throughput_before_conversion", "converted_at_epoch", "throughput_cached", "architecture",
                "throughput_timed", "throughput_reference", "throughput_cuda_graph", "throughput_low", "throughput_high",
                "throughput_runtime", "val_images",
            )},
            "seed": trial.config.get(SEED_KEY, self.common["seed"]),
            REPLICATE_COLUMN: trial.config.get(REPLICATE_KEY),
            "seeds": 1,
            "rejected_by": result.get("rejected"),
            "failures": int(getattr(trial, "num_failures", 0) or 0),
            "epochs_budget": self.max_epochs,
            "trial_id": trial.trial_id,
            "trial_name": str(trial),
            "state": state,
            "stop_reason": stop_reason,
            "error": error,
            "epochs_run": int(result.get("epoch", 0) or 0),
            "val_acc": result.get(TRIAL_VALUE_OF["val_acc"]),
            "val_loss": result.get(TRIAL_VALUE_OF["val_loss"]),
            "final_val_acc": result.get("val_acc"),
            **dict(zip(("val_acc_low", "val_acc_high"),  # null where unknown (no val_acc, no val_images)
                       (None if v != v else v for v in wilson_interval(result.get(TRIAL_VALUE_OF["val_acc"]),
                                                                        result.get("val_images"))))),
            "started_at": started,
            "ended_at": ended,
            "duration_s": (ended - started).total_seconds(),
        }
        if state == "REJECTED":  # never trained: no accuracy, not NaN
            row.update(val_acc=None, val_loss=None, final_val_acc=None)
        self.store.add_trial(row, trial.config)
        self.store.add_progress(trial_id=trial.trial_id, state=state, elapsed_s=time.monotonic() - self._study_start, at=ended)
        self.store.flush()
        self._finished += 1
        self._print_line(row)

    def _print_line(self, row: dict[str, Any]) -> None:
        acc = row["val_acc"]
        tput = row["throughput"]
        parts = [
            f"[{self._finished}/{self.total_trials}]",
            f"{row['state']:<8}",
            f"val_acc={acc:.4f}" if acc is not None else "val_acc=-",
            f"throughput={tput:,.0f} img/s" if tput is not None else "throughput=-",
            f"epochs={row['epochs_run']}",
            f"({row['stop_reason']})",
            row["trial_name"],
        ]
        if row["error"]:
            parts.append(f"error: {row['error']}")
        if row["rejected_by"]:
            parts.append(f"rejected: {row['rejected_by']}")
        print(" ".join(parts), file=self.out, flush=True)

"""The terminal progress bar of ``python -m search run``: on a TTY only; piped output unchanged."""

from __future__ import annotations

import io
import pickle
from types import SimpleNamespace

from search.results.store import ResultsStore
from search.study.callbacks import StoreCallback
from search.study.progress import ProgressBar, format_status


def test_format_status():
    line = format_status(done=4, total=10, running=2, best=0.81, elapsed_s=372, limit_s=1080, width=120)
    assert line.startswith("████████░░░░░░░░░░░░  4/10 trials")
    assert "2 running" in line and "best val_acc 0.8100" in line and "6:12 elapsed of 18:00" in line
    assert "best val_acc -" in format_status(done=0, total=10, running=0, best=None, elapsed_s=5, limit_s=None)
    assert len(format_status(done=1, total=3, running=1, best=0.5, elapsed_s=4000, limit_s=None, width=30)) == 29
    assert "1:06:40 elapsed" in format_status(done=1, total=3, running=0, best=None, elapsed_s=4000, limit_s=None)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _callbacks(tmp_path, out):
    store = ResultsStore(tmp_path, space={"x": {"type": "uniform", "low": 0, "high": 1}},
                         objectives=[("val_acc", "max"), ("throughput", "max")], reference=[0.0, 0.0])
    cb = StoreCallback(store, experiment="p", model="m", spec_hash="h", git_commit=None, seed=0, total_trials=3,
                       time_limit_s=None, max_epochs=2, out=out)
    return cb, ProgressBar(cb, stream=out)


def _finish(bar, cb, trial_id, acc):
    trial = SimpleNamespace(trial_id=trial_id, config={"x": 0.5}, status="TERMINATED",
                            last_result={"epoch": 2, "best_val_acc": acc, "val_acc": acc, "throughput": 100.0,
                                         "stop_reason": "max_epochs", "family": "f"})
    running = [SimpleNamespace(status="RUNNING")]
    bar.on_trial_complete(1, running, trial)  # first in the callback list: erases the bar
    cb.on_trial_complete(1, running, trial)   # prints the trial's line
    bar.on_step_end(1, running)               # draws the bar again


def test_on_a_tty_the_bar_sits_below_the_trial_lines(tmp_path):
    out = _Tty()
    cb, bar = _callbacks(tmp_path, out)
    bar.on_step_end(0, [])
    _finish(bar, cb, "t1", 0.7)
    _finish(bar, cb, "t2", 0.8)
    bar.on_experiment_end([])
    text = out.getvalue()
    # every trial line starts on a cleared line, and the last bar was erased at the end
    assert "\r\x1b[K[1/3] COMPLETE val_acc=0.7000" in text and "\r\x1b[K[2/3] COMPLETE val_acc=0.8000" in text
    assert "2/3 trials · 1 running · best val_acc 0.8000" in text
    assert text.endswith("\r\x1b[K")
    shown = text.split("\r\x1b[K")[-2]  # what the terminal showed last: the bar
    assert shown.startswith("█████████████") and "2/3 trials" in shown


def test_piped_output_is_exactly_the_trial_lines(tmp_path):
    out = io.StringIO()  # not a TTY, as under CI, tests and `| tee`
    cb, bar = _callbacks(tmp_path, out)
    bar.on_step_end(0, [])
    _finish(bar, cb, "t1", 0.7)
    bar.on_experiment_end([])
    assert out.getvalue().startswith("[1/3] COMPLETE val_acc=0.7000 throughput=100 img/s epochs=2 (max_epochs)")
    assert "\r" not in out.getvalue() and "█" not in out.getvalue()


def test_bar_pickles_without_its_stream(tmp_path):
    cb, bar = _callbacks(tmp_path, _Tty())
    bar.stream = _Tty()
    copy = pickle.loads(pickle.dumps(bar))  # Tune saves callbacks with the experiment state
    assert copy.stream is None and copy.store_callback.total_trials == 3

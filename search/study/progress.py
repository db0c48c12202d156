"""A one-line progress bar under the per-trial lines of ``python -m search run``, on a terminal.

    [3/10] COMPLETE val_acc=0.8100 throughput=1,055 img/s epochs=4 (max_epochs) 622090f2_...
    ████████░░░░░░░░░░░░  4/10 trials · 2 running · best val_acc 0.8100 · 6:12 elapsed of 18:00

The bar is redrawn in place (carriage return) about once a second and whenever a trial
finishes. Only on a TTY: when stdout is a file or a pipe (CI, tests, ``| tee``), nothing
changes and the one-line-per-trial output stays exactly as it was.

It is a Tune callback placed *first* in the list: when a trial finishes, it erases the bar
before :class:`search.study.callbacks.StoreCallback` prints that trial's line, and draws it again
at the end of Tune's step, so the bar always sits below the last line.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any, TextIO

from ray.tune import Callback

__all__ = ["ProgressBar", "format_status"]

_CLEAR = "\r\x1b[K"  # to the line start, erase to its end


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_status(
    *,
    done: int,
    total: int,
    running: int,
    best: float | None,
    elapsed_s: float,
    limit_s: float | None,
    width: int = 80,
) -> str:
    """One line: a bar of trials done out of ``total``, then the numbers; at most ``width - 1``
    characters (a full-width line would wrap on some terminals and break the redraw)."""
    frac = min(1.0, done / total) if total else 0.0
    bar_len = 20
    filled = int(round(frac * bar_len))
    parts = [
        f"{done}/{total} trials",
        f"{running} running" if running else "",
        f"best val_acc {best:.4f}" if best is not None else "best val_acc -",
        f"{_clock(elapsed_s)} elapsed" + (f" of {_clock(limit_s)}" if limit_s else ""),
    ]
    text = "█" * filled + "░" * (bar_len - filled) + "  " + " · ".join(p for p in parts if p)
    return text[: max(10, width - 1)]


class ProgressBar(Callback):
    """Draws :func:`format_status` for the study whose rows ``store_callback`` keeps."""

    def __init__(self, store_callback: Any, *, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.store_callback = store_callback
        self.stream = stream
        self._enabled = enabled
        self._shown = False
        self._last_draw = 0.0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)  # a stream does not pickle (Tune saves callbacks with the experiment)
        state.update(stream=None, _shown=False)
        return state

    @property
    def out(self) -> TextIO:
        return self.stream or sys.stdout

    @property
    def enabled(self) -> bool:
        if self._enabled is not None:
            return self._enabled
        try:
            return self.out.isatty() and os.environ.get("TERM", "") != "dumb"
        except (AttributeError, ValueError):  # a closed or odd stream
            return False

    # -- drawing ---------------------------------------------------------------------------
    def status(self, trials: list | None = None) -> str:
        cb = self.store_callback
        progress = cb.store.progress
        best = progress[-1].get("best_val_acc") if progress else None
        running = sum(1 for t in trials or () if getattr(t, "status", None) == "RUNNING")
        width = shutil.get_terminal_size((100, 24)).columns
        return format_status(done=len(cb.store.trials), total=cb.total_trials, running=running, best=best,
                             elapsed_s=cb.elapsed_s, limit_s=cb.time_limit_s, width=width)

    def draw(self, trials: list | None = None) -> None:
        self.out.write(_CLEAR + self.status(trials))
        self.out.flush()
        self._shown = True
        self._last_draw = time.monotonic()

    def clear(self) -> None:
        if self._shown:
            self.out.write(_CLEAR)
            self.out.flush()
            self._shown = False

    # -- Tune events -----------------------------------------------------------------------
    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        # The store callback prints a "resume:" note in its first step after a resume.
        if self.enabled and not getattr(self.store_callback, "_reconciled", True):
            self.clear()

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if self.enabled and (not self._shown or time.monotonic() - self._last_draw >= 1.0):
            self.draw(trials)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if self.enabled:
            self.clear()  # the store callback prints the trial's line next
            self._last_draw = 0.0  # and the next step end draws the bar again at once

    on_trial_error = on_trial_complete

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self.enabled:
            self.clear()

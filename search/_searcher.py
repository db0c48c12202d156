"""What Optuna is told when a trial ends: only a trial that ran its full budget counts as done.

Ray's ``OptunaSearch`` tells Optuna COMPLETE, with the last reported values, for every trial
that reported anything -- a trial the scheduler stopped after one epoch included, and even a
trial that crashed after its first report. The sampler then models a one-epoch accuracy as if
it were a full run's. The rule here (also the README's "honest fidelity" rule):

    finished by the trainer (max_epochs, or patience: more epochs stopped helping) -> COMPLETE
    stopped early by the scheduler or the time limit                                -> PRUNED
    rejected by a constraint before training                                        -> PRUNED, infeasible
    raised, or a non-finite objective                                                -> FAIL

PRUNED and FAIL trials give Optuna no objective values. A rejected trial carries its
constraint violation (``user_attrs["constraint_violation"]``), which :func:`constraint_violation`
hands to samplers that take a ``constraints_func`` (TPE, NSGA-II), so they learn to avoid it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ray.tune.search.optuna import OptunaSearch

__all__ = ["HonestOptunaSearch", "constraint_violation", "optuna_state_for"]

logger = logging.getLogger(__name__)


def constraint_violation(trial: Any) -> list[float]:
    """Optuna ``constraints_func``: > 0 for a trial a spec constraint rejected."""
    return [float(trial.user_attrs.get("constraint_violation", 0.0))]


def optuna_state_for(result: dict[str, Any] | None, *, error: bool, metrics: list[str]) -> tuple[str, list[float] | None]:
    """('COMPLETE' | 'PRUNED' | 'FAIL', values or None) for a trial's last result (see the module doc)."""
    result = result or {}
    if error:
        return "FAIL", None
    if result.get("rejected"):
        return "PRUNED", None
    if "stop_reason" not in result:  # the trainer did not finish it: the scheduler or time limit did
        return "PRUNED", None
    values = [result.get(m) for m in metrics]
    if any(v is None or not math.isfinite(float(v)) for v in values):
        return "FAIL", None
    return "COMPLETE", [float(v) for v in values]


class HonestOptunaSearch(OptunaSearch):
    """``OptunaSearch`` that reports trial ends by :func:`optuna_state_for`."""

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        from optuna.trial import TrialState

        if trial_id in self._completed_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        metrics = self.metric if isinstance(self.metric, list) else [self.metric]
        state, values = optuna_state_for(result, error=error, metrics=metrics)
        result = result or {}
        if result.get("rejected"):
            ot_trial.set_user_attr("rejected", str(result["rejected"]))
            ot_trial.set_user_attr("constraint_violation", float(result.get("constraint_violation") or 1.0))
        if "epoch" in result:
            ot_trial.set_user_attr("epochs_run", int(result["epoch"]))
        if len(metrics) == 1 and values is not None:
            values = values[0]  # type: ignore[assignment]
        try:
            self._ot_study.tell(ot_trial, values, state=getattr(TrialState, state))
        except Exception as exc:  # never let the searcher take the study down
            logger.warning("could not tell Optuna about trial %s: %s", trial_id, exc)
        self._completed_trials.add(trial_id)

"""The scheduler of a study's stage: what stops its trials early (``scheduler:`` in the spec).

Ray is imported inside: `search.study.runner` imports this module, and `import search` imports
the runner.
"""

from __future__ import annotations

from search.results.store import TRIAL_VALUE_OF
from search.spec import SearchSpec

__all__ = ["scheduler_for"]


def scheduler_for(spec: SearchSpec, *, confirmation: bool = False):
    """Tune's scheduler for ``spec``'s search: Ray's ASHA on val_acc, MO-ASHA on every objective
    (search.study.mo_asha, with the spec's ``ranking`` and ``keep_front`` where given), or none
    (FIFO: every trial to the end). The confirmation trains every replicate to the end: FIFO."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from search.study.mo_asha import MOASHAScheduler

    scheduler = spec.scheduler
    if confirmation or scheduler.name == "none":
        return FIFOScheduler()
    rungs = dict(time_attr="training_iteration", max_t=spec.budget.max_epochs, grace_period=spec.grace_epochs,
                 reduction_factor=scheduler.reduction_factor)
    if scheduler.name == "asha":
        return ASHAScheduler(metric=TRIAL_VALUE_OF["val_acc"], mode="max", **rungs)
    options = {key: value for key, value in (("ranking", scheduler.ranking), ("keep_front", scheduler.keep_front))
               if value is not None}  # unset: MOASHAScheduler's defaults
    return MOASHAScheduler(objectives=[(TRIAL_VALUE_OF[o.metric], o.mode) for o in spec.objectives], **rungs, **options)

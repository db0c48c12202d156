"""Running a study: the runner (spec -> dataset -> Ray Tune + Optuna -> results store), one driver
per study, a trial's Tune side, and a chosen trial exported and retrained.

Only the light entry points are re-exported here. The Tune plug-ins (``trainable``,
``callbacks``, ``progress``, ``metrics``, ``recovery``, ``searcher``, ``mo_asha``) import Ray or
torch at the top, so the runner imports them by module when a run starts, and importing this
package (as ``search`` and its readers do) stays light.
"""

from search.study.export import export_trial, load_export, write_export
from search.study.retrain import RetrainResult, retrain
from search.study.runner import resume_study, run_study

__all__ = [
    "run_study",
    "resume_study",
    "export_trial",
    "write_export",
    "load_export",
    "retrain",
    "RetrainResult",
]

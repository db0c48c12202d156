"""Running a study: the runner (spec -> dataset -> Ray Tune + Optuna -> results store), one driver
per study, a trial's Tune side, and a chosen trial exported and retrained.

    runner.py        run_study, resume_study: the stages in order
    cluster.py       Ray joined or started, the dashboard's checks
    prepare.py       the dataset converted, the CPU kernels built, Ray up: before any trial
    experiment.py    experiment.json: written when a study starts, read back to resume it
    tuning.py        a stage as a Tune experiment (StudyRun): built or restored, then fit; trial names
    search_stage.py  the search; resume.py: what is left of a stopped study, its search taken up
    confirm.py       the confirmation seeds of the front, after the search
    searcher.py      Optuna's space, sampler and honest adapter; the searchers of fixed configs
    schedulers.py    the scheduler of a stage (ASHA, MO-ASHA: mo_asha.py, or none)
    driver.py        one driver per study; suite.py: studies run one after another
    trainable.py     a trial's Tune side; callbacks, progress, metrics, recovery, snapshot: the
                     driver's Tune callbacks
    export.py, retrain.py  a chosen trial exported, then retrained without Ray

Only the light entry points are re-exported here. The Tune plug-ins (``trainable``,
``callbacks``, ``progress``, ``metrics``, ``recovery``, ``searcher``, ``mo_asha``) import Ray or
torch at the top, so the stages import them inside the functions that run them, and importing
this package (as ``search`` and its readers do) stays light.
"""

from search.study.export import export_trial, load_export, write_export
from search.study.retrain import RetrainResult, retrain
from search.study.runner import check_dashboard_host, resume_study, run_study

__all__ = [
    "run_study",
    "resume_study",
    "check_dashboard_host",
    "export_trial",
    "write_export",
    "load_export",
    "retrain",
    "RetrainResult",
]

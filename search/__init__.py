"""locality-search: multi-objective search over soft-locality vision transformers.

The public API; the modules behind it are private (``search._spec``, ``search._store``, ...).
"""

from search._compare import Comparison, compare_studies
from search._dashboard import make_server, serve_dashboard
from search._export import export_trial, load_export, write_export
from search._filter import filter_trials
from search._hypervolume import front_hypervolume, hypervolume
from search._pareto import pareto_front, pareto_mask
from search._query import Experiment, format_front, front_of, load, load_experiment, load_trials
from search._report import Report, write_report
from search._retrain import RetrainResult, retrain
from search._select import select
from search._spec import SearchSpec, load_spec
from search._store import EPOCH_COLUMNS, TRIAL_COLUMNS, ResultsStore

__all__ = [
    "SearchSpec",
    "load_spec",
    "pareto_front",
    "pareto_mask",
    "ResultsStore",
    "TRIAL_COLUMNS",
    "EPOCH_COLUMNS",
    "load_experiment",
    "load_trials",
    "front_of",
    "format_front",
    "load",
    "Experiment",
    "hypervolume",
    "front_hypervolume",
    "select",
    "filter_trials",
    "export_trial",
    "write_export",
    "load_export",
    "retrain",
    "RetrainResult",
    "compare_studies",
    "Comparison",
    "serve_dashboard",
    "make_server",
    "write_report",
    "Report",
]

"""locality-search: multi-objective search over soft-locality vision transformers.

The public API. The package has four layers, each importing only those below it (import-linter
checks this, see pyproject.toml): ``search.views`` (CLI, report, Pareto page) > ``search.study``
(running a study) > ``search.results`` (the results store and its queries) > ``search.spec``
(the spec). ``search.text`` and ``search.hosts`` are small helpers any layer may use.
"""

from search.results import (
    EPOCH_COLUMNS,
    TRIAL_COLUMNS,
    Comparison,
    Experiment,
    ResultsStore,
    compare_studies,
    filter_trials,
    front_hypervolume,
    front_of,
    hypervolume,
    knob_effects,
    knob_importance,
    load,
    load_experiment,
    load_trials,
    pareto_front,
    pareto_mask,
    select,
)
from search.spec import SearchSpec, load_spec
from search.study import RetrainResult, export_trial, load_export, retrain, write_export
from search.views import Report, make_server, serve_dashboard, write_report
from search.views.output import format_front

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
    "knob_importance",
    "knob_effects",
    "serve_dashboard",
    "make_server",
    "write_report",
    "Report",
]

"""A study's results: where it lives (``location``), its Parquet store (``store``) and what is
read from it (``query``, ``front``, ``pareto``, ``hypervolume``, ``filter``, ``select``, ``compare``), the
knobs' importance from its Optuna journal (``importance``), and a grid study's knob effects
(``effects``).

Reading results needs neither Ray nor torch.
"""

from search.results.compare import Comparison, compare_studies
from search.results.effects import knob_effects, study_effects
from search.results.filter import filter_trials
from search.results.hypervolume import front_hypervolume, hypervolume
from search.results.front import compute_front
from search.results.importance import importance_warnings, knob_importance
from search.results.location import StudyLocation, default_cache_dir, is_uri, study_location
from search.results.pareto import pareto_front, pareto_mask
from search.results.query import Experiment, front_of, load, load_experiment, load_trials, study_dir
from search.results.select import select
from search.results.store import EPOCH_COLUMNS, PROGRESS_COLUMNS, TRIAL_COLUMNS, ResultsStore, read_table

__all__ = [
    "ResultsStore",
    "TRIAL_COLUMNS",
    "EPOCH_COLUMNS",
    "PROGRESS_COLUMNS",
    "read_table",
    "StudyLocation",
    "study_location",
    "default_cache_dir",
    "is_uri",
    "study_dir",
    "load",
    "load_experiment",
    "load_trials",
    "front_of",
    "compute_front",
    "Experiment",
    "pareto_front",
    "pareto_mask",
    "hypervolume",
    "front_hypervolume",
    "filter_trials",
    "select",
    "compare_studies",
    "Comparison",
    "knob_importance",
    "importance_warnings",
    "knob_effects",
    "study_effects",
]

"""The search spec: one YAML file read and validated into a frozen :class:`SearchSpec`.

    records.py     the spec's sections (dataset, models and knobs, objectives, budget, sampler,
                   scheduler, resources), each a pydantic record checking its own values
    spec.py        SearchSpec: the sections together, what they mean together, the spec hash
    profiles.py    a file's ``profiles:`` block: named overrides, one picked with --profile
    loading.py     a YAML file -> its profile's SearchSpec, every problem one line
    checks.py      the checks that need the whole spec: a knob defined once, training values valid
    meta.py        models built on the meta device: names, arguments and knob values checked
    validation.py  pydantic speaking the spec's language (field types, one-line errors)
"""

from search.spec.loading import load_spec, pick_profile, read_yaml
from search.spec.meta import check_model, check_model_args
from search.spec.profiles import SpecProfiles, deep_merge
from search.spec.records import (
    OBJECTIVE_METRICS,
    RANKINGS,
    AlgorithmSpec,
    Budget,
    ConfirmSpec,
    DatasetSpec,
    ModelSpec,
    Objective,
    ParamSpec,
    Resources,
    SchedulerSpec,
    ThroughputSettingsField,
    TrainSettingsField,
)
from search.spec.spec import SearchSpec, grid_values, to_plain

__all__ = [
    "SearchSpec",
    "DatasetSpec",
    "ModelSpec",
    "ParamSpec",
    "Objective",
    "Budget",
    "ConfirmSpec",
    "AlgorithmSpec",
    "SchedulerSpec",
    "Resources",
    "TrainSettingsField",
    "ThroughputSettingsField",
    "load_spec",
    "pick_profile",
    "read_yaml",
    "deep_merge",
    "SpecProfiles",
    "check_model",
    "check_model_args",
    "to_plain",
    "grid_values",
    "OBJECTIVE_METRICS",
    "RANKINGS",
]

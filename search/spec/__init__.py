"""The search spec: one YAML file read and validated into a frozen :class:`SearchSpec`."""

from search.spec.spec import (
    OBJECTIVE_METRICS,
    AlgorithmSpec,
    Budget,
    DatasetSpec,
    ModelSpec,
    Objective,
    ParamSpec,
    Resources,
    SchedulerSpec,
    SearchSpec,
    SpecProfiles,
    deep_merge,
    load_spec,
    pick_profile,
)

__all__ = [
    "SearchSpec",
    "DatasetSpec",
    "ModelSpec",
    "ParamSpec",
    "Objective",
    "Budget",
    "AlgorithmSpec",
    "SchedulerSpec",
    "Resources",
    "load_spec",
    "pick_profile",
    "deep_merge",
    "SpecProfiles",
    "OBJECTIVE_METRICS",
]

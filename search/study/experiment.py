"""The study's record, ``experiment.json``: written once when a study starts (the spec as run, its
hash, the objectives, the code's commit, the dataset's content hash), read back to resume it.

A resume runs the spec recorded here, not the YAML file it came from: the file may have changed
since, and the study goes on as it began.
"""

from __future__ import annotations

import datetime as dt

from search.results.location import STUDY_FILES, StudyLocation
from search.results.query import read_experiment_json
from search.results.store import write_json_atomic
from search.spec import SearchSpec, to_plain
from search.spec.validation import SpecLocation, from_plain
from trainers import folder_problem, tracked_files_modified
from trainers.data import PreparedDataset
from trainers.errors import ConfigError

__all__ = ["EXPERIMENT_FILE", "check_new_study", "write_experiment", "recorded_spec", "no_study"]

EXPERIMENT_FILE = "experiment.json"


def check_new_study(location: StudyLocation) -> None:
    """A new study can start at ``location``: a folder this process can write, holding no study."""
    if location.uri is None:
        problem = folder_problem(location.local)
        if problem:
            raise ConfigError(f"{location}: {problem}; pass --storage DIR, a folder you can write to")
    if location.exists("trials.parquet") or location.exists(EXPERIMENT_FILE):
        raise ConfigError(
            f"{location} already holds a study; pass --name NEW_NAME (or --storage DIR) for a new one, "
            "or delete that folder to start over"
        )


def write_experiment(spec: SearchSpec, location: StudyLocation, data: PreparedDataset, commit: str | None) -> None:
    """A new study's experiment.json, uploaded with a URI; the staging folder emptied of any files
    an earlier study at that URI (since deleted there) left behind."""
    exp_dir = location.local
    if location.uri:
        for name in STUDY_FILES:
            (exp_dir / name).unlink(missing_ok=True)
    write_json_atomic(
        {
            "name": spec.name,
            "spec": to_plain(spec),
            "spec_hash": spec.spec_hash,
            "objectives": [[o.metric, o.mode] for o in spec.objectives],
            "reference_point": spec.reference_point,
            "git_commit": commit,
            "git_dirty": tracked_files_modified(),  # the commit alone does not say what ran (None: no checkout)
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "dataset": {"content_hash": data.content_hash, "counts": data.counts},
        },
        exp_dir / EXPERIMENT_FILE,
    )
    location.push([EXPERIMENT_FILE])


def recorded_spec(location: StudyLocation) -> SearchSpec:
    """The spec the study at ``location`` was started with (with a URI: pulled into the staging folder first)."""
    meta_path = location.local / EXPERIMENT_FILE
    if not meta_path.is_file():
        raise no_study(location)
    meta = read_experiment_json(meta_path)  # (trials.parquet may not be there yet)
    if not isinstance(meta.get("spec"), dict):
        raise ConfigError(f"{meta_path}: no 'spec' object; the study's files are damaged")
    plain = dict(meta["spec"])
    plain.pop("source", None)
    return from_plain(SearchSpec, plain, SpecLocation(str(meta_path)))


def no_study(location: StudyLocation) -> ConfigError:
    """The error for a folder (or URI) that holds no study to resume."""
    return ConfigError(f"{location}: no experiment.json; pass the folder of a study started by `python -m search run`")

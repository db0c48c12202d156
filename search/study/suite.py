"""A suite of studies run one after another to the end: what `python -m search claims` runs.

Each study is its own `python -m search run` (or `resume`) process, so one study's Ray session,
threads and memory are gone before the next starts, and its output is what that command prints.
A study already finished is left as it is; one with fewer trials than its spec plans (its driver
was stopped) is resumed; so running the suite again after a kill finishes what is missing. A study
whose experiment.json records another spec hash than its spec has now (the file was edited since
it ran: another study) is stale: its folder is moved aside (``NAME.stale-HASH``, kept, never
deleted) and the study run anew.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from search.results.location import study_location
from search.results.query import load_trials, read_experiment_json
from search.results.replicates import REPLICATE_COLUMN
from search.spec import SearchSpec, load_spec

__all__ = ["SuiteStudy", "SuiteFailed", "study_state", "recorded_hash", "suite_studies", "run_suite"]


class SuiteFailed(RuntimeError):
    """A study's command failed: the suite stopped there (its message is one line)."""


@dataclass(frozen=True)
class SuiteStudy:
    name: str  # the spec's file stem
    spec_path: Path
    spec: SearchSpec
    folder: str  # where its results are (the spec's name under the suite's storage)


def recorded_hash(study: SuiteStudy) -> str | None:
    """The spec hash the study's experiment.json records (None: no experiment.json, or no hash)."""
    meta = study_location(study.folder).local / "experiment.json"
    if not meta.is_file():
        return None
    return read_experiment_json(meta).get("spec_hash")


def study_state(study: SuiteStudy) -> tuple[str, int]:
    """('missing' | 'stale' | 'unfinished' | 'done', the search trials recorded so far); stale: its
    experiment.json records another spec hash than its spec has now."""
    folder = study_location(study.folder).local
    if not (folder / "experiment.json").is_file():
        return "missing", 0
    trials = load_trials(study.folder)
    if REPLICATE_COLUMN in trials:
        trials = trials[trials[REPLICATE_COLUMN].isna()]
    done = len(trials)
    if recorded_hash(study) != study.spec.spec_hash:
        return "stale", done
    return ("done" if done >= study.spec.planned_trials else "unfinished"), done


def _set_aside(study: SuiteStudy) -> Path:
    """Move a stale study's folder to NAME.stale-HASH (a free name), so the new one starts empty."""
    folder = Path(study.folder)
    base = folder.with_name(f"{folder.name}.stale-{str(recorded_hash(study) or 'unknown')[:16]}")
    target, k = base, 1
    while target.exists():
        k += 1
        target = base.with_name(f"{base.name}-{k}")
    shutil.move(str(folder), str(target))
    return target


def suite_studies(spec_paths: Sequence[Path], *, profile: str | None, storage: str) -> list[SuiteStudy]:
    """Each spec read (with ``profile``) and placed under ``storage``; every spec is validated
    before anything runs, so a broken one costs nothing."""
    out = []
    for path in spec_paths:
        spec = load_spec(path, profile=profile).with_overrides(storage=storage)
        out.append(SuiteStudy(Path(path).stem, Path(path), spec, str(study_location(storage, spec.name).local)))
    return out


def run_suite(studies: Sequence[SuiteStudy], *, profile: str | None, out: TextIO | None = None) -> dict[str, float]:
    """Run every study that is missing, stale or unfinished, in order; {study name: seconds its
    command took} for the ones run. A command that fails stops the suite with :class:`SuiteFailed`
    naming it (the studies before it are kept; running the suite again goes on from there)."""
    out = out or sys.stdout
    walls: dict[str, float] = {}
    for study in studies:
        state, done = study_state(study)
        if state == "done":
            print(f"claims: {study.name}: done ({done} trials in {study.folder})", file=out, flush=True)
            continue
        if state == "stale":
            old = recorded_hash(study)
            kept = _set_aside(study)
            print(f"claims: {study.name}: stale (run with spec hash {old}, {study.spec_path} has {study.spec.spec_hash} "
                  f"now): its {done} trials moved to {kept}", file=out, flush=True)
            state = "missing"
        if state == "missing":
            command = [sys.executable, "-m", "search", "run", str(study.spec_path), "--storage",
                       str(Path(study.folder).parent)]
            if profile:
                command += ["--profile", profile]
        else:
            command = [sys.executable, "-m", "search", "resume", study.folder]
        print(f"claims: {study.name}: {'running' if state == 'missing' else f'resuming ({done} trials so far)'}: "
              f"{' '.join(command[1:])}", file=out, flush=True)
        started = time.perf_counter()
        returncode = subprocess.run(command, check=False).returncode  # its output goes where ours does
        walls[study.name] = time.perf_counter() - started
        if returncode != 0:
            raise SuiteFailed(f"study {study.name}: `python -m search {' '.join(command[3:])}` exited {returncode} "
                              "(its output is above); fix that, then run the claims again to go on from there")
    return walls

"""The main job end to end: time to the first epoch, to the end, trials, front, throughput span.

Runs ``python -m search run SPEC`` (the README's main command, on the embedded local Ray) as a
user would, reads its stdout as it comes and the study's Parquet files at the end, and writes
``benchmarks/results/main_job-<device>.json``:

    ./with-deps python -m benchmarks main_job [--spec spaces/convit_locality.yaml] [--profile NAME]
        [--runs 2 --fresh-caches]     # the first run on empty caches (kernels, datasets,
                                      # throughput), the later ones on what it left
        [--cache-home DIR [--append]] # the same, one run per invocation: DIR kept between them
        [--algorithm botorch --levels 5] # the spec with another sampler (in the profile run);
                                         # the record adds its proposal seconds at the end


Set-up is everything before Tune's first trial (spec, dataset conversion, kernel builds, Ray's
start); it ends when the run prints its ``study NAME: ...`` line. The first epoch's start is
read as its report's time less the epoch's wall time, an upper bound (the report also waits for
the throughput measurement after the first epoch).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from search.results.front import front_groups

__all__ = ["main", "summarise_run", "front_span", "run_once", "with_algorithm", "proposal_seconds"]

ROOT = Path(__file__).resolve().parent.parent


def front_span(throughputs: Sequence[float]) -> dict[str, Any]:
    """The front's throughputs: max over min (the span) and the smallest ratio between
    neighbours (sorted), which a ±15% measurement noise must not cover (above 1.15 / 0.85)."""
    values = sorted(float(t) for t in throughputs)
    if not values:
        return {"span": None, "closest_neighbours_ratio": None}
    ratios = [b / a for a, b in zip(values, values[1:]) if a > 0]
    return {"span": values[-1] / values[0] if values[0] > 0 else None,
            "closest_neighbours_ratio": min(ratios) if ratios else None}


def summarise_run(*, trials: Any, epochs: Any, front: Any, started_at: dt.datetime, setup_done_s: float | None,
                  finished_s: float, objectives: Sequence[Sequence[str]]) -> dict[str, Any]:
    """One run's record from its study's tables (pandas frames of trials.parquet, epochs.parquet,
    pareto.parquet), the command's start (UTC), when its set-up ended and when it exited
    (seconds after the start)."""
    states = {str(k): int(v) for k, v in trials["state"].value_counts().items()} if len(trials) else {}
    first_report_s = first_start_s = first_trial_to_epoch_s = None
    reported = epochs[(epochs["epoch"] == 1) & epochs["reported_at"].notna()] if len(epochs) else epochs
    if len(reported):
        row = reported.sort_values("reported_at").iloc[0]
        at = row["reported_at"].to_pydatetime()
        first_report_s = (at - started_at).total_seconds()
        first_start_s = first_report_s - float(row["epoch_time_s"])
        trial = trials[trials["trial_id"] == row["trial_id"]]
        if len(trial) and trial["started_at"].notna().all():
            first_trial_to_epoch_s = first_start_s - (trial["started_at"].iloc[0].to_pydatetime() - started_at).total_seconds()
    complete = trials[trials["state"] == "COMPLETE"] if len(trials) else trials
    front_rows = [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()
                   if k in ("trial_id", "val_acc", "throughput", "params", "flops", "epochs_run", "tied_with")}
                  for r in front.to_dict("records")] if len(front) else []
    return {
        "seconds": {
            "setup": setup_done_s,
            "total": finished_s,
            "after_setup": None if setup_done_s is None else finished_s - setup_done_s,
            "to_first_epoch_start": first_start_s,  # an upper bound: see the module's docstring
            "to_first_epoch_report": first_report_s,
            "first_trial_start_to_first_epoch_start": first_trial_to_epoch_s,
        },
        "trials": {"finished": int(len(trials)), **states},
        "objectives": [list(o) for o in objectives],
        "front_size": len(front_rows),
        "front_separated_groups": front_groups(front, [tuple(o) for o in objectives]) if len(front) else 0,
        "front": front_rows,
        "throughput": front_span([r["throughput"] for r in front_rows]),
        "best_val_acc": float(complete["val_acc"].max()) if len(complete) else None,
        "epochs_trained": int(len(epochs)),
    }


def run_once(*, spec: str, profile: str | None, storage: Path, env: dict[str, str], echo: bool = True,
             extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """One ``python -m search run`` (with ``extra_args``, e.g. ``--data-dir``): its record (`summarise_run`)."""
    from search.results.query import load_trials, front_of
    import pandas as pd

    command = [sys.executable, "-m", "search", "run", spec, "--storage", str(storage)]
    if profile:
        command += ["--profile", profile]
    command += list(extra_args)
    started_at = dt.datetime.now(dt.timezone.utc)
    start = time.perf_counter()
    setup_done_s = None
    lines = []
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if setup_done_s is None and line.startswith("study "):
                setup_done_s = time.perf_counter() - start
            lines.append(line.rstrip("\n"))
            if echo:
                print(line, end="", flush=True)
        code = proc.wait()
    finished_s = time.perf_counter() - start
    studies = [p for p in storage.iterdir() if (p / "trials.parquet").exists()]
    if code != 0 or len(studies) != 1:
        raise SystemExit(f"error: the run exited with {code}; last lines:\n" + "\n".join(lines[-15:]))
    study = studies[0]
    trials = load_trials(study)
    epochs = pd.read_parquet(study / "epochs.parquet")
    front, objectives = front_of(study)  # its members; the candidates dominated within noise left out
    record = summarise_run(trials=trials, epochs=epochs, front=front, started_at=started_at,
                           setup_done_s=setup_done_s, finished_s=finished_s, objectives=objectives)
    record["front_as_printed"] = _front_table(lines)
    record["proposal_seconds_at_end"] = proposal_seconds(spec, profile=profile, study=study)
    return record


def with_algorithm(spec: str, *, profile: str | None, algorithm: dict[str, Any], into: Path) -> str:
    """A copy of ``spec`` in ``into`` whose run (``profile``, else the default profile or the spec
    as written) takes ``algorithm``'s keys over its own; only that profile changes."""
    import yaml

    from search.spec.loading import pick_profile

    data = yaml.safe_load((ROOT / spec).read_text())
    chosen = pick_profile(ROOT / spec, profile=profile)[0]
    section = data["profiles"][chosen] if chosen else data
    # deep-merged over the file's algorithm in that profile only: the others keep the file's (a
    # botorch space of one may be too big for another)
    section["algorithm"] = {**(section.get("algorithm") or {}), **algorithm}
    path = into / Path(spec).name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def proposal_seconds(spec: str, *, profile: str | None, study: Path, repeats: int = 3) -> dict[str, Any] | None:
    """Wall seconds of the study's sampler proposing one more trial once the run has ended, from its
    Optuna journal: a fresh sampler each time, so a model-based one fits its model (as after each
    COMPLETE trial) and scores its candidates. The trials asked here are marked FAIL."""
    import optuna

    from search.results.location import JOURNAL_FILE
    from search.spec import load_spec
    from search.study.searcher import make_sampler, optuna_space

    if not (study / JOURNAL_FILE).exists():  # a grid study samples nothing
        return None
    spec_record = load_spec(ROOT / spec, profile=profile)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(study / JOURNAL_FILE)))
    name = optuna.get_all_study_names(storage)[0]
    held = optuna.load_study(study_name=name, storage=storage)
    states = [t.state.name for t in held.trials]
    seconds = []
    for _ in range(repeats):
        asking = optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(spec_record))
        start = time.perf_counter()
        trial = asking.ask()
        optuna_space(spec_record)(trial)
        seconds.append(time.perf_counter() - start)
        asking.tell(trial, state=optuna.trial.TrialState.FAIL)
    return {"algorithm": spec_record.algorithm.name, "trials": len(states), "complete": states.count("COMPLETE"),
            "seconds": seconds}


def _front_table(lines: list[str]) -> list[str]:
    """The lines the run printed from 'Pareto front' to the 'results:' line after its tables (the
    members, then those dominated within noise)."""
    for i, line in enumerate(lines):
        if line.startswith("Pareto front"):
            table = []
            for row in lines[i:]:
                if row.startswith("results:"):
                    break
                table.append(row)
            while table and not table[-1].strip():
                table.pop()
            return table
    return []


def _line(record: dict[str, Any]) -> str:
    """A run's record in one line."""
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    s = record["seconds"]
    return (f"set-up {fmt(s['setup'], '.0f')} s, after set-up {fmt(s['after_setup'], '.0f')} s, total "
            f"{fmt(s['total'], '.0f')} s; first epoch started by {fmt(s['to_first_epoch_start'], '.0f')} s; "
            f"{record['trials']['finished']} trials, front {record['front_size']} "
            f"({record.get('front_separated_groups', '-')} groups apart), span "
            f"{fmt(record['throughput']['span'], '.2f')}x, closest neighbours "
            f"{fmt(record['throughput']['closest_neighbours_ratio'], '.2f')}x, best val_acc {fmt(record['best_val_acc'], '.4f')}")


def _earlier_runs(result_name: str, *, spec: str, profile: str | None) -> list[dict]:
    """The runs --append adds to: those of this machine's result file, which must be of the same
    spec and profile (checked before anything runs, so a mismatch overwrites nothing)."""
    from benchmarks._env import RESULTS_DIR, environment, result_slug

    earlier = RESULTS_DIR / f"{result_name}-{result_slug(environment())}.json"
    if not earlier.exists():
        return []
    result = json.loads(earlier.read_text())
    config = result.get("config", {})
    if (config.get("spec"), config.get("profile")) != (spec, profile):
        print(f"error: --append: {earlier.name} holds runs of --spec {config.get('spec')} --profile "
              f"{config.get('profile')}; pass those, or another --result-name for this spec", file=sys.stderr)
        raise SystemExit(2)
    return result["runs"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks main_job", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="spaces/convit_locality.yaml")
    parser.add_argument("--profile", help="the spec's profile (default: its default_profile)")
    parser.add_argument("--runs", type=int, default=1, help="runs one after another (default 1)")
    parser.add_argument("--fresh-caches", action="store_true",
                        help="the first run on empty caches (XDG_CACHE_HOME: kernels, converted datasets, "
                        "throughput), as on a machine that never ran the project; later runs reuse them")
    parser.add_argument("--cache-home", metavar="DIR",
                        help="XDG_CACHE_HOME for the runs, kept after them (a run on an empty one is a first run; "
                        "pass the same DIR again for a second run)")
    parser.add_argument("--append", action="store_true",
                        help="add this invocation's runs to the result file's (same spec and profile)")
    parser.add_argument("--result-name", default="main_job")
    parser.add_argument("--algorithm", help="run the spec with this algorithm.name (its profile's; e.g. botorch)")
    parser.add_argument("--levels", type=int, help="with --algorithm botorch: algorithm.levels")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    import torch

    from benchmarks._env import write_result

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    env.pop("LOCALITY_SEARCH_CACHE", None)
    runs = []
    if args.fresh_caches and args.cache_home:
        parser.error("--fresh-caches uses a new empty cache; --cache-home names one: pass one of them")
    previous = _earlier_runs(args.result_name, spec=args.spec, profile=args.profile) if args.append else []
    with tempfile.TemporaryDirectory(prefix="main-job-") as scratch:
        home = Path(args.cache_home).resolve() if args.cache_home else Path(scratch) / "cache" if args.fresh_caches else None
        if home is not None:
            env["XDG_CACHE_HOME"] = str(home)
        algorithm = {k: v for k, v in (("name", args.algorithm), ("levels", args.levels)) if v is not None}
        spec = with_algorithm(args.spec, profile=args.profile, algorithm=algorithm, into=Path(scratch)) \
            if algorithm else args.spec
        for i in range(args.runs):
            storage = Path(scratch) / f"run{i + 1}"
            storage.mkdir()
            caches = "as found" if home is None else "warm" if home.exists() and any(home.iterdir()) else "fresh"
            print(f"== run {i + 1}/{args.runs} (caches: {caches})", flush=True)
            record = run_once(spec=spec, profile=args.profile, storage=storage, env=env)
            runs.append({"run": i + 1, "caches": caches, **record})
            print(f"== run {i + 1}: {_line(record)}", flush=True)
    runs = previous + [{**r, "run": len(previous) + r["run"]} for r in runs]
    path = write_result(args.result_name, {
        "config": {"spec": args.spec, "profile": args.profile, "algorithm": algorithm or None, "runs": len(runs),
                   "fresh_caches": args.fresh_caches,
                   "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "runs": runs,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

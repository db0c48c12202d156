"""Kill soak: N small real studies, each driver SIGKILLed at a uniformly random moment, then resumed.

Each run is ``python -m search run`` of spaces/synthetic_smoke.yaml (synthetic data, a local Ray)
at --trials x --max-epochs, then its confirmation stage (``budget.confirm``: the best config trained
again with --confirm further seeds; 0: none), SIGKILLed at a moment drawn uniformly from [0, window] after its start
(window: --window, else the length of one unkilled run measured first), so kills land in
proportion to the time each phase takes: start-up, Ray's start, trials, the Parquet and journal
writes, the last write and the front's print. Meanwhile an independent reader (pyarrow, each file
opened once) reads every store file every --poll seconds. Then ``python -m search resume``; a
study killed before its experiment.json or Ray Tune's first snapshot cannot be resumed (resume
says so in one line, exit 2) and is run again under another name, as that line says. After each run:

- exactly the requested trials in trials.parquet, each id once, each COMPLETE, or FAILED with its
  error (a diverged loss: data, not a resume fault); and exactly the replicates confirm.json asks
  for, one per (config, seed);
- no (trial_id, epoch) twice in epochs.parquet, and one row per epoch each trial ran;
- every Parquet file readable by pyarrow, at every poll and after;
- the Optuna journal: nothing RUNNING, every stored trial's config among its trials;
- no temporary file left beside the store's files.

The phase a kill landed in is read from what was there at the moment: ``setup`` (no store files
yet: the spec, the data, Ray's start), ``ray`` (store files, no epoch yet), ``trials`` (epochs
reported, fewer trials finished than requested), ``confirm`` (the search's trials recorded, the
replicates not all yet), ``final`` (every trial recorded: the last write,
the front's print, Ray's shutdown) and ``after_exit`` (the driver had finished). A store temporary
file present, or the journal grown since the previous poll, marks the kill as during a write.

With ``--worker-kills M``, M more runs on a two-node Ray cluster on this machine
(benchmarks/_cluster.py: head and worker, one trial slot each): the worker node SIGKILLed at a
moment drawn uniformly from [0, --worker-window] after the driver's start; the driver carries on
(``budget.max_failures`` retries the worker's trial from its last checkpoint on the head) and must
end by itself with the same checks. The phase is ``worker_training`` (a trial was training on the
worker), ``worker_idle`` (trials under way, none on the worker), ``startup`` (no epoch yet) or
``after_exit``.

    python -m benchmarks kill_soak --runs 20 --worker-kills 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from benchmarks._env import write_result

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spaces" / "synthetic_smoke.yaml"
FILES = ("trials.parquet", "epochs.parquet", "pareto.parquet", "progress.parquet")
JOURNAL = "optuna.journal"
PHASES = ("setup", "ray", "trials", "confirm", "final", "after_exit")
CONFIRM_FILE = "confirm.json"


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ, LOCALITY_SEARCH_CACHE=str(cache), PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, never the user's cluster
    return env


def write_spec(folder: Path, name: str, *, trials: int, max_epochs: int, seed: int, confirm: int = 0) -> Path:
    """spaces/synthetic_smoke.yaml as study ``name`` under ``folder``/results; with ``confirm``,
    the front's best config trained again with that many further seeds."""
    spec = yaml.safe_load(SPEC.read_text())
    spec.update(name=name, storage=str(folder / "results"), algorithm={"name": "random", "seed": seed})
    spec["budget"].update(trials=trials, max_epochs=max_epochs, grace_epochs=1)
    if confirm:
        spec["budget"]["confirm"] = {"seeds": confirm, "top": 1}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def read_store(study: Path) -> dict[str, list[dict[str, Any]]]:
    """Every store file there, each opened once, as an independent reader would; raises where one
    is torn or not Parquet."""
    out = {}
    for name in FILES:
        path = study / name
        if path.exists():
            with pa.OSFile(str(path)) as handle:
                out[name] = pq.read_table(handle).to_pylist()
    return out


def _phase(study: Path, tables: dict[str, list], trials: int, confirm: int) -> str:
    if not tables:
        return "setup"
    if not tables.get("epochs.parquet"):
        return "ray"
    rows = tables.get("trials.parquet", [])
    replicates = sum(t.get("replicate_of") is not None for t in rows)
    if len(rows) - replicates < trials:
        return "trials"
    if confirm and (not (study / CONFIRM_FILE).is_file() or replicates < len(_planned(study))):
        return "confirm"
    return "final"


def _planned(study: Path) -> list[tuple[str, int]]:
    """(search trial, seed) of each replicate confirm.json asks for (empty: no plan yet)."""
    try:
        plan = json.loads((study / CONFIRM_FILE).read_text())
    except (OSError, ValueError):
        return []
    return sorted((c["replicate_of"], c["seed"]) for c in plan["configs"])


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _stop(process: subprocess.Popen) -> None:
    """SIGKILL the driver alone (as a crash or the OOM killer would), then what it left behind:
    its local Ray's processes share its session."""
    try:
        os.kill(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=60)
    time.sleep(2)  # Ray's reaper takes the dead driver's local cluster down ...
    try:
        os.killpg(process.pid, signal.SIGKILL)  # ... and whatever it missed goes now
    except ProcessLookupError:
        pass


def run_killed(spec: Path, study: Path, env: dict[str, str], log: Path, *, kill_at: float | None, trials: int,
               poll: float, confirm: int = 0) -> dict[str, Any]:
    """``search run spec``, SIGKILLed ``kill_at`` s after its start (None: left to finish);
    where the kill landed and what the reader saw meanwhile."""
    started = time.monotonic()
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, "-m", "search", "run", str(spec)], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    polls, torn, phase, journal_size, journal_grew = 0, [], "setup", 0, False
    tmp: list[str] = []
    try:
        while True:
            now = time.monotonic() - started
            if driver.poll() is not None:
                phase = "after_exit"
                break
            if kill_at is not None and now >= kill_at:
                break
            try:
                tables = read_store(study)
            except Exception as exc:  # noqa: BLE001  (a torn file is the finding, not a crash of the soak)
                torn.append(f"{now:.2f} s: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                tables = {}
            polls += 1
            phase = _phase(study, tables, trials, confirm)
            size = (study / JOURNAL).stat().st_size if (study / JOURNAL).exists() else 0
            journal_grew, journal_size = size != journal_size, size
            tmp = sorted(p.name for p in study.glob(".*.tmp")) if study.exists() else []
            if kill_at is None and now > 900:
                raise RuntimeError(f"{spec.name}: an unkilled run took over 900 s; see {log}")
            time.sleep(poll)
        killed_at = time.monotonic() - started
    finally:
        _stop(driver)
    return {
        "kill_at_s": None if kill_at is None else round(kill_at, 2),
        "killed_at_s": round(killed_at, 2),
        "phase": phase,
        "during_store_write": bool(tmp) and phase != "after_exit",
        "during_journal_write": journal_grew and phase != "after_exit",
        "tmp_files_at_kill": tmp,
        "exit_code": driver.returncode,
        "last_line": _last_line(log),
        "polls": polls,
        "torn_reads": torn,
    }


def check_study(study: Path, name: str, trials: int, max_epochs: int, confirm: int = 0) -> list[str]:
    """What is wrong with the finished study (empty: nothing); ``confirm``: the further seeds it asked for."""
    import optuna

    problems: list[str] = []
    try:
        tables = read_store(study)
    except Exception as exc:  # noqa: BLE001
        return [f"a store file is unreadable after the resume: {type(exc).__name__}: {exc}"]
    missing = [n for n in FILES if n not in tables]
    if missing:
        return [f"no {', '.join(missing)} after the resume"]
    every = tables["trials.parquet"]
    rows = [t for t in every if t.get("replicate_of") is None]  # the search's trials
    replicates = [t for t in every if t.get("replicate_of") is not None]
    ids = [t["trial_id"] for t in every]
    if len(rows) != trials or len(set(ids)) != len(ids):
        problems.append(f"{len(rows)} trial rows ({len(set(ids))} distinct ids of {len(ids)} rows), {trials} requested")
    planned = _planned(study)
    if confirm and any(t["state"] == "COMPLETE" for t in rows) and len(planned) != confirm:
        problems.append(f"confirm.json plans {len(planned)} replicates, {confirm} asked for")
    if sorted((t["replicate_of"], t["seed"]) for t in replicates) != planned:
        problems.append(f"replicates {sorted((t['replicate_of'], t['seed']) for t in replicates)}, planned {planned}")
    for t in rows + replicates:
        complete = t["state"] == "COMPLETE" and t["epochs_run"] == max_epochs
        marked = t["state"] == "FAILED" and bool(t["error"])  # e.g. a diverged loss: recorded, not lost
        if not (complete or marked):
            problems.append(f"trial {t['trial_id']}: {t['state']} after {t['epochs_run']} of {max_epochs} epochs "
                            f"({t['stop_reason']}, error {t['error']!r})")
    pairs = [(e["trial_id"], e["epoch"]) for e in tables["epochs.parquet"]]
    if len(pairs) != len(set(pairs)):
        problems.append(f"{len(pairs) - len(set(pairs))} duplicate (trial_id, epoch) rows in epochs.parquet")
    ran = sum(t["epochs_run"] or 0 for t in every)
    if len(set(pairs)) != ran:
        problems.append(f"{len(set(pairs))} epoch rows for {ran} epochs run")
    if sorted(p["finished"] for p in tables["progress.parquet"]) != list(range(1, len(every) + 1)):
        problems.append("progress.parquet does not count the trials 1..N")
    leftover = sorted(p.name for p in study.glob(".*.tmp"))
    if leftover:
        problems.append(f"temporary files left: {leftover}")
    # the Optuna journal (as optuna-dashboard opens it) agrees with the store
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(study / JOURNAL)))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opt = optuna.load_study(study_name=name, storage=journal)
    states = [t.state.name for t in opt.trials]
    if "RUNNING" in states:
        problems.append(f"Optuna trials left RUNNING: {states.count('RUNNING')}")
    sampled = {round(t.params["lr"], 12) for t in opt.trials if "lr" in t.params}
    stored = {round(t["lr"], 12) for t in rows}
    if not stored <= sampled:
        problems.append(f"{len(stored - sampled)} stored trials' configs are not in the Optuna journal")
    finished = sum(1 for s in states if s == "COMPLETE")
    # a trial that finished after Tune's last snapshot is COMPLETE in the journal but sampled again
    if not len([t for t in rows if t["state"] == "COMPLETE"]) <= finished <= trials + 1:
        problems.append(f"Optuna journal has {finished} COMPLETE trials for {trials} in the store")
    return problems


def soak_one(index: int, folder: Path, *, kill_at: float | None, trials: int, max_epochs: int, poll: float,
             cache: Path, confirm: int = 0) -> dict[str, Any]:
    name = f"soak{index}"
    seed = index if index >= 0 else 10_000  # the unkilled calibration run is index -1 (seeds are >= 0)
    spec = write_spec(folder, name, trials=trials, max_epochs=max_epochs, seed=seed, confirm=confirm)
    study = folder / "results" / name
    env = _env(cache)
    record = {"run": index, **run_killed(spec, study, env, folder / f"{name}-run.log", kill_at=kill_at, trials=trials,
                                          poll=poll, confirm=confirm)}
    record["resume"] = None
    if record["phase"] != "after_exit" or record["exit_code"] != 0:
        resumed = subprocess.run([sys.executable, "-m", "search", "resume", str(study)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=900)
        errors = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
        record["resume"] = {"exit_code": resumed.returncode, "error": errors[-1] if errors else None}
        if resumed.returncode == 2 and errors and ("saved no state" in errors[-1] or "no experiment.json" in errors[-1]):
            # killed before the study's first file or Tune's first snapshot: nothing to resume, as
            # the line says; run it again (under another name, as a half-made folder asks)
            name = f"{name}-again"
            spec = write_spec(folder, name, trials=trials, max_epochs=max_epochs, seed=seed, confirm=confirm)
            study = folder / "results" / name
            rerun = subprocess.run([sys.executable, "-m", "search", "run", str(spec)], cwd=ROOT, env=env,
                                   capture_output=True, text=True, timeout=900)
            record["resume"]["rerun_exit_code"] = rerun.returncode
        elif resumed.returncode != 0:
            record["problems"] = [f"resume exited {resumed.returncode}: "
                                  f"{(errors or resumed.stderr.splitlines() or [''])[-1][:300]}"]
            return record
    record["study"] = str(study)
    record["problems"] = record["torn_reads"] + check_study(study, name, trials, max_epochs, confirm)
    return record


WORKER_TRIALS, WORKER_EPOCHS = 4, 8


def worker_kill_one(index: int, folder: Path, *, kill_at: float, poll: float) -> dict[str, Any]:
    """One study on a fresh two-node cluster, its worker node SIGKILLed ``kill_at`` s after the
    driver started; the driver left to finish."""
    from benchmarks._cluster import Cluster, two_node_spec

    root = folder / f"cluster{index}"
    root.mkdir(parents=True)
    cluster = Cluster(root)
    study = root / "results" / "two_nodes"
    record: dict[str, Any] = {"run": index, "kill_at_s": round(kill_at, 2), "problems": []}
    try:
        cluster.start_node("head", head=True)
        cluster.wait_for({"head"})
        cluster.start_node("worker", head=False)
        worker_id = cluster.wait_for({"head", "worker"})["worker"]
        spec = root / "two_nodes.yaml"
        spec.write_text(two_node_spec(trials=WORKER_TRIALS, epochs=WORKER_EPOCHS))
        env = {**cluster.env, "LOCALITY_SEARCH_CACHE": str(root / "cache-driver"), "PYTHONPATH": str(ROOT)}
        log = root / "driver.log"
        started = time.monotonic()
        with open(log, "w") as out:
            driver = subprocess.Popen([sys.executable, "-m", "search", "run", str(spec), "--storage", str(root / "results"),
                                       "--address", cluster.address], cwd=ROOT, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        phase, torn = "startup", []
        try:
            while time.monotonic() - started < kill_at:
                if driver.poll() is not None:
                    phase = "after_exit"
                    break
                try:
                    tables = read_store(study)
                except Exception as exc:  # noqa: BLE001  (a torn file is the finding)
                    torn.append(f"{type(exc).__name__}: {exc}")
                    tables = {}
                finished = {t["trial_id"] for t in tables.get("trials.parquet", [])}
                epochs = tables.get("epochs.parquet", [])
                on_worker = {e["trial_id"] for e in epochs if e["node_id"] == worker_id} - finished
                phase = "startup" if not epochs else "worker_training" if on_worker else "worker_idle"
                time.sleep(poll)
            record.update(killed_at_s=round(time.monotonic() - started, 2), phase=phase)
            cluster.kill("worker")
            driver.wait(timeout=900)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait(timeout=60)
        record.update(exit_code=driver.returncode, wall_s=round(time.monotonic() - started, 1),
                      last_line=_last_line(log))
        if driver.returncode != 0:
            record["problems"].append(f"the driver exited {driver.returncode}: {record['last_line']}")
        else:
            record["problems"] += torn + check_study(study, "two_nodes", WORKER_TRIALS, WORKER_EPOCHS)
            trials = read_store(study)["trials.parquet"]
            record["trials_with_failures"] = sum(1 for t in trials if t["failures"])
            record["worker_epochs"] = sum(1 for e in read_store(study)["epochs.parquet"] if e["node_id"] == worker_id)
    finally:
        cluster.stop()
    return record


def worker_soak(runs: int, *, window: float, seed: int, poll: float, folder: Path, out=sys.stdout) -> dict[str, Any]:
    rng = random.Random(seed + 1)
    records = []
    for i in range(runs):
        record = worker_kill_one(i, folder, kill_at=rng.uniform(0.0, window), poll=poll)
        records.append(record)
        print(f"worker kill {i + 1}/{runs}: at {record.get('killed_at_s', 0):.1f} s in {record.get('phase')}; "
              f"trials retried {record.get('trials_with_failures', '-')}; "
              + ("ok" if not record["problems"] else f"FAILED: {record['problems']}"), file=out, flush=True)
    return {
        "runs": runs, "window_s": window, "trials": WORKER_TRIALS, "max_epochs": WORKER_EPOCHS,
        "phases": dict(sorted(Counter(r.get("phase") for r in records).items())),
        "failures": [{"run": r["run"], "phase": r.get("phase"), "problems": r["problems"]} for r in records if r["problems"]],
        "records": records,
    }


def soak(runs: int, *, trials: int, max_epochs: int, window: float | None, seed: int, poll: float,
         folder: Path, confirm: int = 0, out=sys.stdout) -> dict[str, Any]:
    rng = random.Random(seed)
    cache = folder / "cache"
    calibration = None
    if window is None:  # one run left to finish: how long a run takes, the window kills are drawn from
        calibration = soak_one(-1, folder, kill_at=None, trials=trials, max_epochs=max_epochs, poll=poll, cache=cache,
                               confirm=confirm)
        window = calibration["killed_at_s"]
        if calibration["problems"]:  # a window from a run that never got going would put every kill in set-up
            raise RuntimeError(f"the unkilled run failed: {calibration['problems']}; see {folder}/soak-1-run.log")
        print(f"unkilled run: {window:.1f} s ({'ok' if not calibration['problems'] else calibration['problems']})",
              file=out, flush=True)
    records = []
    for i in range(runs):
        kill_at = rng.uniform(0.0, window)
        record = soak_one(i, folder, kill_at=kill_at, trials=trials, max_epochs=max_epochs, poll=poll, cache=cache,
                          confirm=confirm)
        records.append(record)
        writes = [w for w, on in (("store write", record["during_store_write"]),
                                  ("journal write", record["during_journal_write"])) if on]
        print(f"run {i + 1}/{runs}: killed at {record['killed_at_s']:.1f} s in {record['phase']}"
              f"{' during a ' + ' and '.join(writes) if writes else ''}; "
              + ("ok" if not record["problems"] else f"FAILED: {record['problems']}"), file=out, flush=True)
    phases = {p: sum(r["phase"] == p for r in records) for p in PHASES}
    return {
        "runs": runs, "trials": trials, "max_epochs": max_epochs, "confirm": confirm, "window_s": round(window, 2), "seed": seed,
        "phases": phases,
        "during_store_write": sum(r["during_store_write"] for r in records),
        "during_journal_write": sum(r["during_journal_write"] for r in records),
        "not_resumable_rerun": sum(bool(r["resume"] and "rerun_exit_code" in r["resume"]) for r in records),
        "failures": [{"run": r["run"], "phase": r["phase"], "problems": r["problems"]} for r in records if r["problems"]],
        "calibration": calibration,
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kill_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="killed runs (default 20; 0: only --worker-kills)")
    parser.add_argument("--trials", type=int, default=3, help="trials per study (default 3)")
    parser.add_argument("--max-epochs", type=int, default=3, help="epochs per trial (default 3)")
    parser.add_argument("--confirm", type=int, default=2, help="further seeds of the best config after the search "
                        "(budget.confirm; default 2, 0: no confirmation stage)")
    parser.add_argument("--worker-kills", type=int, default=0, help="runs on a two-node cluster whose worker node is "
                        "killed (default 0)")
    parser.add_argument("--worker-window", type=float, default=45.0,
                        help="kill the worker within this many seconds of the driver's start (default 45)")
    parser.add_argument("--window", type=float, help="kill within this many seconds of the start "
                        "(default: the length of one unkilled run, measured first)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between the reader's polls")
    parser.add_argument("--keep", metavar="DIR", help="keep the studies and logs in DIR (default: a temporary folder, removed)")
    parser.add_argument("--result-name", default="kill_soak")
    args = parser.parse_args(argv)
    if args.worker_kills < 0:
        parser.error("--worker-kills must be at least 0")
    if args.runs < 0 or args.trials < 1 or args.max_epochs < 1 or args.confirm < 0:
        parser.error("--trials and --max-epochs must be at least 1, --runs and --confirm at least 0")
    if args.runs == 0 and not args.worker_kills:
        parser.error("nothing to do: --runs 0 needs --worker-kills N")
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kill-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result = (soak(args.runs, trials=args.trials, max_epochs=args.max_epochs, window=args.window, seed=args.seed,
                       poll=args.poll, folder=folder, confirm=args.confirm) if args.runs else
                  {"runs": 0, "phases": {}, "during_store_write": 0, "during_journal_write": 0, "failures": []})
        if args.worker_kills:
            result["worker_kills"] = worker_soak(args.worker_kills, window=args.worker_window, seed=args.seed,
                                                 poll=max(args.poll, 0.2), folder=folder)
            result["failures"] += [{**f, "worker_kill": True} for f in result["worker_kills"]["failures"]]
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    path = write_result(args.result_name, result)
    print(f"{result['runs']} runs; kills by phase {json.dumps(result['phases'])}; during a store write "
          f"{result['during_store_write']}, a journal write {result['during_journal_write']}; "
          f"{len(result['failures'])} failed; wrote {path}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""The zoo study as a user runs it: spaces/locality_zoo.yaml end to end, then its front, seeds, importance.

Runs ``python -m search run spaces/locality_zoo.yaml`` (real Fashion-MNIST, the embedded local
Ray; the spec's confirmation seeds included), then ``report`` and ``importance``, and writes
``zoo_study-<device>.json``: the wall time, every trial (seed, replicate_of, both objectives with
their intervals), the front of configs (means over seeds, ties), the seed spread of each
confirmed config, and the importance table; the report's PNG goes beside it as
``zoo_study-front-<device>.png``. ``--study DIR`` summarises a study already run instead.

    python -m benchmarks zoo_study
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._env import write_result

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["trial_id", "family", "model", "state", "seed", "replicate_of", "val_acc", "val_acc_low", "val_acc_high",
           "throughput", "throughput_low", "throughput_high", "throughput_runtime", "epochs_run", "duration_s"]


def _search(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "search", *args], cwd=ROOT, capture_output=True, text=True)


def summarise(study: Path) -> dict[str, Any]:
    import search

    exp = search.load(study)
    trials, front = exp.trials, exp.front()

    def records(table, columns):
        return json.loads(table[[c for c in columns if c in table]].to_json(orient="records"))

    spread = []
    for config in trials["replicate_of"].dropna().unique() if "replicate_of" in trials else ():
        seeds = trials[(trials["trial_id"] == config) | (trials["replicate_of"] == config)]
        seeds = seeds[seeds["state"] == "COMPLETE"]
        spread.append({"config": config, "family": seeds["family"].iloc[0], "seeds": len(seeds),
                       "val_acc": seeds["val_acc"].tolist(), "mean": float(seeds["val_acc"].mean()),
                       "sd": float(seeds["val_acc"].std(ddof=1)),
                       "range_pp": float(100 * (seeds["val_acc"].max() - seeds["val_acc"].min())),
                       "throughput": float(seeds["throughput"].iloc[0])})
    importance = _search("importance", str(study), "--format", "json")
    return {
        "trials": records(trials, COLUMNS),
        "front": records(front, COLUMNS + ["seeds", "val_acc_sd", "tied_with"]),
        "front_printed": _search("pareto", str(study)).stdout,
        "seed_spread": spread,
        "importance": json.loads(importance.stdout) if importance.returncode == 0 else importance.stderr.strip(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks zoo_study", description=__doc__.splitlines()[0])
    parser.add_argument("--study", help="summarise this study folder instead of running the spec")
    parser.add_argument("--wall-s", type=float, help="with --study: the run's wall time, as measured when it ran")
    args = parser.parse_args(argv)
    wall = args.wall_s
    scratch = None
    if args.study:
        study = Path(args.study)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="zoo-study-"))
        started = time.monotonic()
        run = _search("run", "spaces/locality_zoo.yaml", "--storage", str(scratch))
        wall = time.monotonic() - started
        if run.returncode != 0:
            print(run.stdout[-3000:] + run.stderr[-3000:], file=sys.stderr)
            return 1
        study = scratch / "locality_zoo"
    try:
        report = _search("report", str(study))
        result = {"spec": "spaces/locality_zoo.yaml", "wall_s": wall, **summarise(study)}
        path = write_result("zoo_study", result)
        if report.returncode == 0:
            shutil.copyfile(study / "report-front.png", path.with_name(path.stem.replace("zoo_study", "zoo_study-front") + ".png"))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(result["front_printed"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

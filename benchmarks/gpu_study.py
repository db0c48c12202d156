"""A full-size study on one GPU through Ray Tune: trials per hour, GPU busy, fractional GPUs.

Runs ``python -m search run SPEC --profile gpu`` (the spec's GPU study, cut to fit the run) once per
packing, one after the other on the same GPU: ``--packings 1,4`` runs it with ``resources.gpus: 1``
(one trial at a time) and ``0.25`` (four side by side), each given the host's CPUs divided by the
packing. NVML samples the GPU's utilisation through each whole run. Writes
``benchmarks/results/gpu_study-<device>.json``: per packing the wall time, trials finished and per
hour, GPU busy over the run (and after set-up), time to the first epoch, best val_acc, front size,
hypervolume (the spec's reference point) and the front as printed; then the packings' ratio.

    ./with-deps python -m benchmarks gpu_study --dry-run     # what it would run, no training
    python -m benchmarks gpu_study --data-dir DIR            # on the GPU machine (benchmarks/device.sh gpu_study)
    python -m benchmarks gpu_study --smoke                   # tiny, on the CPU: synthetic data, 2 trials

The spec's profile is copied with its budget, resources (and, with ``--smoke``, its data and space)
replaced, so the study run is the file's own, only shorter.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

__all__ = ["main", "derived_spec", "summarise_packings"]

ROOT = Path(__file__).resolve().parent.parent


def derived_spec(source: dict[str, Any], *, profile: str, packing: int, device: str, cpus: int, trials: int,
                 max_epochs: int, grace_epochs: int, time_limit_s: int | None, smoke: bool) -> dict[str, Any]:
    """The spec ``source`` (parsed YAML) with ``profile``'s budget and resources set for one packing:
    ``packing`` trials share the GPU (``resources.gpus = 1 / packing``) and the host's ``cpus``."""
    spec = copy.deepcopy(source)
    block = spec.setdefault("profiles", {}).setdefault(profile, {})
    budget = dict(block.get("budget") or {})
    budget.update(trials=trials, max_epochs=max_epochs, grace_epochs=grace_epochs)
    # the search alone: trials per hour and GPU use of the search, not of its confirmation seeds
    budget.pop("confirm", None)
    if time_limit_s is not None:
        budget["time_limit_s"] = time_limit_s
    block["budget"] = budget
    per_trial_cpus = max(1, cpus // packing)
    block["resources"] = {"cpus": per_trial_cpus, "gpus": (1.0 / packing) if device == "cuda" else 0}
    if smoke:
        # what the CPU test runs: the study's machinery at a tiny size (the base space, small images)
        block["dataset"] = {"name": "synthetic", "train_fraction": 1.0, "val_fraction": 0.2}
        block.pop("space", None)
        block["train"] = {**(block.get("train") or {}), "batch_size": 64, "num_workers": 1, "pad_crop": 0}
        spec["throughput"] = {"batch_size": 64, "warmup": 1, "repeats": 3}
    spec["default_profile"] = profile
    return spec


def summarise_packings(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Trials per hour of each packing over the first one's, and whether the targets hold: GPU
    busy >= 80% over the study's wall time, four per GPU >= 1.5x the trials per hour of one."""
    base = runs[0]
    out: dict[str, Any] = {"trials_per_hour_vs_first": {}}
    for run in runs:
        if base["trials_per_hour"] and run["trials_per_hour"]:
            out["trials_per_hour_vs_first"][str(run["packing"])] = run["trials_per_hour"] / base["trials_per_hour"]
    busy = [r["gpu_busy_pct"]["whole_run"] for r in runs if r.get("gpu_busy_pct", {}).get("whole_run") is not None]
    out["gpu_busy_target_80_met"] = bool(busy) and max(busy) >= 80.0 if busy else None
    four = out["trials_per_hour_vs_first"].get("4")
    out["packing_target_1_5x_met"] = None if four is None else four >= 1.5
    return out


def _hypervolume(study: Path, spec_path: Path, profile: str) -> float | None:
    """The front's hypervolume up to the spec's reference point (None: no front, or no point)."""
    from search.results.hypervolume import front_hypervolume
    from search.results.query import front_of
    from search.spec import load_spec

    front, objectives = front_of(study)
    reference = load_spec(spec_path, profile=profile, check_model=False).reference_point
    if not len(front) or reference is None:
        return None
    return front_hypervolume(front, objectives=objectives, reference=reference)


def _run_packing(*, spec: dict[str, Any], profile: str, packing: int, device: str, scratch: Path,
                 data_dir: str | None, env: dict[str, str], sample_s: float) -> dict[str, Any]:
    from benchmarks.main_job import run_once

    folder = scratch / f"packing{packing}"
    folder.mkdir()
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    storage = folder / "results"
    storage.mkdir()
    extra = ["--data-dir", data_dir] if data_dir else []
    sampler = None
    if device == "cuda":
        from benchmarks.trial_overhead import GpuUtilisation

        sampler = GpuUtilisation(0, period_s=sample_s).__enter__()
    start = time.perf_counter()
    try:
        record = run_once(spec=str(path), profile=profile, storage=storage, env=env, extra_args=extra)
    finally:
        end = time.perf_counter()
        if sampler is not None:
            sampler.__exit__(None, None, None)
    study = next(p for p in storage.iterdir() if (p / "trials.parquet").exists())
    wall = record["seconds"]["total"]
    setup = record["seconds"]["setup"] or 0.0
    finished = record["trials"]["finished"]
    busy = {"whole_run": None, "after_setup": None, "samples": 0}
    if sampler is not None:
        busy = {"whole_run": sampler.mean(start, end), "after_setup": sampler.mean(start + setup, end),
                "samples": len(sampler.samples)}
    return {"packing": packing, "resources": spec["profiles"][profile]["resources"], **record,
            "trials_per_hour": finished / wall * 3600.0 if wall else None,
            "gpu_busy_pct": busy, "hypervolume": _hypervolume(study, path, profile)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu_study", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="spaces/convit_locality.yaml")
    parser.add_argument("--profile", default="gpu")
    parser.add_argument("--packings", default="1,4", help="trials per GPU, one run each (default 1,4)")
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--max-epochs", type=int, default=12,
                        help="epochs per trial (default 12: enough for the small ViTs to pass 90%% val_acc)")
    parser.add_argument("--grace-epochs", type=int, default=2)
    parser.add_argument("--time-limit-s", type=int, default=200,
                        help="each run's budget.time_limit_s (default 200: two runs and set-up in ~8 minutes)")
    parser.add_argument("--data-dir", help="where Fashion-MNIST's files are (the device has no Debian package)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="host CPUs shared by a run's trials")
    parser.add_argument("--sample-s", type=float, default=0.2, help="NVML's sampling period")
    parser.add_argument("--smoke", action="store_true",
                        help="on the CPU at a tiny size (synthetic data, the base space): what CI runs")
    parser.add_argument("--dry-run", action="store_true", help="print each run's `search check`, train nothing")
    parser.add_argument("--result-name", default="gpu_study")
    parser.add_argument("--results-dir", type=Path, help="where the JSON goes (default benchmarks/results)")
    args = parser.parse_args(argv)
    try:
        packings = [int(p) for p in args.packings.split(",") if p.strip()]
    except ValueError:
        parser.error("--packings: comma-separated whole numbers, e.g. 1,4")
    if not packings or min(packings) < 1 or args.trials < 1 or args.max_epochs < 1:
        parser.error("--packings, --trials and --max-epochs must be at least 1")
    source = yaml.safe_load((ROOT / args.spec).read_text())
    if args.profile not in (source.get("profiles") or {}):
        parser.error(f"{args.spec} has no profile {args.profile!r}")

    device = "cpu" if args.smoke or args.dry_run else "cuda"
    if device == "cuda":
        import torch

        from benchmarks.trial_overhead import GpuUtilisation

        if not torch.cuda.is_available():
            raise SystemExit("error: no CUDA GPU here; --smoke runs the study on the CPU at a tiny size, "
                             "--dry-run prints what it would run")
        GpuUtilisation.require()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpu-study-") as scratch:
        for packing in packings:
            spec = derived_spec(source, profile=args.profile, packing=packing,
                                device="cuda" if args.dry_run else device, cpus=args.cpus, trials=args.trials,
                                max_epochs=args.max_epochs, grace_epochs=args.grace_epochs,
                                time_limit_s=args.time_limit_s, smoke=args.smoke)
            if args.dry_run:
                path = Path(scratch) / f"spec{packing}.yaml"
                path.write_text(yaml.safe_dump(spec, sort_keys=False))
                print(f"== packing {packing} ({spec['profiles'][args.profile]['resources']})", flush=True)
                from search.views.cli import main as search_main

                code = search_main(["check", str(path), "--profile", args.profile])
                if code:
                    raise SystemExit(code)
                continue
            print(f"== packing {packing}: {spec['profiles'][args.profile]['resources']}", flush=True)
            run = _run_packing(spec=spec, profile=args.profile, packing=packing, device=device,
                               scratch=Path(scratch), data_dir=args.data_dir, env=env, sample_s=args.sample_s)
            runs.append(run)
            print(f"== packing {packing}: {run['trials']['finished']} trials in {run['seconds']['total']:.0f} s "
                  f"({run['trials_per_hour']:.0f}/h), GPU busy {run['gpu_busy_pct']['whole_run']}, "
                  f"front {run['front_size']}, hypervolume {run['hypervolume']}, best val_acc {run['best_val_acc']}",
                  flush=True)
    if args.dry_run:
        return
    from benchmarks._env import write_result

    path = write_result(args.result_name, {
        "config": {"spec": args.spec, "profile": args.profile, "packings": packings, "trials": args.trials,
                   "max_epochs": args.max_epochs, "grace_epochs": args.grace_epochs,
                   "time_limit_s": args.time_limit_s, "cpus": args.cpus, "smoke": args.smoke, "device": device},
        "runs": runs,
        "summary": summarise_packings(runs),
    }, device="cuda" if device == "cuda" else "cpu", results_dir=args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

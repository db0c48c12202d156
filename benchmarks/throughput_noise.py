"""Throughput noise between measurements: one architecture measured again in fresh processes.

A study measures each architecture once (``trainers.throughput``, cached), so its front cannot show
how far a second measurement would land. This times the main job's architectures (ConViT on
Fashion-MNIST's 28x28x1, patch 7, beside the ``ls_convit_nano`` reference as a trial does) in
``--repeats`` fresh processes each, in shuffled order, and reports per architecture the spread of
the numbers (max/min, the coefficient of variation) and how often one measurement's own interval
(before ``throughput.noise_floor`` widens it) misses another's value; and the same for the cost
ratio to the reference, which is all that moves between two measurements within one study (its
trials share the node's reference number): what sets the floor.

    ./with-deps python -m benchmarks throughput_noise [--repeats 5] [--threads 2]

Writes ``benchmarks/results/throughput_noise-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["main", "summarise"]

ROOT = Path(__file__).resolve().parent.parent
# (embed_dim, depth): the main job's cost ladder (spaces/convit_locality.yaml, profile cpu)
ARCHITECTURES = [(24, 2), (48, 2), (48, 3), (48, 4), (96, 4)]


def _child(embed_dim: int, depth: int, threads: int) -> dict[str, Any]:
    """One fresh process's measurement, as a trial takes it (beside the reference, no cache)."""
    import timm
    import torch

    import trainers.models  # noqa: F401  (registers the families with timm)
    from trainers.throughput import measure_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    args = dict(img_size=28, in_chans=1, num_classes=10, num_heads=4, patch_size=7)
    model = timm.create_model("ls_convit_nano", embed_dim=embed_dim, depth=depth, local_up_to_layer=min(1, depth),
                              **args)
    reference = timm.create_model("ls_convit_nano", img_size=28, in_chans=1, num_classes=10)
    settings = dict(input_shape=(1, 28, 28), batch_size=256, warmup=3, repeats=10, runtime="kernels")
    with tempfile.TemporaryDirectory() as cache:  # the reference measured once, as a node's first trial does
        own = measure_model(reference, **settings, cache_dir=cache)
        record = measure_model(model, **settings, reference=reference, cache_dir=cache)
    return {**{k: record[k] for k in ("throughput", "throughput_low", "throughput_high", "throughput_timed")},
            "reference_throughput": own["throughput"], "cost_ratio": own["throughput"] / record["throughput"]}


def summarise(values: list[dict[str, float]]) -> dict[str, Any]:
    """One architecture's measurements: spread, and how often an interval misses another's value."""
    numbers = [v["throughput"] for v in values]
    ratios = [v["cost_ratio"] for v in values]
    misses = sum(1 for i, a in enumerate(values) for j, b in enumerate(values)
                 if i != j and not a["throughput_low"] <= b["throughput"] <= a["throughput_high"])
    pairs = len(values) * (len(values) - 1)
    mean = statistics.fmean(numbers)
    return {
        "throughput": numbers,
        "max_over_min": max(numbers) / min(numbers),
        "cv": statistics.stdev(numbers) / mean if len(numbers) > 1 else None,
        "largest_deviation_from_median": max(abs(n / statistics.median(numbers) - 1) for n in numbers),
        "interval_half_width_median": statistics.median(
            (v["throughput_high"] - v["throughput_low"]) / 2 / v["throughput"] for v in values),
        "intervals_missing_another_value": f"{misses} of {pairs}",
        # within a study every trial divides the same reference number: what moves between two of
        # its measurements is the cost ratio alone
        "cost_ratio": ratios,
        "cost_ratio_max_over_min": max(ratios) / min(ratios),
        "cost_ratio_cv": statistics.stdev(ratios) / statistics.fmean(ratios) if len(ratios) > 1 else None,
        "cost_ratio_largest_deviation_from_median": max(abs(r / statistics.median(ratios) - 1) for r in ratios),
        "reference_throughput": [v["reference_throughput"] for v in values],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks throughput_noise", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per architecture (default 5)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "embed_dim,depth": one measurement, JSON on stdout
    args = parser.parse_args(argv)
    if args.child:
        embed_dim, depth = (int(v) for v in args.child.split(","))
        print(json.dumps(_child(embed_dim, depth, args.threads)))
        return
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (a spread needs two measurements)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               LOCALITY_SEARCH_CPU_KERNELS=os.environ.get("LOCALITY_SEARCH_CPU_KERNELS", "1"))
    order = [arch for _ in range(args.repeats) for arch in ARCHITECTURES]
    random.Random(0).shuffle(order)  # no architecture always measured at the same moment
    results: dict[str, list[dict[str, float]]] = {f"{e},{d}": [] for e, d in ARCHITECTURES}
    for k, (embed_dim, depth) in enumerate(order, 1):
        out = subprocess.run([sys.executable, "-m", "benchmarks.throughput_noise", "--child", f"{embed_dim},{depth}",
                              "--threads", str(args.threads)], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True)
        value = json.loads(out.stdout.strip().splitlines()[-1])
        results[f"{embed_dim},{depth}"].append(value)
        print(f"[{k}/{len(order)}] embed_dim {embed_dim}, depth {depth}: {value['throughput']:,.0f} img/s "
              f"({value['throughput_low']:,.0f}-{value['throughput_high']:,.0f})", flush=True)
    summary = {arch: summarise(values) for arch, values in results.items()}
    for arch, s in summary.items():
        print(f"embed_dim,depth {arch}: max/min {s['max_over_min']:.3f}, cv {s['cv']:.3f}, "
              f"largest deviation from the median {s['largest_deviation_from_median']:.1%}, "
              f"own interval +-{s['interval_half_width_median']:.1%}, misses {s['intervals_missing_another_value']}; "
              f"cost ratio: max/min {s['cost_ratio_max_over_min']:.3f}, cv {s['cost_ratio_cv']:.3f}, "
              f"largest deviation {s['cost_ratio_largest_deviation_from_median']:.1%}")
    from benchmarks._env import write_result

    path = write_result("throughput_noise", {
        "config": {"repeats": args.repeats, "threads": args.threads, "architectures": ARCHITECTURES,
                   "model": "ls_convit_nano, patch 7, 4 heads, local_up_to_layer 1; reference ls_convit_nano defaults",
                   "batch": 256},
        "architectures": summary,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Results store and queries at 1k, 10k and 100k trials: Pareto front, a filtered query, Parquet, the dashboard.

    python -m benchmarks.store_queries                   # 1k, 10k, 100k synthetic trials
    python -m benchmarks.store_queries --sizes 1000 10000 --repeats 5

A synthetic study folder per size (experiment.json + trials.parquet + progress.parquet, the
schema `search.results.store.ResultsStore` writes: every result column plus three searched knobs;
80% COMPLETE, val_acc and throughput trading off with noise, four families). Timed, each the
median of --repeats runs:

  write / read      trials.parquet through search.results.store (write_atomic, read_table)
  load              search.load(folder): experiment.json + Parquet -> pandas
  front_2d          Experiment.front(): the Pareto front of the COMPLETE trials (val_acc, throughput)
  query             Experiment.front(where=[...], families=[...]) + select(rule="knee"): filter, front, pick
  front_3d          pareto_front on (val_acc max, throughput max, params min)
  dashboard         search.views.dashboard.server.study_payload(folder): what the Pareto page's server sends
  store_finish      ResultsStore holding N trials: add_trial + add_progress + flush (what the
                    driver does when one more trial finishes)

Side by side, the previous implementations of the front (a Python loop over the sorted points in
2-D; the O(n^2) definition, one numpy step per point, for 3+ objectives) are timed on the same
points, so the speed-up is a ratio from this run; the O(n^2) reference stops at 10k trials
(at 100k it takes minutes). Target: front + query over 100k trials under 1 s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from benchmarks._env import write_result
from search.results.pareto import as_maximised, pareto_front, pareto_mask
from search.results.query import load
from search.results.select import select
from search.results.store import ResultsStore, read_table, write_atomic

SPACE = {
    "locality_strength": {"type": "uniform", "low": 0.1, "high": 3.0},
    "local_up_to_layer": {"type": "int", "low": 0, "high": 8},
    "gate_init": {"type": "choice", "values": [0.5, 1.0, 2.0]},
}
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
OBJECTIVES_3D = [("val_acc", "max"), ("throughput", "max"), ("params", "min")]
FAMILIES = ["convit", "gmm", "refiner", "tcnn"]
WHERE = ["throughput>=2000", "params<2e6", "epochs_run>=2"]


# --- the previous implementations, kept here as the side-by-side reference ---------------------
def _reference_front_2d(points: np.ndarray) -> np.ndarray:
    a, b = points[:, 0], points[:, 1]
    order = np.lexsort((-b, -a))
    keep = []
    best_b_above = None
    i = 0
    while i < order.size:
        j = i
        while j < order.size and a[order[j]] == a[order[i]]:
            j += 1
        group = order[i:j]
        top_b = b[group[0]]
        if best_b_above is None or top_b > best_b_above:
            keep.extend(int(k) for k in group if b[k] == top_b)
            best_b_above = top_b
        i = j
    return np.array(sorted(keep), dtype=int)


def _reference_front_nd(points: np.ndarray) -> np.ndarray:
    n = points.shape[0]
    keep = np.ones(n, dtype=bool)
    for i in range(n):
        ge = (points >= points[i]).all(axis=1)
        gt = (points > points[i]).any(axis=1)
        if (ge & gt).any():
            keep[i] = False
    return np.flatnonzero(keep)


def _reference_mask(values: np.ndarray, modes: list[str]) -> np.ndarray:
    points = as_maximised(values, modes)
    mask = np.zeros(points.shape[0], dtype=bool)
    idx = np.flatnonzero(~np.isnan(points).any(axis=1))
    front = _reference_front_2d if len(modes) == 2 else _reference_front_nd
    mask[idx[front(points[idx])]] = True
    return mask


# --- a synthetic study ---------------------------------------------------------------------------
def _study(n: int, seed: int = 0) -> tuple[ResultsStore, pa.Table]:
    rng = np.random.default_rng(seed)
    store = ResultsStore(Path("."), space=SPACE, objectives=OBJECTIVES, reference=[0.0, 0.0])
    depth = rng.integers(0, 9, n)
    width = rng.choice([32, 64, 96, 128, 192], n)
    params = (depth + 1) * width * width * 12 + rng.integers(0, 5000, n)
    throughput = 4e9 / params * rng.lognormal(0.0, 0.15, n)
    val_acc = np.clip(0.55 + 0.04 * np.log(params / 1e4) + rng.normal(0, 0.03, n), 0, 1)
    state = rng.choice(["COMPLETE", "PRUNED", "FAILED", "REJECTED"], n, p=[0.8, 0.12, 0.03, 0.05])
    val_acc = np.where(state == "FAILED", np.nan, val_acc)
    start = np.datetime64("2026-01-01T00:00:00", "us") + np.arange(n) * np.timedelta64(60, "s")
    ids = [f"t{i:06d}" for i in range(n)]
    family = rng.choice(FAMILIES, n)
    columns = {
        "trial_id": ids,
        "trial_name": [f"{t}_depth={d}" for t, d in zip(ids, depth)],
        "experiment": ["bench"] * n,
        "model": [f"ls_{f}_micro" for f in family],
        "family": family,
        "state": state,
        "stop_reason": np.where(state == "COMPLETE", "max_epochs", "scheduler"),
        "error": [None] * n,
        "rejected_by": [None] * n,
        "epochs_run": rng.integers(1, 5, n),
        "epochs_budget": np.full(n, 4),
        "val_acc": val_acc,
        "val_loss": 2.0 - 2 * val_acc,
        "final_val_acc": val_acc,
        "train_precision": rng.choice(["fp32", "bf16"], n),
        "throughput": throughput,
        "throughput_before_conversion": [None] * n,
        "converted_at_epoch": [None] * n,
        "throughput_timed": throughput * rng.uniform(0.85, 1.0, n),  # its own rounds, before the reference's scaling
        "throughput_reference": [f"ls_{f}_micro-default" for f in family],
        "throughput_low": throughput * 0.85,  # the noise floor's +-15%
        "throughput_high": throughput * 1.15,
        "throughput_runtime": ["eager"] * n,
        "val_images": np.full(n, 6000),
        "val_acc_low": np.clip(val_acc - 0.01, 0, 1),
        "val_acc_high": np.clip(val_acc + 0.01, 0, 1),
        "tied_with": [None] * n,
        "dominated_by": [None] * n,
        "val_acc_sd_df": [None] * n,
        "selection_val_acc": [None] * n,
        # the held-out test scores front trials only, once, at the study's end: none in a study this size's rows
        **{c: [None] * n for c in ("test_acc", "test_acc_low", "test_acc_high", "test_loss", "test_images", "test_epoch", "test_corrupted")},
        "throughput_device": ["cpu: bench"] * n,
        "throughput_batch": np.full(n, 256),
        "throughput_precision": ["fp32"] * n,
        "throughput_threads": np.full(n, 2),
        "throughput_cuda_graph": [None] * n,  # (a CPU study)
        "throughput_cached": rng.random(n) < 0.5,
        "architecture": [f"{d}-{w}" for d, w in zip(depth, width)],
        "torch_version": ["2.x"] * n,
        "params": params,
        "flops": params * 50,
        "seed": np.zeros(n, dtype=np.int64),
        "replicate_of": [None] * n,  # no confirmation seeds in this study
        "seeds": np.ones(n, dtype=np.int64),
        "val_acc_sd": np.full(n, np.nan),
        "spec_hash": ["abc"] * n,
        "git_commit": ["0" * 40] * n,
        "node_ip": ["127.0.0.1"] * n,
        "hostname": ["bench"] * n,
        "node_id": ["0" * 56] * n,
        "failures": np.zeros(n, dtype=np.int64),
        "started_at": start,
        "ended_at": start + np.timedelta64(55, "s"),
        "duration_s": rng.uniform(30, 120, n),
        "locality_strength": rng.uniform(0.1, 3.0, n),
        "local_up_to_layer": depth,
        "gate_init": rng.choice([0.5, 1.0, 2.0], n),
    }
    missing = [field.name for field in store.trial_schema if field.name not in columns]
    if missing:  # the store's schema grew: give the synthetic trials those columns too
        raise KeyError(f"benchmarks/store_queries.py builds no column for {', '.join(missing)}")
    arrays = []
    for field in store.trial_schema:
        values = columns[field.name]
        if pa.types.is_timestamp(field.type):
            arrays.append(pa.array(values, type=pa.timestamp("us")).cast(field.type))
        else:
            arrays.append(pa.array(values, type=field.type, from_pandas=True))
    return store, pa.Table.from_arrays(arrays, schema=store.trial_schema)


def _write_folder(folder: Path, table: pa.Table) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"name": "bench", "objectives": [list(o) for o in OBJECTIVES], "reference_point": [0.0, 0.0],
            "spec": {"name": "bench", "model": {"name": "ls_convit_micro", "space": SPACE},
                     "budget": {"trials": table.num_rows, "max_epochs": 4}}}
    (folder / "experiment.json").write_text(json.dumps(meta))
    write_atomic(table, folder / "trials.parquet")
    n = table.num_rows
    progress = pa.table({
        "finished": pa.array(np.arange(1, n + 1)),
        "trial_id": table.column("trial_id"),
        "state": table.column("state"),
        "epochs_spent": pa.array(np.cumsum(table.column("epochs_run").to_numpy())),
        "elapsed_s": pa.array(np.arange(n) * 60.0),
        "front_size": pa.array(np.minimum(np.arange(1, n + 1), 20)),
        "hypervolume": pa.array(np.linspace(0, 1e4, n)),
        "best_val_acc": pa.array(np.full(n, 0.9)),
        "at": table.column("ended_at"),
    })
    write_atomic(progress, folder / "progress.parquet")


def _median(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run_size(n: int, *, repeats: int, workdir: Path) -> dict:
    from search.views.dashboard.server import study_payload  # the page's server side (read-only)

    store, table = _study(n)
    folder = workdir / f"study-{n}"
    _write_folder(folder, table)
    out: dict[str, float] = {}

    out["write_s"], _ = _median(lambda: write_atomic(table, folder / "trials-copy.parquet"), repeats)
    out["read_s"], _ = _median(lambda: read_table(folder / "trials.parquet"), repeats)
    out["load_s"], exp = _median(lambda: load(folder), repeats)
    out["front_2d_s"], front = _median(lambda: exp.front(), repeats)

    def query():
        narrowed = exp.front(where=WHERE, families=["convit", "gmm"])
        return narrowed, select(narrowed, objectives=exp.objectives, rule="knee")

    out["query_s"], (narrowed, picked) = _median(query, repeats)
    complete = exp.trials[exp.trials["state"] == "COMPLETE"]
    out["front_3d_s"], front3 = _median(lambda: pareto_front(complete, objectives=OBJECTIVES_3D), repeats)
    out["front_plus_query_s"] = out["front_2d_s"] + out["query_s"]
    out["dashboard_payload_s"], payload = _median(lambda: study_payload(folder), repeats)

    # The side-by-side reference: the previous front code on the same points.
    values2 = complete[[c for c, _ in OBJECTIVES]].to_numpy(dtype=float)
    values3 = complete[[c for c, _ in OBJECTIVES_3D]].to_numpy(dtype=float)
    modes2, modes3 = [m for _, m in OBJECTIVES], [m for _, m in OBJECTIVES_3D]
    out["mask_2d_s"], mask2 = _median(lambda: pareto_mask(values2, modes=modes2), repeats)
    out["mask_3d_s"], mask3 = _median(lambda: pareto_mask(values3, modes=modes3), repeats)
    ref_repeats = max(1, min(repeats, 3))
    out["reference_mask_2d_s"], ref2 = _median(lambda: _reference_mask(values2, modes2), ref_repeats)
    assert (ref2 == mask2).all(), "2-D front differs from the reference"
    if n <= 10_000:
        out["reference_mask_3d_s"], ref3 = _median(lambda: _reference_mask(values3, modes3), 1)
        assert (ref3 == mask3).all(), "3-D front differs from the reference"

    # One more trial finishing on the driver: upsert, progress (front + hypervolume), rewrite the files.
    store.directory = folder / "store"
    store.directory.mkdir(exist_ok=True)
    rows = table.to_pylist()
    start = time.perf_counter()
    for row in rows:
        store.add_trial(row, row)
    out["store_fill_s"] = time.perf_counter() - start  # n upserts (was a list scan per upsert)
    config_keys = list(SPACE)
    extra = dict(rows[-1], trial_id="extra")

    def finish():
        store.add_trial(extra, {k: extra[k] for k in config_keys})
        store.add_progress(trial_id="extra", state=extra["state"], elapsed_s=1.0, at=dt.datetime.now(dt.timezone.utc))
        store.flush()

    out["store_finish_s"], _ = _median(finish, max(1, min(repeats, 3)))
    return {
        "trials": n,
        "complete": int(len(complete)),
        "front_size_2d": int(len(front)),
        "front_size_3d": int(len(front3)),
        "query_rows": int(len(narrowed)),
        "query_pick": str(picked["trial_id"]),
        "dashboard_front": len(payload["front"]),
        "seconds": out,
        "speedup_2d_front": out["reference_mask_2d_s"] / out["mask_2d_s"],
        "speedup_3d_front": (out["reference_mask_3d_s"] / out["mask_3d_s"]) if "reference_mask_3d_s" in out else None,
        "target_front_plus_query_under_1s": out["front_plus_query_s"] < 1.0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="ls-bench-store-") as tmp:
        for n in args.sizes:
            r = run_size(n, repeats=args.repeats, workdir=Path(tmp))
            results.append(r)
            s = r["seconds"]
            print(f"{n:>7,} trials ({r['complete']:,} COMPLETE; front {r['front_size_2d']} in 2-D, {r['front_size_3d']} in 3-D)")
            print(f"  parquet write {s['write_s'] * 1e3:8.1f} ms   read {s['read_s'] * 1e3:8.1f} ms   "
                  f"search.load {s['load_s'] * 1e3:8.1f} ms")
            print(f"  front 2-D {s['front_2d_s'] * 1e3:8.1f} ms   query (where + family + front + knee) "
                  f"{s['query_s'] * 1e3:8.1f} ms   together {s['front_plus_query_s'] * 1e3:8.1f} ms "
                  f"(target < 1000 ms: {'met' if r['target_front_plus_query_under_1s'] else 'NOT met'})")
            ref3 = f"{s['reference_mask_3d_s'] * 1e3:8.1f} ms -> {r['speedup_3d_front']:.0f}x" if r["speedup_3d_front"] else "(skipped)"
            print(f"  pareto_mask 2-D {s['mask_2d_s'] * 1e3:8.2f} ms (previous {s['reference_mask_2d_s'] * 1e3:8.1f} ms -> "
                  f"{r['speedup_2d_front']:.0f}x)   3-D {s['mask_3d_s'] * 1e3:8.1f} ms (previous {ref3})")
            print(f"  front 3-D table {s['front_3d_s'] * 1e3:8.1f} ms   dashboard payload {s['dashboard_payload_s'] * 1e3:8.1f} ms   "
                  f"store: fill {s['store_fill_s'] * 1e3:8.1f} ms, one more trial finishing {s['store_finish_s'] * 1e3:8.1f} ms")
    path = write_result("store_queries", {
        "config": {"sizes": args.sizes, "repeats": args.repeats, "objectives": OBJECTIVES, "objectives_3d": OBJECTIVES_3D,
                   "where": WHERE, "families": ["convit", "gmm"], "what": "synthetic trials tables; median seconds"},
        "results": results,
    })
    print(f"-> {path}")


if __name__ == "__main__":
    main()

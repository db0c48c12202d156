"""A synthetic study folder of any size, written with the store's own schema: for the page's and
the report's timing (``python -m dashboards.measure``) and for tests. No training happens; the
numbers are shaped like a locality-zoo run (five families, a conditional space, every state)."""

from __future__ import annotations

import datetime as dt
import json
import math
import random
from pathlib import Path
from typing import Any

import pyarrow as pa

from search.results.hypervolume import hypervolume
from search.results.store import PROGRESS_COLUMNS, ResultsStore, write_atomic

__all__ = ["SPACE", "MODELS", "synthetic_study", "progress_rows"]

SHARED = {
    "lr": {"type": "loguniform", "low": 3e-4, "high": 3e-3, "log": False, "step": None, "values": None},
    "depth": {"type": "int", "low": 3, "high": 8, "log": False, "step": None, "values": None},
}
MODELS = [
    {"name": "ls_convit_micro", "args": {}, "space": {
        "locality_strength": {"type": "uniform", "low": 0.5, "high": 3.0, "log": False, "step": None, "values": None},
        "local_up_to_layer": {"type": "int", "low": 0, "high": 3, "log": False, "step": None, "values": None}}},
    {"name": "ls_gmm_micro", "args": {}, "space": {
        "num_kernels": {"type": "int", "low": 1, "high": 5, "log": False, "step": None, "values": None}}},
    {"name": "ls_refiner_micro", "args": {}, "space": {
        "refiner_ratio": {"type": "int", "low": 1, "high": 4, "log": False, "step": None, "values": None},
        "refiner_kernel": {"type": "choice", "low": None, "high": None, "log": False, "step": None, "values": [3, 5]}}},
    {"name": "ls_tcnn_nano", "args": {}, "space": {}},
    {"name": "vit_tiny_patch16_224", "args": {"patch_size": 4, "embed_dim": 96}, "space": {}},
]
FAMILY = {"ls_convit_micro": "convit", "ls_gmm_micro": "gmm", "ls_refiner_micro": "refiner",
          "ls_tcnn_nano": "tcnn", "vit_tiny_patch16_224": "vit"}
SPACE = {"model": {"type": "choice", "values": [m["name"] for m in MODELS]}, **SHARED,
         **{k: v for m in MODELS for k, v in m["space"].items()}}
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
REFERENCE = [0.0, 0.0]


def _trial(rng: random.Random, k: int, max_epochs: int, start: dt.datetime) -> tuple[dict[str, Any], dict[str, Any]]:
    model = rng.choice(MODELS)
    name = model["name"]
    config: dict[str, Any] = {"model": name, "lr": math.exp(rng.uniform(math.log(3e-4), math.log(3e-3))),
                              "depth": rng.randint(3, 8)}
    for key, p in model["space"].items():
        config[key] = rng.choice(p["values"]) if p["type"] == "choice" else (
            rng.randint(int(p["low"]), int(p["high"])) if p["type"] == "int" else rng.uniform(p["low"], p["high"]))
    depth = config["depth"]
    # accuracy grows with depth and a good lr; throughput falls with depth; each family has its own trade-off
    base = {"convit": 0.60, "gmm": 0.58, "refiner": 0.59, "tcnn": 0.56, "vit": 0.55}[FAMILY[name]]
    acc = base + 0.03 * depth - 0.04 * abs(math.log10(config["lr"] / 1.2e-3)) + rng.gauss(0, 0.015)
    acc += 0.01 * config.get("locality_strength", 0) - 0.004 * config.get("refiner_ratio", 0)
    tput = {"convit": 9000, "gmm": 10000, "refiner": 7000, "tcnn": 12000, "vit": 11000}[FAMILY[name]] / depth
    tput *= 1 - 0.08 * config.get("refiner_ratio", 0) - 0.03 * config.get("num_kernels", 0)
    tput *= rng.uniform(0.9, 1.1)
    u = rng.random()
    state, reason, epochs = ("COMPLETE", "max_epochs", max_epochs)
    if u < 0.35:
        state, reason, epochs = "PRUNED", "scheduler", rng.randint(1, max_epochs - 1)
        acc -= 0.05
    elif u < 0.41:
        state, reason, epochs = "FAILED", "error", rng.randint(1, max_epochs)
    elif u < 0.45:
        state, reason, epochs = "REJECTED", "constraint", 0
    ended = start + dt.timedelta(seconds=30 * (k + 1))
    row = {
        "trial_id": f"{k:05d}_{rng.getrandbits(24):06x}", "experiment": "synthetic", "model": name,
        "family": FAMILY[name], "state": state, "stop_reason": reason, "epochs_run": epochs,
        "epochs_budget": max_epochs, "val_acc": None if state == "REJECTED" else round(min(acc, 0.99), 4),
        "val_loss": None if state == "REJECTED" else round(2.0 - 1.5 * acc, 4),
        "final_val_acc": None if state == "REJECTED" else round(min(acc, 0.99) - 0.005, 4),
        "throughput": round(tput, 1), "throughput_device": "cpu: synthetic", "params": int(150_000 * depth),
        "flops": int(12_000_000 * depth), "seed": 0, "started_at": ended - dt.timedelta(seconds=28),
        "ended_at": ended, "duration_s": 28.0,
        "error": "NonFiniteLossError: training loss became nan at epoch 2" if state == "FAILED" else None,
        "rejected_by": "throughput >= 5000 (measured 1,204)" if state == "REJECTED" else None,
    }
    row["trial_name"] = row["trial_id"]
    if state == "FAILED":
        row["val_acc"] = None
    return row, config


def progress_rows(trials: list[dict[str, Any]], start: dt.datetime) -> list[dict[str, Any]]:
    """progress.parquet's rows for ``trials`` in order, the front kept incrementally (the store
    recomputes it whole per trial, which is quadratic over 10,000 synthetic rows)."""
    front: list[tuple[float, float]] = []
    rows, epochs, best = [], 0, None
    for k, t in enumerate(trials):
        epochs += int(t["epochs_run"] or 0)
        if t["state"] == "COMPLETE" and t["val_acc"] is not None:
            p = (t["val_acc"], t["throughput"])
            best = p[0] if best is None else max(best, p[0])
            if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in front):
                front = [q for q in front if not (p[0] >= q[0] and p[1] >= q[1] and p != q)] + [p]
        volume = hypervolume(front, modes=["max", "max"], reference=REFERENCE) if front else 0.0
        rows.append({"finished": k + 1, "trial_id": t["trial_id"], "state": t["state"], "epochs_spent": epochs,
                     "elapsed_s": (t["ended_at"] - start).total_seconds(), "front_size": len(front),
                     "hypervolume": volume, "best_val_acc": best, "at": t["ended_at"]})
    return rows


def synthetic_study(path: str | Path, *, trials: int, seed: int = 0, max_epochs: int = 4, name: str = "synthetic") -> Path:
    """Write a study folder of ``trials`` finished trials to ``path``; returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    store = ResultsStore(path, space=SPACE, objectives=OBJECTIVES, reference=REFERENCE)
    rows = []
    for k in range(trials):
        row, config = _trial(rng, k, max_epochs, start)
        rows.append({**{c: row.get(c) for c in store.trial_schema.names},
                     **{c: config.get(c) for c in SPACE if c != "model"}})
    for row in rows:
        if row.get("refiner_kernel") is not None:
            row["refiner_kernel"] = int(row["refiner_kernel"])
    write_atomic(pa.Table.from_pylist(rows, schema=store.trial_schema), path / "trials.parquet")
    progress_schema = pa.schema([(c, t) for c, (t, _) in PROGRESS_COLUMNS.items()])
    write_atomic(pa.Table.from_pylist(progress_rows(rows, start), schema=progress_schema), path / "progress.parquet")
    meta = {
        "name": name, "objectives": [list(o) for o in OBJECTIVES], "reference_point": REFERENCE,
        "created_at": start.isoformat(), "spec_hash": "synthetic",
        "spec": {"name": name, "model": None, "models": MODELS, "space": SHARED,
                 "objectives": [{"metric": m, "mode": mode} for m, mode in OBJECTIVES],
                 "budget": {"trials": trials, "max_epochs": max_epochs, "time_limit_s": None},
                 "train": {"batch_size": 64, "lr": 1e-3}},
    }
    (path / "experiment.json").write_text(json.dumps(meta, indent=2))
    return path

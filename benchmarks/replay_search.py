"""Searchers and schedulers compared on replayed real learning curves: hypervolume vs epochs spent.

    python -m benchmarks.record_curves        # once: trains the grid for real (about 20 min on a CPU)
    python -m benchmarks.replay_search        # then: replays searches, no training (seconds)
    python -m benchmarks.replay_search --seeds 10 --budget 60

Every trial of a replayed search reads its learning curve and throughput from the recording
(``benchmarks/data/curves-*.parquet``) instead of training, and goes through the same parts a
real study uses: an Optuna sampler asked for the grid's knobs (``study.ask``/``tell``), Ray
Tune's own ``ASHAScheduler`` or this project's ``MOASHAScheduler`` deciding after each epoch,
and the honest-fidelity rule (``search.study.searcher.optuna_state_for``: only trials that ran the
full budget are COMPLETE, are told to Optuna with values, and can be on the front). Trials run
one after another, so "epochs spent" is the cost a single device would pay.

Methods, all at the same budget of epochs:
  random+ASHA       Optuna RandomSampler, Ray's ASHA on val_acc (grace 1 epoch, rf 2)
  optuna+ASHA       Optuna TPE (multi-objective), the same ASHA
  optuna+MO-ASHA    Optuna TPE, MO-ASHA on (val_acc, throughput), same rungs
  random            RandomSampler, no early stopping (for reference)

Reported per method: the hypervolume of its front (COMPLETE trials; reference point
(0, 0)) after every trial, as a fraction of the hypervolume of the whole grid's true front, and
the epochs MO-ASHA needs to reach random+ASHA's final hypervolume, per seed and as a median
ratio (target: at most 0.4). Written to benchmarks/results/replay_search-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import optuna
from ray.tune.schedulers import ASHAScheduler

from benchmarks._env import write_result
from benchmarks.record_curves import DATA_DIR, GRID, GRID_NAME
from search.results.hypervolume import hypervolume
from search.results.store import read_table
from search.study.mo_asha import MOASHAScheduler
from search.study.searcher import optuna_state_for

OBJECTIVES = [("best_val_acc", "max"), ("throughput", "max")]
REFERENCE = [0.0, 0.0]
METHODS = ("random+ASHA", "optuna+ASHA", "optuna+MO-ASHA", "random")


def load_curves(path: Path) -> tuple[dict[tuple, dict], int]:
    """knob values (in GRID order) -> {"best": [best_val_acc per epoch], "throughput": x}; epochs."""
    rows = read_table(path).to_pylist()
    if not rows:
        raise SystemExit(f"{path} is empty; run python -m benchmarks.record_curves first")
    epochs = rows[0]["max_epochs"]
    curves: dict[tuple, dict] = {}
    for row in sorted(rows, key=lambda r: (r["config_id"], r["epoch"])):
        key = tuple(row[k] for k in GRID)
        entry = curves.setdefault(key, {"best": [], "throughput": row["throughput"]})
        entry["best"].append(row["best_val_acc"])
    complete = {k: v for k, v in curves.items() if len(v["best"]) == epochs}
    return complete, epochs


def _scheduler(method: str, epochs: int):
    if method.endswith("MO-ASHA"):
        return MOASHAScheduler(objectives=OBJECTIVES, time_attr="epoch", max_t=epochs, grace_period=1, reduction_factor=2)
    if method.endswith("ASHA"):
        return ASHAScheduler(time_attr="epoch", metric="best_val_acc", mode="max", max_t=epochs, grace_period=1,
                             reduction_factor=2)
    return None


def replay(method: str, *, curves: dict[tuple, dict], epochs: int, budget: int, seed: int) -> list[tuple[int, float]]:
    """(epochs spent, hypervolume of the COMPLETE trials) after every trial of one search."""
    sampler = (optuna.samplers.RandomSampler(seed=seed) if method.startswith("random")
               else optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=5))
    study = optuna.create_study(directions=["maximize", "maximize"], sampler=sampler)
    scheduler = _scheduler(method, epochs)
    spent, front_points, history, number = 0, [], [], 0
    while spent < budget:
        trial = study.ask()
        key = tuple(trial.suggest_categorical(k, values) for k, values in GRID.items())
        curve = curves[key]
        handle = SimpleNamespace(trial_id=str(number))
        number += 1
        if scheduler is not None:
            scheduler.on_trial_add(None, handle)
        result: dict = {}
        for epoch in range(1, epochs + 1):
            if spent >= budget:
                break  # the budget ran out mid-trial: cut short, like the time limit
            spent += 1
            result = {"epoch": epoch, "best_val_acc": curve["best"][epoch - 1], "throughput": curve["throughput"]}
            if epoch == epochs:
                result["stop_reason"] = "max_epochs"  # the trainer ran it to the end
            action = scheduler.on_trial_result(None, handle, result) if scheduler is not None else "CONTINUE"
            if epoch < epochs and action == "STOP":
                break
        if scheduler is not None and result:
            scheduler.on_trial_complete(None, handle, result)
        state, values = optuna_state_for(result, error=False, metrics=[k for k, _ in OBJECTIVES])
        study.tell(trial, values, state=getattr(optuna.trial.TrialState, state))
        if state == "COMPLETE":
            front_points.append(values)
        volume = hypervolume(front_points, modes=["max", "max"], reference=REFERENCE) if front_points else 0.0
        history.append((spent, volume))
    return history


def epochs_to_reach(history: list[tuple[int, float]], target: float) -> int | None:
    return next((spent for spent, volume in history if volume >= target - 1e-12), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", type=Path, default=DATA_DIR / f"curves-{GRID_NAME}.parquet")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budget", type=int, help="epochs per search (default: 2 full trials per grid point / 4)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    curves, epochs = load_curves(args.curves)
    budget = args.budget or max(epochs * 2, len(curves) * epochs // 2)
    true_front_volume = hypervolume([[c["best"][-1], c["throughput"]] for c in curves.values()],
                                    modes=["max", "max"], reference=REFERENCE)
    print(f"{len(curves)} recorded configurations x {epochs} epochs; budget {budget} epochs per search "
          f"({budget / epochs:.0f} full trials); {args.seeds} seeds")

    runs: dict[str, list[list[tuple[int, float]]]] = {m: [] for m in METHODS}
    for seed in range(args.seeds):
        for method in METHODS:
            runs[method].append(replay(method, curves=curves, epochs=epochs, budget=budget, seed=seed))

    summary = {}
    for method in METHODS:
        finals = [h[-1][1] / true_front_volume for h in runs[method]]
        trials = [len(h) for h in runs[method]]
        summary[method] = {"final_hv_fraction_median": statistics.median(finals), "final_hv_fraction": finals,
                           "trials_median": statistics.median(trials)}
        print(f"  {method:<15} final hypervolume {statistics.median(finals):.3f} of the grid's "
              f"(min {min(finals):.3f}, max {max(finals):.3f}), {statistics.median(trials):.0f} trials")

    ratios = []
    for seed in range(args.seeds):
        target = runs["random+ASHA"][seed][-1][1]
        reached = epochs_to_reach(runs["optuna+MO-ASHA"][seed], target)
        ratios.append(None if reached is None else reached / budget)
    met = [r for r in ratios if r is not None]
    median_ratio = statistics.median([r if r is not None else float("inf") for r in ratios])
    print(f"optuna+MO-ASHA reaches random+ASHA's final hypervolume with {median_ratio:.2f} of the epochs "
          f"(median over seeds; per seed: {', '.join('never' if r is None else f'{r:.2f}' for r in ratios)}); "
          f"target <= 0.40: {'met' if median_ratio <= 0.4 else 'NOT met'}")

    # hypervolume against epochs, median over seeds, at every 10% of the budget
    grid = [int(round(budget * f / 10)) for f in range(1, 11)]
    curves_out = {}
    for method in METHODS:
        at = []
        for point in grid:
            values = [max([v for s, v in h if s <= point], default=0.0) / true_front_volume for h in runs[method]]
            at.append(float(np.median(values)))
        curves_out[method] = at
        print(f"  {method:<15} " + " ".join(f"{v:.2f}" for v in at) + "   (hypervolume at 10%, 20%, ... of the budget)")

    path = write_result("replay_search", {
        "curves_file": str(args.curves.name), "configurations": len(curves), "epochs": epochs, "budget_epochs": budget,
        "seeds": args.seeds, "true_front_hypervolume": true_front_volume, "methods": summary,
        "mo_asha_epochs_fraction_to_random_asha_final_hv": ratios, "median_ratio": median_ratio,
        "target_met": median_ratio <= 0.4, "hv_fraction_at_budget_tenths": {"epochs": grid, **curves_out},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

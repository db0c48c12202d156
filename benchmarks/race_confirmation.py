"""Racing vs the fixed confirmation at equal replicate budget, on recorded multi-seed results.

    python -m benchmarks.race_confirmation --record      # once (resumable): configs x seeds, trained for real
    python -m benchmarks.race_confirmation               # then: replays both confirmations, many times

The recording trains each configuration of a small ConViT grid on real Fashion-MNIST (a
stratified subset) with ``--seeds`` training seeds and keeps each run's best validation accuracy
(``benchmarks/data/seeds-<grid>.parquet``), beside the architecture's throughput from the
convit-wide recording (``record_curves``), with the store's noise floor as its interval.

Each repetition of the replay shuffles every configuration's seeds, then splits them: the first
``--available`` are what a study could train (the first plays the search trial, the rest the
replicates, in that order), the others are held out as the truth (their mean: an estimate of the
configuration's expected accuracy that no method saw). Both methods start from the same search
front and the same pool (``search.study.confirm.configs_to_confirm``: the front, then the configs
tied with it, at most ``--top``) and the same budget, the pool's size x ``--seeds-fixed`` replicates:

  fixed   every pool config gets ``--seeds-fixed`` replicates;
  race    ``search.study.race.race_step`` hands them out one at a time (at most ``--available - 1``
          per config), stopping early when every pool config is separated.

The front is then computed as the study computes it (``search.results.front.compute_front``:
fresh seeds only, pooled seed SD, both noises). Reported per method, median and mean over the
repetitions: the front's members, those separated from every other member (no ``tied_with``),
the groups the measurements separate, the replicates spent, and the error of the members'
``val_acc`` against the held-out truth (RMSE over members; the search trial's own value for an
unconfirmed member). Paired by repetition, Wilcoxon's signed-rank test compares the two on the
separated members and on the error. Written to benchmarks/results/race_confirmation-<device>.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from search.results.front import compute_front, front_groups
from search.results.intervals import wilson_interval
from search.results.location import default_cache_dir
from search.results.store import read_table, write_atomic
from search.study.confirm import configs_to_confirm
from search.study.race import race_step

DATA_DIR = Path(__file__).resolve().parent / "data"
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
MODEL = "ls_convit_micro"
# Small ViTs whose accuracies after a few epochs lie within a few points of each other, with
# throughputs over about 10x: fronts with close calls, the case the confirmation is for.
GRID = {"depth": [1, 2], "embed_dim": [16, 32, 48], "local_up_to_layer": [0, 1]}
GRID_NAME = "convit-seeds"
EPOCHS, LR = 3, 2e-3
SCHEMA = pa.schema([("config_id", pa.int64()), ("depth", pa.int64()), ("embed_dim", pa.int64()),
                    ("local_up_to_layer", pa.int64()), ("seed", pa.int64()), ("val_acc", pa.float64()),
                    ("val_images", pa.int64()), ("throughput", pa.float64()), ("throughput_low", pa.float64()),
                    ("throughput_high", pa.float64()), ("throughput_device", pa.string())])


def _configs() -> list[dict]:
    import itertools

    keys = list(GRID)
    return [dict(zip(keys, v)) for v in itertools.product(*GRID.values())]


def record(path: Path, *, seeds: int) -> None:
    """Train every config with seeds 0 .. seeds-1 (the ones already in ``path`` are skipped): the
    trial's own loaders and training step (``trainers.trial_loaders``, ``trainers.training_step``),
    validated after every epoch; the best epoch's accuracy is the run's. Throughput is the
    architecture's, the same for every seed: it is taken from the convit-wide recording (the
    same model and knobs, timed there once per architecture), with the store's noise floor."""
    import torch

    from trainers import build_model, evaluate, place_model, trial_loaders, training_step
    from trainers.config import ThroughputSettings, TrainSettings, TrialConfig
    from trainers.data import DatasetRequest, prepare_dataset

    timed = read_table(DATA_DIR / "curves-convit-wide.parquet").to_pandas()
    timed = timed[timed["patch_size"] == 7].groupby(["depth", "embed_dim", "local_up_to_layer"]).first()
    floor = ThroughputSettings().noise_floor
    data = prepare_dataset(DatasetRequest(name="fashion_mnist", train_fraction=0.03, val_fraction=0.03, seed=0),
                           cache_dir=default_cache_dir())
    rows = read_table(path).to_pylist() if path.exists() else []
    done = {(r["config_id"], r["seed"]) for r in rows}
    todo = [(i, c, s) for s in range(seeds) for i, c in enumerate(_configs()) if (i, s) not in done]
    print(f"{len(todo)} runs to go ({len(done)} recorded) on {data.counts['train']} train / {data.counts['val']} val images")
    device = torch.device("cpu")
    for step, (config_id, config, seed) in enumerate(todo):
        start = time.perf_counter()
        cfg = TrialConfig(model=MODEL, model_args={**config, "patch_size": 7}, data=data, epochs=EPOCHS,
                          train=TrainSettings(batch_size=64, lr=LR, warmup_epochs=0.3, pad_crop=0, num_workers=2),
                          throughput=ThroughputSettings(), seed=seed, device="cpu")
        torch.manual_seed(seed)
        model = build_model(cfg)
        channels_last = place_model(model, device)
        train, val = trial_loaders(cfg, device=device, channels_last=channels_last)
        steps = len(train)
        train_step = training_step(model, cfg, device, steps_per_epoch=steps)
        best = -1.0
        for epoch in range(EPOCHS):  # as train_trial's epochs: train, then validate
            train.next_epoch = epoch
            model.train()
            for i, (images, labels) in enumerate(train):
                train_step(images, labels, at=epoch * steps + i)
            best = max(best, evaluate(train_step.runner, val, autocast=train_step.autocast)[1])
        tput = float(timed.loc[(config["depth"], config["embed_dim"], config["local_up_to_layer"]), "throughput"])
        rows.append({"config_id": config_id, **config, "seed": seed, "val_acc": best, "val_images": data.counts["val"],
                     "throughput": tput, "throughput_low": tput * (1 - floor), "throughput_high": tput * (1 + floor),
                     "throughput_device": str(timed["throughput_device"].iloc[0])})
        write_atomic(pa.Table.from_pylist(rows, schema=SCHEMA), path)  # after every run: resumable
        print(f"[{step + 1}/{len(todo)}] config {config_id} seed {seed}: val_acc {best:.4f}, "
              f"{time.perf_counter() - start:.1f} s", flush=True)


def _row(trial_id: str, acc: float, base: dict, *, of: str | None = None) -> dict:
    low, high = wilson_interval(acc, base["val_images"])
    return {"trial_id": trial_id, "state": "COMPLETE", "family": "convit", "val_acc": acc, "val_images": base["val_images"],
            "val_acc_low": low, "val_acc_high": high, "throughput": base["throughput"],
            "throughput_low": base["throughput_low"], "throughput_high": base["throughput_high"],
            "throughput_device": base["throughput_device"], "replicate_of": of}


def _outcome(search: list[dict], replicates: list[dict], truth: dict[str, float]) -> dict:
    rows = pd.DataFrame.from_records(search + replicates)
    front = compute_front(rows, OBJECTIVES)
    errors = [row["val_acc"] - truth[row["trial_id"]] for row in front.to_dict("records")]
    return {"members": len(front), "separated": int(front["tied_with"].isna().sum()),
            "groups": front_groups(front, OBJECTIVES), "replicates": len(replicates),
            "rmse": math.sqrt(statistics.fmean(e * e for e in errors)) if errors else math.nan}


def replay(table: pd.DataFrame, *, repetitions: int, available: int, top: int, seeds_fixed: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    by_config = {f"c{cid}": group.to_dict("records") for cid, group in table.groupby("config_id")}
    out: dict[str, list[dict]] = {"fixed": [], "race": []}
    for _ in range(repetitions):
        drawn = {c: [runs[i] for i in rng.permutation(len(runs))] for c, runs in by_config.items()}
        usable = {c: runs[:available] for c, runs in drawn.items()}
        truth = {c: statistics.fmean(r["val_acc"] for r in runs[available:]) for c, runs in drawn.items()}
        search = [_row(c, runs[0]["val_acc"], runs[0]) for c, runs in usable.items()]
        front = compute_front(pd.DataFrame.from_records(search), OBJECTIVES).to_dict("records")
        pool = configs_to_confirm(front, search, OBJECTIVES, top=top)

        def replicate(config: str, k: int) -> dict:  # the config's k-th further seed (1-based)
            return _row(f"{config}-r{k}", usable[config][k]["val_acc"], usable[config][k], of=config)

        fixed = [replicate(r["trial_id"], k) for r in pool for k in range(1, seeds_fixed + 1)]
        budget = len(fixed)  # equal budget: what the fixed confirmation spends on this pool
        out["fixed"].append(_outcome(search, fixed, truth))
        raced: list[dict] = []
        given: dict[str, int] = {}
        while len(raced) < budget:
            config = race_step(pool, raced, OBJECTIVES, max_seeds=available - 1, running={})
            if config is None:
                break
            given[config] = given.get(config, 0) + 1
            raced.append(replicate(config, given[config]))
        out["race"].append(_outcome(search, raced, truth))
    return out


def _summary(runs: list[dict]) -> dict:
    return {key: {"median": float(np.median([r[key] for r in runs])), "mean": float(np.mean([r[key] for r in runs]))}
            for key in ("members", "separated", "groups", "replicates", "rmse")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="train the grid's configs x seeds first (resumable)")
    parser.add_argument("--seeds", type=int, default=8, help="seeds recorded per config (default 8)")
    parser.add_argument("--available", type=int, default=5,
                        help="of each config's seeds, those a study may train; the rest are the truth (default 5)")
    parser.add_argument("--top", type=int, default=4, help="budget.confirm.top (default 4)")
    parser.add_argument("--seeds-fixed", type=int, default=2, help="the fixed confirmation's seeds (default 2)")
    parser.add_argument("--repetitions", type=int, default=300)
    parser.add_argument("--results-dir", type=Path, help="default: benchmarks/results")
    args = parser.parse_args(argv)
    from benchmarks._env import write_result

    path = DATA_DIR / f"seeds-{GRID_NAME}.parquet"
    if args.record:
        record(path, seeds=args.seeds)
    table = read_table(path).to_pandas()
    complete = table.groupby("config_id")["seed"].nunique()
    table = table[table["config_id"].isin(complete[complete >= args.seeds].index)]
    if table.empty:
        raise SystemExit(f"{path}: no config has {args.seeds} seeds recorded; run with --record")
    out = replay(table, repetitions=args.repetitions, available=args.available, top=args.top,
                 seeds_fixed=args.seeds_fixed, seed=0)
    from scipy import stats

    tests = {}
    for key in ("separated", "rmse"):
        race, fixed = [r[key] for r in out["race"]], [r[key] for r in out["fixed"]]
        diff = [a - b for a, b in zip(race, fixed)]
        p = float(stats.wilcoxon(race, fixed).pvalue) if any(diff) else 1.0
        tests[key] = {"race_minus_fixed_mean": float(np.mean(diff)), "race_better": int(sum(
            (d > 0) if key == "separated" else (d < 0) for d in diff)), "fixed_better": int(sum(
            (d < 0) if key == "separated" else (d > 0) for d in diff)), "wilcoxon_p": p}
    result = {
        "recording": {"file": str(path.relative_to(Path(__file__).resolve().parents[1])), "grid": GRID, "model": MODEL,
                      "epochs": EPOCHS, "lr": LR, "configs": int(table["config_id"].nunique()),
                      "seeds": args.seeds, "val_images": int(table["val_images"].iloc[0]),
                      "throughput_device": str(table["throughput_device"].iloc[0])},
        "settings": {"available": args.available, "truth_seeds": args.seeds - args.available, "top": args.top,
                     "seeds_fixed": args.seeds_fixed, "budget": args.top * args.seeds_fixed,
                     "race_max_seeds": args.available - 1, "repetitions": args.repetitions},
        "summary": {m: _summary(runs) for m, runs in out.items()}, "paired": tests,
    }
    target = write_result("race_confirmation", result, results_dir=args.results_dir)
    for method, summary in result["summary"].items():
        print(f"{method:6s} " + "  ".join(f"{k} {v['mean']:.4g} (median {v['median']:.4g})" for k, v in summary.items()))
    for key, test in tests.items():
        print(f"{key}: race - fixed {test['race_minus_fixed_mean']:+.4g} on average; race better in "
              f"{test['race_better']}, fixed in {test['fixed_better']} of {args.repetitions}; Wilcoxon p = {test['wilcoxon_p']:.3g}")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

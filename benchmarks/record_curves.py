"""Record real learning curves once, for benchmarks that replay searches without training.

    python -m benchmarks.record_curves                      # the first grid (64 configs x 5 epochs)
    python -m benchmarks.record_curves --grid convit-wide   # 300 configs x 8 epochs (replay_search's)
    python -m benchmarks.record_curves --grid convit-wide-seeds  # 64 of them x 2 trial seeds: noise
    python -m benchmarks.record_curves --grid zoo           # every family, its conditional space: 90 configs
    python -m benchmarks.record_curves --epochs 3 --limit 4 # a quick look

Trains every configuration of a ConViT grid on real Fashion-MNIST (a small stratified subset,
so the grid fits a CPU) for the full epoch budget and writes one row per configuration and
epoch to ``benchmarks/data/curves-<grid>.parquet``: the knobs, the epoch, val_acc, best_val_acc,
val_loss, and the architecture's params and inference throughput (measured once per
architecture, cached). Configurations already in the file are skipped, so an interrupted
recording continues where it stopped.

The grids (knobs of ls_convit_micro), in GRIDS: ``convit-fashion_mnist`` (depth x embed_dim x
local_up_to_layer x lr, 64 points) and ``convit-wide`` (adds the patch size and wider ranges:
300 points whose throughputs span two orders of magnitude, so that no one configuration holds
most of the front's hypervolume), and ``convit-wide-seeds``: a random 64 of convit-wide's points, each
trained with two trial seeds (initialisation and batch order; the data subset is the grid's), so
that a replay can draw a seed per trial and meet the noise a real search meets (rows carry a
``seed`` column). ``zoo``: every family of spaces/locality_zoo.yaml on one front, its conditional
space on a grid (a ``model`` column, each model's own knobs null in the other models' rows; 90
points). The replay benchmark (``benchmarks.replay_search``) lets searchers pick from exactly
these points.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from search.results.location import default_cache_dir
from search.results.store import read_table, write_atomic
from trainers.config import ThroughputSettings, TrainSettings, TrialConfig
from trainers.data import DatasetRequest, prepare_dataset
from trainers.train import train_trial

DATA_DIR = Path(__file__).resolve().parent / "data"
GRIDS = {
    "convit-fashion_mnist": {
        "grid": {
            "depth": [2, 4, 6, 8],
            "embed_dim": [48, 96],
            "local_up_to_layer": [0, 2],  # 0: every block plain attention (DeiT); 2: two GPSA blocks
            "lr": [1e-3, 3e-3],
        },
        "dataset": DatasetRequest(name="fashion_mnist", train_fraction=0.05, val_fraction=0.05, seed=0),
        "epochs": 5,
    },
    "convit-wide": {
        "grid": {
            "depth": [1, 2, 3, 4, 6],
            "embed_dim": [16, 32, 48, 64, 96],  # 4 heads of 4 to 24
            "patch_size": [4, 7],  # 7x7 or 4x4 tokens: about 3x in cost
            "local_up_to_layer": [0, 1],  # DeiT, or GPSA in the first block
            "lr": [1e-3, 2e-3, 4e-3],
        },
        "dataset": DatasetRequest(name="fashion_mnist", train_fraction=0.03, val_fraction=0.03, seed=0),
        "epochs": 8,
    },
}
# the noisy benchmark: part of convit-wide, each point with two trial seeds (the same data subset)
GRIDS["convit-wide-seeds"] = {**GRIDS["convit-wide"], "seeds": [0, 1], "configs": 64}
# every family on one front, the conditional space of spaces/locality_zoo.yaml on a grid: the model
# is a choice and each brings its own knobs (null in the other models' rows); lr is shared. The
# transformers are 96 wide with 4 heads (timm's ViT also at 48 and 192: "a few sizes"). DeiT is
# timm's ViT here, so ConViT and Refiner start at one local block: at 0 their other knob changes
# nothing, and the grid would train the same network twice.
GRIDS["zoo"] = {
    "models": {
        "ls_convit_micro": {"depth": [3, 5, 8], "local_up_to_layer": [1, 3], "locality_strength": [1.0, 3.0]},
        "ls_gmm_micro": {"depth": [3, 5, 8], "num_kernels": [1, 3, 5]},
        "ls_refiner_micro": {"depth": [3, 5, 8], "refiner_ratio": [1, 3], "refiner_blocks": [1, 3]},
        "ls_tcnn_resnet10_micro_s": {"reparam_fraction": [0.0, 0.5, 1.0]},  # of the epochs; 1.0: the plain CNN
        "vit_tiny_patch16_224": {"depth": [3, 5, 8], "embed_dim": [48, 96, 192]},
    },
    "args": {"vit_tiny_patch16_224": {"img_size": 28, "in_chans": 1, "num_classes": 10, "patch_size": 4,
                                      "num_heads": 4, "class_token": False, "global_pool": "avg"}},
    "grid": {"lr": [1e-3, 3e-3]},  # shared by every model
    "dataset": DatasetRequest(name="fashion_mnist", train_fraction=0.03, val_fraction=0.03, seed=0),
    "epochs": 8,
}
GRID_NAME = "convit-fashion_mnist"
GRID = GRIDS[GRID_NAME]["grid"]
MODEL = "ls_convit_micro"
COLUMNS = [("epoch", pa.int64()), ("max_epochs", pa.int64()), ("val_acc", pa.float64()),
           ("best_val_acc", pa.float64()), ("val_loss", pa.float64()), ("params", pa.int64()), ("throughput", pa.float64()),
           ("epoch_time_s", pa.float64()), ("throughput_device", pa.string())]


def knob_values(chosen: dict) -> dict[str, list]:
    """Every knob of a recorded grid and its values, in the rows' column order: a conditional grid's
    (``models``) starts with ``model``, then each model's knobs, then the shared ones."""
    if "models" not in chosen:
        return dict(chosen["grid"])
    knobs: dict[str, list] = {"model": list(chosen["models"])}
    for space in chosen["models"].values():
        for key, values in space.items():
            knobs[key] = sorted(set(knobs.get(key, [])) | set(values))
    return {**knobs, **chosen["grid"]}


def schema(grid: dict, *, seeds: bool = False) -> pa.Schema:
    """The rows' columns; ``grid``: knob -> values (``knob_values``). A conditional grid's knobs are
    null where the row's model lacks them."""
    def kind(values: list) -> pa.DataType:
        if any(isinstance(v, str) for v in values):
            return pa.string()
        return pa.float64() if any(isinstance(v, float) for v in values) else pa.int64()

    knobs = [(k, kind(values)) for k, values in grid.items()]
    return pa.schema([("config_id", pa.int64()), *([("seed", pa.int64())] if seeds else []), *knobs, *COLUMNS])


def grid_configs(grid: dict | None = None) -> list[dict]:
    """Every configuration of a grid (knob -> values), or of a recorded grid's entry with ``models``
    (a conditional grid): each model's knobs crossed with the shared ones, the other models' knobs
    None, so that every configuration has every column."""
    grid = GRID if grid is None else grid
    if "models" in grid:
        columns = knob_values(grid)
        configs = []
        for model, space in grid["models"].items():
            for config in grid_configs({**space, **grid["grid"]}):
                configs.append({k: model if k == "model" else config.get(k) for k in columns})
        return configs
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def model_and_args(chosen: dict, config: dict) -> tuple[str, dict]:
    """The timm model a configuration trains and its constructor arguments: the grid's fixed ones
    for that model, then the configuration's knobs (all but ``lr``; a conditional grid's own
    model, its knobs the model lacks left out)."""
    model = config.get("model", MODEL)
    knobs = {k: v for k, v in config.items() if k not in ("lr", "model") and v is not None}
    return model, {**chosen.get("args", {}).get(model, {}), **knobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default=GRID_NAME)
    parser.add_argument("--epochs", type=int, help="epochs per configuration (default: the grid's)")
    parser.add_argument("--limit", type=int, help="record only the first N configurations (default: the grid's)")
    parser.add_argument("--out", type=Path, help="default: benchmarks/data/curves-GRID.parquet")
    args = parser.parse_args()
    chosen = GRIDS[args.grid]
    args.epochs = args.epochs or chosen["epochs"]
    args.out = args.out or DATA_DIR / f"curves-{args.grid}.parquet"

    data = prepare_dataset(chosen["dataset"], cache_dir=default_cache_dir())
    seeds = chosen.get("seeds", [0])
    seeded = "seeds" in chosen  # rows name their trial seed
    rows = read_table(args.out).to_pylist() if args.out.exists() else []
    done = {(r["config_id"], r.get("seed", 0)) for r in rows}
    # a random order (fixed): a recording stopped early is a random subset, not one corner of the grid
    every = grid_configs(chosen if "models" in chosen else chosen["grid"])
    order = np.random.default_rng(0).permutation(len(every))
    configs = [(int(i), every[i]) for i in order][: args.limit or chosen.get("configs")]
    runs = [(config_id, config, seed) for config_id, config in configs for seed in seeds]
    print(f"{len(configs)} configurations x {len(seeds)} seeds x {args.epochs} epochs on {data.counts['train']} "
          f"train / {data.counts['val']} val images; {len(done)} already recorded")
    for step, (config_id, config, seed) in enumerate(runs):
        if (config_id, seed) in done:
            continue
        start = time.perf_counter()
        model, model_args = model_and_args(chosen, config)
        cfg = TrialConfig(
            model=model, model_args=model_args, data=data, epochs=args.epochs,
            train=TrainSettings(batch_size=64, lr=config["lr"], warmup_epochs=0.3, pad_crop=0, num_workers=2),
            throughput=ThroughputSettings(batch_size=256, warmup=3, repeats=10),
            throughput_cache_dir=str(default_cache_dir() / "throughput"), seed=seed,
        )
        outcome = train_trial(cfg)
        for m in outcome.history:
            rows.append({"config_id": config_id, **({"seed": seed} if seeded else {}), **config, "epoch": m["epoch"], "max_epochs": args.epochs,
                         "val_acc": m["val_acc"], "best_val_acc": m["best_val_acc"], "val_loss": m["val_loss"],
                         "params": m["params"], "throughput": m["throughput"], "epoch_time_s": m["epoch_time_s"],
                         "throughput_device": m["throughput_device"]})
        write_atomic(pa.Table.from_pylist(rows, schema=schema(knob_values(chosen), seeds=seeded)), args.out)  # after every run
        print(f"[{step + 1}/{len(runs)}] {config} seed {seed}: val_acc {outcome.best_val_acc:.4f}, "
              f"{outcome.measurement['throughput']:,.0f} img/s, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

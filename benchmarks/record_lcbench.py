"""Record LCBench grids from YAHPO Gym's surrogate, for ``benchmarks.replay_search --grid lcbench-TASK``.

    python -m venv /tmp/yahpo && /tmp/yahpo/bin/pip install yahpo-gym==1.0.2 pyarrow   # numpy<2: its own venv
    git clone https://github.com/slds-lmu/yahpo_data /tmp/yahpo_data                    # the surrogates (lcbench/: 2 MB)
    PYTHONPATH=. /tmp/yahpo/bin/python -m benchmarks.record_lcbench --data /tmp/yahpo_data

Asks the surrogate for every configuration of ``benchmarks._lcbench.GRID`` at every epoch (1-52)
on each task and writes ``benchmarks/data/curves-lcbench-TASK.parquet`` in ``record_curves``'
columns: val_acc (the predicted validation accuracy, as a fraction), best_val_acc (its running
maximum), val_loss (cross-entropy), throughput (epochs per second: 52 over the predicted training
time at epoch 52), epoch_time_s; params is 0 (LCBench has none). Imports no torch.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._lcbench import EPOCHS, FIXED, GRID, TASKS

DATA_DIR = Path(__file__).resolve().parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a checkout of YAHPO Gym's data (yahpo_data)")
    parser.add_argument("--tasks", default=",".join(TASKS))
    args = parser.parse_args()
    from yahpo_gym import benchmark_set, local_config

    local_config.init_config()
    local_config.set_data_path(str(args.data))
    import yahpo_gym

    keys = list(GRID)
    configs = [dict(zip(keys, values)) for values in itertools.product(*GRID.values())]
    for task in args.tasks.split(","):
        bench = benchmark_set.BenchmarkSet("lcbench", instance=task)
        rows = []
        for config_id, config in enumerate(configs):
            asks = [{"OpenML_task_id": task, **config, **FIXED, "epoch": e} for e in range(1, EPOCHS + 1)]
            out = bench.objective_function(asks)
            speed = EPOCHS / out[-1]["time"]
            best = 0.0
            for e, r in zip(range(1, EPOCHS + 1), out):
                acc = r["val_accuracy"] / 100.0
                best = max(best, acc)
                rows.append({"config_id": config_id, **config, "epoch": e, "max_epochs": EPOCHS, "val_acc": acc,
                             "best_val_acc": best, "val_loss": r["val_cross_entropy"], "params": 0,
                             "throughput": speed, "epoch_time_s": out[-1]["time"] / EPOCHS,
                             "throughput_device": f"yahpo_gym {yahpo_gym.__version__} lcbench surrogate"})
        knobs = [(k, pa.float64() if any(isinstance(v, float) for v in vs) else pa.int64()) for k, vs in GRID.items()]
        schema = pa.schema([("config_id", pa.int64()), *knobs, ("epoch", pa.int64()), ("max_epochs", pa.int64()),
                            ("val_acc", pa.float64()), ("best_val_acc", pa.float64()), ("val_loss", pa.float64()),
                            ("params", pa.int64()), ("throughput", pa.float64()), ("epoch_time_s", pa.float64()),
                            ("throughput_device", pa.string())])
        path = DATA_DIR / f"curves-lcbench-{task}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
        print(f"task {task}: {len(configs)} configurations x {EPOCHS} epochs -> {path}", flush=True)


if __name__ == "__main__":
    main()

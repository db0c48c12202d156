"""The LCBench grids: a public multi-objective HPO benchmark (Zimmer et al. 2021, LCBench) through
YAHPO Gym's surrogate (Pfisterer et al. 2022), recorded as a grid like ``record_curves``' own.

No torch here: ``benchmarks.record_lcbench`` imports it in YAHPO Gym's environment (numpy<2).
The knobs: five of LCBench's seven at three values each (batch size, learning rate, units,
layers, weight decay), dropout at two, momentum fixed at 0.9: 486 configurations x 52 epochs.
The objectives: best validation accuracy (max) and training speed, epochs per second of the
surrogate's predicted training time (max: the analogue of a trial's inference throughput).
The tasks: the first three OpenML tasks of YAHPO's LCBench instance list, fixed before any replay.
"""

GRID = {
    "batch_size": [16, 64, 512],
    "learning_rate": [0.001, 0.01, 0.1],
    "max_units": [64, 256, 1024],
    "num_layers": [1, 3, 5],
    "weight_decay": [1e-05, 0.001, 0.1],
    "max_dropout": [0.0, 0.5],
}
FIXED = {"momentum": 0.9}
EPOCHS = 52
TASKS = ("126025", "126026", "126029")
GRIDS = {f"lcbench-{task}": {"grid": GRID, "epochs": EPOCHS, "task": task} for task in TASKS}

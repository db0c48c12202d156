"""Trial overhead: a trial's wall time vs the pure compute of its steps; Ray's per-trial cost with and without actor reuse.

    python -m benchmarks.trial_overhead                  # ls_convit_micro, Fashion-MNIST 10%, 3 epochs; Ray 12 no-op trials
    python -m benchmarks.trial_overhead --epochs 2 --skip-ray
    python -m benchmarks.trial_overhead --epochs 5 --train-fraction 0.5 --skip-ray   # ~2-minute trials, as the target: ~13 min
    python -m benchmarks.trial_overhead --only-ray --ray-trials 20

Trainer: `trainers.train.train_trial` runs a whole trial as a search does (build the model,
measure its throughput, FFCV loaders, AdamW with the lr schedule, validate and report every
epoch, the Tune adapter's checkpoint serialised in the report callback). The compute of the same
trial is then timed on its own: the same model, optimizer and batches (taken from the trial's
loaders beforehand, `trainers.trial_loaders`, kept in memory), only the trial's own training step
per training batch (`trainers.training_step`: lr, forward, loss, backward, AdamW) and the forward
per validation batch. overhead = 1 - compute / wall. Two trials run in one process: the
first pays the one-off costs (FFCV compilation, the throughput measurement), the second is what
every later trial on a node pays (loaders cached per process, measurement cached per
architecture), as with Ray's reused actors. Compute and trials alternate (compute, trial 1,
compute, trial 2, compute), the compute figure is the median. Target: overhead <= 15%.

Ray: a Tune run of --ray-trials no-op function trainables (each reports once) with
reuse_actors=True and with reuse_actors=False, alternately, on a local Ray started for the
benchmark (2 CPUs, no dashboard); seconds per trial = Tuner.fit() wall time / trials.

On a GPU (--device cuda; the trial trains with AMP and channels_last, as `precision: auto` does
there, and the compute replica does the same): an NVML sampler thread reads the GPU's
utilisation (the share of time a kernel was running) every 50 ms through each trial, and the
result reports its mean over the trial's epochs and over its whole wall time. --compile [MODE]
sets `train.compile: true` (or MODE): each trial compiles its own model, as in a search (a
process's later trials reuse the first one's compiled code), and the compute replica is compiled
before its clock starts, so a trial's compiling counts as its overhead. --cuda-graph sets
`train.cuda_graph: true` (the whole step as one CUDA graph); the compute replica captures the
same step before its clock starts and replays it.

    python -m benchmarks.trial_overhead --device cuda --skip-ray --train-fraction 1.0 --batch-size 256
    python -m benchmarks.trial_overhead --device cuda --skip-ray --train-fraction 1.0 --batch-size 256 \
        --compile --result-name trial_overhead_compile     # train.compile: true
    python -m benchmarks.trial_overhead --device cuda --skip-ray --train-fraction 1.0 --batch-size 256 \
        --compile reduce-overhead --result-name trial_overhead_cudagraphs
    python -m benchmarks.trial_overhead ... --num-workers 8   # FFCV's loader threads (default: auto)
    python -m benchmarks.trial_overhead --device cuda --skip-ray --train-fraction 1.0 --batch-size 256 \
        --cuda-graph [--compile] --result-name trial_overhead_step_graph   # train.cuda_graph: true

Writes benchmarks/results/trial_overhead-<device>.json.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import threading
import time

import torch

from benchmarks._env import init_local_ray, parse_and_set_up, write_result
from trainers.config import COMPILE_MODES, ThroughputSettings, TrainSettings, TrialConfig


def config(data, *, epochs: int, cache_dir: str, model: str = "ls_convit_micro", device: str = "cpu",
           batch_size: int | None = None, num_workers: int | None = None, compile: bool | str = False,
           cuda_graph: bool = False) -> TrialConfig:
    """The benchmark's trial (also trial_profile's and tune_step's): ``model`` on ``data`` with the
    trainer's defaults but for what is given; throughput measurements cached in ``cache_dir``."""
    chosen = {"batch_size": batch_size, "num_workers": num_workers}
    train = TrainSettings(compile=compile, cuda_graph=cuda_graph, **{k: v for k, v in chosen.items() if v is not None})
    return TrialConfig(model=model, model_args={}, data=data, epochs=epochs, train=train,
                       throughput=ThroughputSettings(), seed=0, device=device, throughput_cache_dir=cache_dir)


class GpuUtilisation:
    """NVML's utilisation of one GPU (percent of the last sample period with a kernel running),
    sampled every `period_s` in a thread: `with GpuUtilisation(0) as util: ...; util.mean(t0, t1)`."""

    @staticmethod
    def require() -> None:
        """Exit with the fix when NVML's bindings are missing (before any trial runs)."""
        try:
            import pynvml  # noqa: F401  (nvidia-ml-py: NVIDIA's bindings, not a dependency of the CPU install)
        except ImportError:
            raise SystemExit("error: --device cuda reads the GPU's utilisation through NVML: "
                             "pip install nvidia-ml-py") from None

    def __init__(self, index: int, period_s: float = 0.05) -> None:
        self.require()
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._period = period_s
        self._stop = threading.Event()
        self.samples: list[tuple[float, int]] = []  # (perf_counter, percent)
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.samples.append((time.perf_counter(), self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def __enter__(self) -> "GpuUtilisation":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()

    def mean(self, start: float, end: float) -> float | None:
        inside = [pct for t, pct in self.samples if start <= t <= end]
        return statistics.fmean(inside) if inside else None


def _trial(cfg) -> dict:
    from trainers import pick_device, train_trial

    reports = []

    def on_epoch(metrics, get_state):  # what the Tune adapter does, minus Ray: serialise a checkpoint
        buffer = io.BytesIO()
        if get_state is not None:
            torch.save(get_state(), buffer)
        reports.append({**metrics, "checkpoint_bytes": buffer.tell(), "reported_at": time.perf_counter()})

    device = pick_device(cfg.device)
    sampler = GpuUtilisation(device.index or 0) if device.type == "cuda" else None
    start = time.perf_counter()
    if sampler is None:
        outcome = train_trial(cfg, on_epoch=on_epoch)
    else:
        with sampler:
            outcome = train_trial(cfg, on_epoch=on_epoch)
    end = time.perf_counter()
    wall = end - start
    epochs_s = sum(r["epoch_time_s"] for r in reports)
    # outside the epochs: building the model and loaders, the throughput measurement (after the
    # first epoch, unless cached), the reports and their checkpoints
    out = {"wall_s": wall, "epochs_s": epochs_s, "outside_epochs_s": wall - epochs_s,
           "train_s": [r["train_time_s"] for r in reports], "epoch_s": [r["epoch_time_s"] for r in reports],
           "best_val_acc": outcome.best_val_acc, "throughput_cached": reports[0].get("throughput_cached"),
           "train_images_per_s": [r["train_images_per_s"] for r in reports],
           # of train_s: the host waiting for the loader's next batch (an input-bound trial waits long)
           "loader_wait_s": [r["train_loader_wait_s"] for r in reports]}
    if sampler is not None:
        epochs_start = reports[0]["reported_at"] - reports[0]["epoch_time_s"]
        out["gpu_utilisation_pct"] = {
            "epochs": sampler.mean(epochs_start, reports[-1]["reported_at"]),
            "whole_trial": sampler.mean(start, end),
            "per_epoch": [sampler.mean(r["reported_at"] - r["epoch_time_s"], r["reported_at"]) for r in reports],
            "samples": len(sampler.samples),
        }
    return out


def _compute(cfg, batches: dict) -> float:
    """Seconds of the trial's training steps (`trainers.training_step`: lr, forward, loss, backward,
    AdamW) over its training batches and of the forward over its validation batches, from memory;
    the same model, parameter groups and lr schedule."""
    from trainers import build_model, pick_device, place_model, training_step

    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    model = build_model(cfg)
    place_model(model, device)  # as train_trial
    steps = len(batches["train"][0])
    step = training_step(model, cfg, device, steps_per_epoch=steps)  # as train_trial's
    if step.graphed:  # captured before the clock starts, as the compiling below
        model.train()
        step.capture(*batches["train"][0][0])
    if cfg.train.compile_mode is not None:  # compiled before the clock starts: a trial's compiling is overhead, not compute
        if not step.graphed:  # (a capture compiled the training step in its warm-up)
            model.train()
            with step.autocast():
                step.criterion(step.runner(batches["train"][0][0][0]), batches["train"][0][0][1]).backward()
            step.optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.inference_mode(), step.autocast():
            step.runner(batches["val"][0][0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        model.train()
        for i, (images, labels) in enumerate(batches["train"][epoch]):
            step(images, labels, at=epoch * steps + i)
        model.eval()
        with torch.inference_mode():
            for images, labels in batches["val"]:
                with step.autocast():
                    step.runner(images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _batches(cfg) -> dict:
    from trainers import build_model, pick_device, runs_channels_last, trial_loaders

    device = pick_device(cfg.device)
    channels_last = runs_channels_last(build_model(cfg), device)  # as train_trial's batches
    train, val = trial_loaders(cfg, device=device, channels_last=channels_last)
    return {"train": [[(x, y) for x, y in train] for _ in range(cfg.epochs)], "val": [(x, y) for x, y in val]}


def trainer_overhead(*, epochs: int, model: str = "ls_convit_micro", device: str = "cpu", train_fraction: float = 0.1,
                     batch_size: int | None = None, num_workers: int | None = None,
                     compile: bool | str = False, cuda_graph: bool = False) -> dict:
    from search.results.location import default_cache_dir
    from trainers.data import DatasetRequest, prepare_dataset

    data = prepare_dataset(DatasetRequest(name="fashion_mnist", train_fraction=train_fraction),
                           cache_dir=default_cache_dir())
    with tempfile.TemporaryDirectory(prefix="ls-bench-tput-") as cache:
        cfg = config(data, epochs=epochs, cache_dir=cache, model=model, device=device, batch_size=batch_size,
                     num_workers=num_workers, compile=compile, cuda_graph=cuda_graph)
        # The trials go first in this process, so the first one really is cold (FFCV compiles).
        compute = []
        first = _trial(cfg)
        batches = _batches(cfg)
        compute.append(_compute(cfg, batches))
        second = _trial(cfg)
        compute.append(_compute(cfg, batches))
        third = _trial(cfg)
        compute.append(_compute(cfg, batches))
    compute_s = statistics.median(compute)
    trials = {"first": first, "later": [second, third]}
    later_wall = statistics.median([t["wall_s"] for t in trials["later"]])
    return {
        "config": {"model": cfg.model, "dataset": data.name, "train_images": data.counts["train"],
                   "val_images": data.counts["val"], "epochs": epochs, "batch_size": cfg.train.batch_size,
                   "num_workers": cfg.train.num_workers, "loader_threads": cfg.train.loader_threads,
                   "throughput_batch": cfg.throughput.batch_size,
                   "device": device, "precision": cfg.train.precision, "compile": cfg.train.compile,
                   "compile_mode": cfg.train.compile_mode, "cuda_graph": cfg.train.cuda_graph},
        "compute_s": compute,
        "compute_median_s": compute_s,
        "trials": trials,
        "overhead_first_trial": 1.0 - compute_s / first["wall_s"],
        "overhead_later_trial": 1.0 - compute_s / later_wall,
        # per-epoch view: epoch wall (train + validate) against its share of the compute
        "overhead_within_epochs_later": 1.0 - compute_s / statistics.median([t["epochs_s"] for t in trials["later"]]),
    }


def _noop(config):
    from ray import tune

    tune.report({"done": 1})


def ray_overhead(*, trials: int, repeats: int) -> dict:
    import ray
    from ray import tune

    init_local_ray(num_cpus=2)  # its workers import this module, as the search's do
    try:
        times: dict[str, list[float]] = {"reuse_actors": [], "fresh_actors": []}
        with tempfile.TemporaryDirectory(prefix="ls-bench-ray-") as storage:
            def fit(reuse: bool, tag: str) -> float:
                tuner = tune.Tuner(
                    _noop,
                    tune_config=tune.TuneConfig(num_samples=trials, reuse_actors=reuse),
                    run_config=tune.RunConfig(name=tag, storage_path=storage, verbose=0),
                )
                start = time.perf_counter()
                grid = tuner.fit()
                elapsed = time.perf_counter() - start
                assert len(grid) == trials and not grid.errors, grid.errors
                return elapsed

            fit(True, "warmup")  # the first Tune run pays imports and worker start-up
            for i in range(repeats):
                times["reuse_actors"].append(fit(True, f"reuse-{i}"))
                times["fresh_actors"].append(fit(False, f"fresh-{i}"))
    finally:
        ray.shutdown()
    per_trial = {k: statistics.median(v) / trials for k, v in times.items()}
    return {"trials": trials, "repeats": repeats, "fit_s": times, "seconds_per_trial": per_trial,
            "fresh_over_reuse": per_trial["fresh_actors"] / per_trial["reuse_actors"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="ls_convit_micro")
    parser.add_argument("--train-fraction", type=float, default=0.1, help="of Fashion-MNIST's 60,000 training images")
    parser.add_argument("--batch-size", type=int, help="train.batch_size (default: the trainer's, 128)")
    parser.add_argument("--num-workers", type=int,
                        help="train.num_workers, FFCV's loader threads (default: the trainer's, auto)")
    parser.add_argument("--ray-trials", type=int, default=12)
    parser.add_argument("--ray-repeats", type=int, default=2)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--only-ray", action="store_true")
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=COMPILE_MODES, metavar="MODE",
                        help="train.compile: true, or MODE (e.g. reduce-overhead): the trials' and the compute "
                             "replica's batches through torch.compile")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="train.cuda_graph: true (each trial captures its whole training step as one CUDA graph)")
    parser.add_argument("--result-name", default="trial_overhead",
                        help="the JSON's name: benchmarks/results/<name>-<device>.json (default: trial_overhead)")
    # the process set up as train_trial's, so the compute replica runs under the same allocator settings
    args = parse_and_set_up(parser, argv)
    if args.device == "cuda" and not args.only_ray:
        GpuUtilisation.require()
    result: dict = {}
    if not args.only_ray:
        t = trainer_overhead(epochs=args.epochs, model=args.model, device=args.device,
                             train_fraction=args.train_fraction, batch_size=args.batch_size,
                             num_workers=args.num_workers, compile=args.compile, cuda_graph=args.cuda_graph)
        result["trainer"] = t
        first, later = t["trials"]["first"], t["trials"]["later"]
        print(f"trainer: {t['config']['model']}, {t['config']['train_images']} train / {t['config']['val_images']} val "
              f"images, {args.epochs} epochs, batch {t['config']['batch_size']}, "
              f"{t['config']['loader_threads']} loader threads"
              f"{'' if args.compile is False else ', torch.compile ' + t['config']['compile_mode']}"
              f"{', whole step as a CUDA graph' if args.cuda_graph else ''}")
        print(f"  pure compute (fwd/bwd/AdamW + val forward, from memory): {t['compute_median_s']:.2f} s "
              f"(runs: {', '.join(f'{c:.2f}' for c in t['compute_s'])})")
        print(f"  first trial in the process: {first['wall_s']:.2f} s wall ({first['outside_epochs_s']:.2f} s outside "
              f"its epochs) -> overhead {t['overhead_first_trial']:.1%}")
        for i, tr in enumerate(later, 2):
            print(f"  trial {i}: {tr['wall_s']:.2f} s wall ({tr['outside_epochs_s']:.2f} s outside its epochs, "
                  f"throughput cached: {tr['throughput_cached']}); of its epochs, training {sum(tr['train_s']):.2f} s "
                  f"(waiting for the loader {sum(tr['loader_wait_s']):.2f} s), validating "
                  f"{sum(tr['epoch_s']) - sum(tr['train_s']):.2f} s")
        print(f"  later trials: overhead {t['overhead_later_trial']:.1%} (target <= 15%: "
              f"{'met' if t['overhead_later_trial'] <= 0.15 else 'NOT met'}); within the epochs alone "
              f"{t['overhead_within_epochs_later']:.1%}")
        for i, tr in enumerate([first, *later], 1):
            if "gpu_utilisation_pct" in tr:
                u = tr["gpu_utilisation_pct"]
                print(f"  trial {i}: GPU utilisation {u['epochs']:.0f}% over its epochs, {u['whole_trial']:.0f}% over "
                      f"the whole trial ({u['samples']} NVML samples); training {max(tr['train_images_per_s']):,.0f} img/s")
    if not args.skip_ray:
        r = ray_overhead(trials=args.ray_trials, repeats=args.ray_repeats)
        result["ray"] = r
        print(f"ray: {r['trials']} no-op trials per Tune run, median of {r['repeats']} runs each")
        print(f"  reuse_actors=True : {r['seconds_per_trial']['reuse_actors']:.3f} s/trial")
        print(f"  reuse_actors=False: {r['seconds_per_trial']['fresh_actors']:.3f} s/trial "
              f"({r['fresh_over_reuse']:.2f}x the reused)")
    path = write_result(args.result_name, result, device=args.device)
    print(f"-> {path}")


if __name__ == "__main__":
    main()

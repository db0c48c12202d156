"""Trial profile: where a warm trial's time goes, host and GPU (torch.profiler), and the loader alone.

    python -m benchmarks.trial_profile --device cuda --compile reduce-overhead --num-workers 8
    python -m benchmarks.trial_profile --device cuda --cuda-graph --compile --num-workers 8
    python -m benchmarks.trial_profile --model ls_convit_nano --train-fraction 0.05      # CPU

`benchmarks.trial_overhead` says how much of a trial is not compute; this says what that is. One
process runs the same trial (`trainers.train.train_trial`, ls_convit_micro on Fashion-MNIST, the
trial_overhead options) four times: two to warm up (FFCV's compilation, torch.compile, the
throughput measurement), one unprofiled (its epochs' training, loader-wait and validation
seconds, and its host time per training step), one under torch.profiler (CPU, and CUDA on a
GPU; a profiled trial runs slower, so read its shares, not its seconds), whose top operators by
host time and by GPU time are printed. The loader's hand-out of each batch (queue wait plus the
augmentation's launches) is the range `ls::next_batch`. Last, the training loader alone: three
epochs of batches handed out with no model (the GPU synchronised at each epoch's end).

Writes benchmarks/results/trial_profile-<device>.json; --trace also writes the profiled trial's
Chrome trace (chrome://tracing, Perfetto), gzipped, beside it (tens of MB on a GPU).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks._env import RESULTS_DIR, parse_and_set_up, write_result
from benchmarks.trial_overhead import config
from trainers.config import COMPILE_MODES


@contextmanager
def _labelled_batches() -> Iterator[None]:
    """The trainer's hand-out of each training batch as the profiler range ls::next_batch."""
    import trainers.train as train_module

    original = train_module._waited_for

    def labelled(batches, waited):
        iterator = original(batches, waited)
        while True:
            with record_function("ls::next_batch"):
                item = next(iterator, None)
            if item is None:
                return
            yield item

    train_module._waited_for = labelled
    try:
        yield
    finally:
        train_module._waited_for = original


def _top(events, key: str, n: int) -> list[dict[str, Any]]:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "cpu_total_ms": e.cpu_time_total / 1e3,
             "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3, "calls": e.count} for e in rows]


def _print_top(title: str, rows: list[dict[str, Any]], steps: int) -> None:
    print(f"{title} (per training step: {steps} steps)")
    for r in rows:
        print(f"  {r['name'][:70]:<70} host self {r['self_cpu_ms'] / steps:7.3f} ms  "
              f"gpu {r['self_device_ms'] / steps:7.3f} ms  calls {r['calls'] / steps:7.1f}")


def trial_profile(*, device: str, model: str, train_fraction: float, epochs: int, batch_size: int | None,
                  num_workers: int | None, compile: bool | str, cuda_graph: bool, trace: str | None,
                  dataset: str = "fashion_mnist") -> dict:
    from search.results.location import default_cache_dir
    from trainers.data import DatasetRequest, make_loader, prepare_dataset
    from trainers.train import train_trial

    data = prepare_dataset(DatasetRequest(name=dataset, train_fraction=train_fraction),
                           cache_dir=default_cache_dir())
    on_cuda = device == "cuda"

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory(prefix="ls-bench-tput-") as cache, _labelled_batches():
        cfg = config(data, epochs=epochs, cache_dir=cache, model=model, device=device, batch_size=batch_size,
                     num_workers=num_workers, compile=compile, cuda_graph=cuda_graph)

        def run() -> tuple[float, list[dict[str, Any]]]:
            reports: list[dict[str, Any]] = []
            sync()
            start = time.perf_counter()
            train_trial(cfg, on_epoch=lambda metrics, get_state: reports.append(metrics))
            sync()
            return time.perf_counter() - start, reports

        warm = [run()[0] for _ in range(2)]
        wall, reports = run()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as prof:
            profiled_wall, profiled_reports = run()
        events = prof.key_averages()
        if trace:
            raw = trace.removesuffix(".gz")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as f, gzip.open(trace, "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
            os.remove(raw)

        loader = make_loader(data.train_path, batch_size=cfg.train.batch_size, train=True, seed=0, flip=data.flip,
                             pad_crop=cfg.train.pad_crop, mean=data.mean, std=data.std, device=torch.device(device),
                             num_workers=cfg.train.loader_threads)
        loader_alone = []
        for _ in range(3):
            sync()
            start, images = time.perf_counter(), 0
            for x, _labels in loader:
                images += x.shape[0]
            sync()
            loader_alone.append(images / (time.perf_counter() - start))

    steps = epochs * (data.counts["train"] // cfg.train.batch_size)  # the loader drops the last partial batch
    train_s = sum(r["train_time_s"] for r in reports)
    device_key = "self_device_time_total"
    result = {
        "config": {"model": cfg.model, "train_images": data.counts["train"], "epochs": epochs,
                   "batch_size": cfg.train.batch_size, "loader_threads": cfg.train.loader_threads,
                   "device": device, "precision": cfg.train.precision, "compile_mode": cfg.train.compile_mode,
                   "cuda_graph": cfg.train.cuda_graph},
        "warmup_trials_s": warm,
        "trial_s": wall,
        "epochs": [{k: r[k] for k in ("train_time_s", "train_loader_wait_s", "epoch_time_s", "train_images_per_s")}
                   for r in reports],
        "host_ms_per_training_step": 1e3 * train_s / steps,
        "training_steps": steps,
        "profiled_trial_s": profiled_wall,
        "profiled_epochs": [{k: r[k] for k in ("train_time_s", "train_loader_wait_s", "epoch_time_s")}
                            for r in profiled_reports],
        "profiled_host_self_s": sum(e.self_cpu_time_total for e in events) / 1e6,
        "top_host": _top(events, "self_cpu_time_total", 25),
        "next_batch": next(iter(_top([e for e in events if e.key == "ls::next_batch"], "count", 1)), None),
        "loader_alone_images_per_s": loader_alone,
    }
    if on_cuda:
        result["profiled_gpu_busy_s"] = sum(getattr(e, device_key, 0.0) for e in events) / 1e6  # kernels' time
        result["top_gpu"] = _top(events, device_key, 15)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="ls_convit_micro")
    parser.add_argument("--train-fraction", type=float, default=1.0, help="of Fashion-MNIST's 60,000 training images")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, help="FFCV's loader threads (default: auto)")
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=COMPILE_MODES, metavar="MODE",
                        help="train.compile: true, or MODE")
    parser.add_argument("--cuda-graph", action="store_true", help="train.cuda_graph: true")
    parser.add_argument("--trace", action="store_true", help="also write the profiled trial's Chrome trace (.json.gz)")
    parser.add_argument("--result-name", default="trial_profile")
    args = parse_and_set_up(parser, argv)
    trace = str(RESULTS_DIR / f"{args.result_name}-trace.json.gz") if args.trace else None
    r = trial_profile(device=args.device, model=args.model, train_fraction=args.train_fraction, epochs=args.epochs,
                      batch_size=args.batch_size, num_workers=args.num_workers, compile=args.compile,
                      cuda_graph=args.cuda_graph, trace=trace)
    c = r["config"]
    print(f"trial: {c['model']}, {c['train_images']} train images, {c['epochs']} epochs, batch {c['batch_size']}, "
          f"{c['loader_threads']} loader threads, compile {c['compile_mode']}, cuda_graph {c['cuda_graph']}")
    print(f"  warm-up trials {', '.join(f'{s:.2f}' for s in r['warmup_trials_s'])} s; "
          f"the unprofiled trial {r['trial_s']:.2f} s")
    for i, e in enumerate(r["epochs"], 1):
        print(f"  epoch {i}: training {e['train_time_s']:.3f} s (waiting for the loader {e['train_loader_wait_s']:.3f} s), "
              f"validating {e['epoch_time_s'] - e['train_time_s']:.3f} s; {e['train_images_per_s']:,.0f} img/s")
    print(f"  host time per training step: {r['host_ms_per_training_step']:.2f} ms")
    steps = r["training_steps"]
    gpu = f", GPU busy {r['profiled_gpu_busy_s']:.2f} s" if "profiled_gpu_busy_s" in r else ""
    print(f"profiled trial: {r['profiled_trial_s']:.2f} s wall, host operators' self time {r['profiled_host_self_s']:.2f} s{gpu}")
    _print_top("top operators by host time", r["top_host"], steps)
    if r["next_batch"] is not None:
        _print_top("the loader's hand-out", [r["next_batch"]], steps)
    if "top_gpu" in r:
        _print_top("top operators by GPU time", r["top_gpu"], steps)
    print("training loader alone: " + ", ".join(f"{v:,.0f}" for v in r["loader_alone_images_per_s"]) + " img/s")
    path = write_result(args.result_name, r, device=args.device)
    print(f"-> {path}" + (f"\n-> {trace}" if trace else ""))


if __name__ == "__main__":
    main()

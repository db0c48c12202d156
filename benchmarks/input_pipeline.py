"""Input pipeline: our FFCV loader vs torch DataLoader (same split, same augmentations), and loader start-up per trial.

    python -m benchmarks.input_pipeline                  # Fashion-MNIST, 10% of the training split
    python -m benchmarks.input_pipeline --epochs 5 --batch 128 --workers 2

Throughput (images/s delivered as normalised float32 (B, C, H, W) batches, no model), the three
timed alternately epoch by epoch after one warm-up epoch each, the median epoch of each:

  ffcv            trainers.data.make_loader(train=True): FFCV decodes in numba threads, then a seeded
                  random pad-and-crop (2 px), horizontal flip and normalisation run on the whole
                  batch (what every trial uses)
  dataloader      torch.utils.data.DataLoader over the same images (uint8, in memory) with
                  torchvision's per-image transforms RandomCrop(28, padding=2), RandomHorizontalFlip,
                  ToDtype(float32, scale=True), Normalize: the usual PyTorch recipe; shuffled,
                  drop_last, the same batch size and the same number of workers (processes),
                  persistent_workers=True
  dataloader_batched  the same DataLoader handing out whole batches (a BatchSampler as its
                  sampler) with our batched augmentation applied in the main process: how much of
                  the gap is the per-image Python transforms rather than the reader

Start-up (each in a fresh Python process, so nothing is compiled or cached beforehand): seconds
from nothing to the first batch of a trial's two loaders (train + validation), for the first trial
in a process and for a later one (the per-process loader cache that reused Ray actors keep), and,
for scale, FFCV's own numba augmentations (RandomHorizontalFlip, RandomTranslate, ToTensor,
ToTorchImage, Convert) built the usual way, a fresh Loader per trial. Targets: ffcv >= 3x dataloader; start-up after
the first trial < 3 s. Writes benchmarks/results/input_pipeline-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

import torch

from benchmarks._env import add_malloc_option, parse_and_set_up, project_pythonpath, write_result
from trainers import PROJECT_ROOT


def _prepared(train_fraction: float):
    from search.results.location import default_cache_dir
    from trainers.data import DatasetRequest, prepare_dataset

    return prepare_dataset(DatasetRequest(name="fashion_mnist", train_fraction=train_fraction), cache_dir=default_cache_dir())


def _raw_images(data) -> tuple[torch.Tensor, torch.Tensor]:
    """The training split as uint8 (N, C, H, W) and int64 (N,), read back through FFCV without
    augmentation (mean 0, std 1/255 makes the normalisation the identity on 0..255)."""
    from trainers.data import make_loader

    loader = make_loader(data.train_path, batch_size=1024, train=False, mean=(0.0,) * data.channels,
                         std=(1 / 255,) * data.channels, num_workers=1)
    images, labels = [], []
    for x, y in loader:
        images.append(x.round().to(torch.uint8))
        labels.append(y)
    return torch.cat(images), torch.cat(labels)


class _PerImage(torch.utils.data.Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), self.labels[i]


class _WholeBatch(torch.utils.data.Dataset):
    """__getitem__ takes a list of indices (a BatchSampler as the sampler, batch_size=None)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx):
        idx = torch.as_tensor(idx)
        return self.images[idx].permute(0, 2, 3, 1).contiguous(), self.labels[idx]  # uint8 (B, H, W, C)


def throughput(*, data, batch: int, workers: int, epochs: int) -> dict:
    from torchvision.transforms import v2

    from trainers.data import Augment, make_loader

    images, labels = _raw_images(data)
    n = len(labels)
    flip = bool(data.flip)
    ffcv_loader = make_loader(data.train_path, batch_size=batch, train=True, mean=data.mean, std=data.std,
                              num_workers=workers, seed=0, flip=flip, pad_crop=2)
    steps = [
        v2.RandomCrop(data.image_size, padding=2, fill=0),
        *([v2.RandomHorizontalFlip()] if flip else []),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(list(data.mean), list(data.std)),
    ]
    per_image = torch.utils.data.DataLoader(
        _PerImage(images, labels, v2.Compose(steps)), batch_size=batch, shuffle=True, drop_last=True,
        num_workers=workers, persistent_workers=True)
    augment = Augment(data.mean, data.std, pad=2, flip=flip, channels_last=False)
    generator = torch.Generator().manual_seed(0)
    batched_source = torch.utils.data.DataLoader(
        _WholeBatch(images, labels), batch_size=None, num_workers=workers, persistent_workers=True,
        sampler=torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(n)), batch, drop_last=True))

    def batched():
        for x, y in batched_source:
            yield augment(x, generator), y

    contenders = {"ffcv": lambda: ffcv_loader, "dataloader": lambda: per_image, "dataloader_batched": batched}

    def epoch(name: str) -> tuple[float, int]:
        count = 0
        start = time.perf_counter()
        for x, y in contenders[name]():
            count += x.shape[0]
        elapsed = time.perf_counter() - start
        assert x.dtype == torch.float32 and x.shape[1:] == (data.channels, data.image_size, data.image_size)
        return elapsed, count

    for name in contenders:  # warm-up: JIT compilation, worker start
        epoch(name)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    counts: dict[str, int] = {}
    for _ in range(epochs):
        for name in contenders:
            elapsed, counts[name] = epoch(name)
            times[name].append(elapsed)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    images_per_s = {name: counts[name] / median[name] for name in contenders}
    return {
        "images": n,
        "images_per_epoch": counts,
        "epoch_s": times,
        "median_epoch_s": median,
        "images_per_s": images_per_s,
        "ffcv_over_dataloader": images_per_s["ffcv"] / images_per_s["dataloader"],
        "ffcv_over_dataloader_batched": images_per_s["ffcv"] / images_per_s["dataloader_batched"],
    }


_STARTUP = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    torch.set_num_threads({threads})
    from trainers.data import PreparedDataset
    data = PreparedDataset(**json.loads(sys.argv[1]))
    out = {{}}
    if "{mode}" == "ours":
        from trainers.data import make_loader
        out["import_s"] = time.perf_counter() - t0

        def trial(seed):
            start = time.perf_counter()
            for train in (True, False):
                loader = make_loader(data.train_path if train else data.val_path, batch_size={batch}, train=train,
                                     mean=data.mean, std=data.std, num_workers={workers}, seed=seed, flip=data.flip)
                next(iter(loader))
            return time.perf_counter() - start

        out["first_trial_s"] = trial(0)
        out["later_trial_s"] = [trial(s) for s in (1, 2, 3)]
    else:
        from trainers.data._ffcv import ffcv
        ffcv()
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.ndarray import NDArrayDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import Convert, RandomHorizontalFlip, RandomTranslate, Squeeze, ToTensor, ToTorchImage
        out["import_s"] = time.perf_counter() - t0

        def trial(seed):
            start = time.perf_counter()
            for train in (True, False):
                aug = [RandomHorizontalFlip(), RandomTranslate(padding=2, fill=(0,) * data.channels)] if train else []
                # (FFCV's NormalizeImage handles 3 channels only: left out, which only flatters FFCV)
                loader = Loader(data.train_path if train else data.val_path, batch_size={batch}, num_workers={workers},
                                order=OrderOption.RANDOM if train else OrderOption.SEQUENTIAL, seed=seed, drop_last=train,
                                pipelines={{"image": [NDArrayDecoder(), *aug, ToTensor(), ToTorchImage(), Convert(torch.float32)],
                                           "label": [IntDecoder(), ToTensor(), Squeeze()]}})
                next(iter(loader))
            return time.perf_counter() - start

        out["first_trial_s"] = trial(0)
        out["later_trial_s"] = [trial(s) for s in (1, 2, 3)]
    print("RESULT " + json.dumps(out))
""")


def startup(*, data, batch: int, workers: int, mode: str) -> dict:
    """Loader start-up in a fresh interpreter: ours (cached per process) or stock FFCV."""
    import dataclasses

    code = _STARTUP.format(mode=mode, batch=batch, workers=workers, threads=torch.get_num_threads())
    env = {**os.environ, "PYTHONPATH": project_pythonpath()}
    payload = json.dumps(dataclasses.asdict(data))
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", code, payload], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:  # e.g. FFCV's thread died and its consumer waits forever
        return {"error": "no first batch within 300 s"}
    wall = time.perf_counter() - start
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:  # (a stock FFCV process may abort at exit, after its RESULT line: that is fine)
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return {**json.loads(line[len("RESULT "):]), "process_wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-fraction", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=128, help="the trainer's default batch size")
    parser.add_argument("--workers", type=int, default=2, help="FFCV threads / DataLoader worker processes")
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs per contender")
    parser.add_argument("--skip-startup", action="store_true")
    add_malloc_option(parser)
    args = parse_and_set_up(parser, argv)

    data = _prepared(args.train_fraction)
    result: dict = {"config": dict(dataset=data.name, train_fraction=args.train_fraction, batch=args.batch,
                                   workers=args.workers, epochs=args.epochs, image=[data.channels, data.image_size, data.image_size],
                                   train_images=data.counts["train"])}
    if not args.skip_startup:
        result["startup"] = {mode: startup(data=data, batch=args.batch, workers=args.workers, mode=mode)
                             for mode in ("ours", "stock_ffcv")}
    result["throughput"] = throughput(data=data, batch=args.batch, workers=args.workers, epochs=args.epochs)
    t = result["throughput"]
    print(f"Fashion-MNIST train split ({t['images']} images), batch {args.batch}, {args.workers} workers, "
          f"median of {args.epochs} epochs")
    for name, ips in t["images_per_s"].items():
        print(f"  {name:<20} {ips:10,.0f} img/s   ({t['median_epoch_s'][name]:.3f} s/epoch)")
    print(f"  ffcv / dataloader: {t['ffcv_over_dataloader']:.2f}x (target 3x: "
          f"{'met' if t['ffcv_over_dataloader'] >= 3 else 'NOT met'});  ffcv / dataloader_batched: "
          f"{t['ffcv_over_dataloader_batched']:.2f}x")
    if "startup" in result:
        for mode, s in result["startup"].items():
            if "error" in s:
                print(f"  start-up {mode}: failed ({s['error']})")
                continue
            later = statistics.median(s["later_trial_s"])
            print(f"  start-up {mode:<10}: imports {s['import_s']:.2f} s; a trial's two loaders to their first batch: "
                  f"first trial {s['first_trial_s']:.2f} s, later trials {later:.3f} s (median of {len(s['later_trial_s'])})")
        ours = result["startup"]["ours"]
        if "error" not in ours:
            later = statistics.median(ours["later_trial_s"])
            result["startup_later_trial_under_3s"] = later < 3.0
            print(f"  later-trial start-up < 3 s: {'met' if later < 3.0 else 'NOT met'}")
    path = write_result("input_pipeline", result)
    print(f"-> {path}")


if __name__ == "__main__":
    main()

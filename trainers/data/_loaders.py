"""FFCV loaders for prepared ``.beton`` files, cached per process.

FFCV pipelines, run by FFCV's background thread (``B`` = batch; images are stored as an
``NDArrayField`` uint8 ``(H, W, C)``, labels as an ``IntField``)::

    image: NDArrayDecoder (numba JIT) -> uint8 (B, H, W, C) numpy -> ToTensor -> ToDevice(device)
    label: IntDecoder (numba JIT)     -> int64 (B, 1)       numpy -> ToTensor -> ToDevice(device) -> Squeeze
                                                                      (ToDevice is skipped on CPU)

then, as the batch is handed out (in the consuming thread, on the current CUDA stream)::

    images uint8 (B, H, W, C) -> [train: random pad-and-crop (zero padding, up to ``pad_crop``
    px each way), random horizontal flip] -> (x / 255 - mean) / std -> float32 (B, C, H, W),
    NCHW-contiguous or channels_last; labels -> int64 (B,)

Both are fresh tensors (copies out of FFCV's rotating buffers), safe to keep.

Why augmentation is not FFCV's numba ``RandomTranslate``/``RandomHorizontalFlip``: they draw
from numba's per-thread generators, which nothing seeds, so crops and flips could not be
reproduced; their JIT compilation is most of FFCV's start-up (benchmarks/input_pipeline.py
times it); and torch ops run in FFCV's thread would start a second torch thread pool next to the
model's, which on a loaded machine slows epochs severalfold. Here the few small ops run on the target
device in the consumer, from a ``torch.Generator`` seeded per epoch. FFCV's ``ToTorchImage`` and
``NormalizeImage`` are not used either: in 1.0.2 ``ToTorchImage(channels_last=False)`` after
``ToDevice`` allocates its output on the CPU, and ``NormalizeImage`` needs cupy on a GPU.

What ``seed`` controls (train loaders): the order of epoch ``e`` is FFCV's RANDOM order, a
permutation drawn with ``numpy.random.default_rng(seed + e)``, and that epoch's crops and flips
come from a generator seeded with ``augment_seed(seed, e)``. ``e`` counts the loader's epochs
from 0 after every ``make_loader`` call, so each epoch differs, and a trial with a given seed
sees the same batches whether its loader was just built or taken from the cache. To resume at
epoch ``e``, set ``loader.next_epoch = e`` before iterating. Eval loaders read in file order
with no randomness.

Cache: building a Loader is cheap but its first batch JIT-compiles the decoders.
``make_loader`` keeps one Loader per (file, batch size, train, normalisation, device, workers,
augmentation, drop_last, layout) in a module-level dict, so a process that runs several trials
(Ray reuses actors) compiles once per distinct loader. A cached loader is reset (epoch counter
to 0, new seed) each time it is handed out; two results of ``make_loader`` with equal
arguments are the same object, so do not iterate them at the same time. Starting an epoch
stops the loader's previous one (an epoch left early, by an exception, would otherwise keep
FFCV's thread alive).
"""

from __future__ import annotations

import os
import threading
from queue import Full
from typing import Sequence

import numpy as np
import torch

from trainers.errors import ConfigError

from ._ffcv import ffcv
from ._prepare import IMAGE_FIELD, LABEL_FIELD

__all__ = ["make_loader", "clear_loader_cache", "augment_seed", "Augment"]

ffcv()  # imported and patched before the names below are taken from it
from ffcv.fields.basics import IntDecoder  # noqa: E402
from ffcv.fields.ndarray import NDArrayDecoder  # noqa: E402
from ffcv.loader import Loader, OrderOption  # noqa: E402
from ffcv.loader.epoch_iterator import IS_CUDA, EpochIterator  # noqa: E402
from ffcv.pipeline.compiler import Compiler  # noqa: E402
from ffcv.transforms import Squeeze, ToDevice, ToTensor  # noqa: E402


_THREAD_FAILED = object()  # put on FFCV's output queue when its thread raised


def augment_seed(seed: int, epoch: int) -> int:
    """The torch seed of epoch ``epoch``'s crops and flips for a loader seeded with ``seed``."""
    state = np.random.SeedSequence([int(seed), int(epoch), 0x10CA1]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


class Augment:
    """uint8 (B, H, W, C) -> float32 (B, C, H, W): optional pad-crop and flip, then normalise: what a
    loader does to each batch as it hands it out (``augment(images, generator)``).

    Random draws per batch, in this order: ``dy``, ``dx`` (ints in [0, 2 * pad]) and, when
    flipping, ``rand(B) < 0.5``.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], *, pad: int, flip: bool, channels_last: bool) -> None:
        self.mean = np.asarray(mean, dtype=np.float64)
        self.std = np.asarray(std, dtype=np.float64)
        self.pad, self.flip = int(pad), bool(flip)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def random(self) -> bool:
        return bool(self.pad or self.flip)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._consts:
            shift = torch.tensor(self.mean * 255.0, dtype=torch.float32).view(1, -1, 1, 1)
            scale = torch.tensor(1.0 / (self.std * 255.0), dtype=torch.float32).view(1, -1, 1, 1)
            self._consts[device] = (shift.to(device), scale.to(device))
        return self._consts[device]

    def __call__(self, images: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        b, h, w, c = images.shape
        device = images.device
        x = images  # (B, H, W, C) uint8
        if self.random:
            assert gen is not None
            pad = self.pad
            rows = torch.arange(h, device=device).expand(b, h)
            cols = torch.arange(w, device=device).expand(b, w)
            if pad:
                x = torch.nn.functional.pad(x, (0, 0, pad, pad, pad, pad))  # zeros: a black border
                rows = rows + torch.randint(0, 2 * pad + 1, (b, 1), generator=gen, device=device)
                cols = cols + torch.randint(0, 2 * pad + 1, (b, 1), generator=gen, device=device)
            if self.flip:
                flipped = torch.rand(b, 1, generator=gen, device=device) < 0.5
                cols = torch.where(flipped, cols.flip(1), cols)
            batch = torch.arange(b, device=device).view(b, 1, 1)
            x = x[batch, rows[:, :, None], cols[:, None, :]]  # (B, H + 2p, W + 2p, C) -> (B, H, W, C)
        x = x.permute(0, 3, 1, 2)  # (B, C, H, W) view
        out = torch.empty((b, c, h, w), dtype=torch.float32, device=device, memory_format=self.memory_format)
        shift, scale = self._constants(device)
        torch.sub(x, shift, out=out)
        return out.mul_(scale)


class _SeededEpochIterator(EpochIterator):
    """FFCV's epoch iterator (a thread) whose batches are augmented and normalised on hand-out."""

    def __init__(self, loader: "_Loader", order: Sequence[int], aug_seed: int) -> None:
        self.augment = loader.augment
        self.aug_seed = aug_seed
        self.generator: torch.Generator | None = None
        # FFCV allocates this epoch's GPU buffers from the current stream's pool, which hands out at
        # once a block the host freed while kernels queued on it have yet to run (validation starts
        # behind the last training step's backward). FFCV's own events make every later copy wait
        # for the consumer's stream, but not the first batch's: without this wait, that batch was
        # overwritten by the queued kernels (labels of -1: CUDA's label-range assert).
        self.started: torch.cuda.Event | None = None
        if IS_CUDA:
            self.started = torch.cuda.Event()
            self.started.record(torch.cuda.current_stream())
        super().__init__(loader, order)  # allocates the buffers, starts the thread

    def run(self) -> None:
        # FFCV's thread dies silently on an error and the consumer then waits forever on the
        # queue; hand the error over instead, so the trial fails with it.
        try:
            super().run()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the consumer)
            self.error = exc
            while not self.terminate_event.is_set():
                try:
                    self.output_queue.put(_THREAD_FAILED, timeout=0.5)
                    return
                except Full:
                    pass

    def run_pipeline(self, b_ix, batch_indices, batch_slot, cuda_event):
        # FFCV 1.0.2 decodes a batch into its slot's pinned host buffer, then copies it to the GPU
        # on the slot's stream without blocking, but never waits for the slot's previous copy
        # before decoding over that copy's source. When the GPU runs behind the host (a GPU-bound
        # step: a CUDA-graphed one left the host 10+ batches ahead) that copy would carry a newer
        # batch. Wait for it: this blocks only FFCV's thread, and only while it is that far ahead.
        if IS_CUDA:
            self.cuda_streams[batch_slot].synchronize()
            if cuda_event is None:  # the epoch's first batch (FFCV waits for nothing)
                cuda_event = self.started
        return super().run_pipeline(b_ix, batch_indices, batch_slot, cuda_event)

    def _next_batch(self):
        """FFCV 1.0.2's ``EpochIterator.__next__``, plus the error hand-over."""
        item = self.output_queue.get()
        if item is _THREAD_FAILED:
            self.close()
            raise RuntimeError(f"FFCV loader thread failed: {self.error!r}") from self.error
        if item is None:
            self.close()
            raise StopIteration()
        slot, result = item
        if IS_CUDA:
            self.current_stream.wait_stream(self.cuda_streams[slot])
        return result

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self._next_batch()  # FFCV's buffers: uint8 (B, H, W, C), int64 (B,)
        if self.augment.random and self.generator is None:
            self.generator = torch.Generator(device=images.device)
            self.generator.manual_seed(self.aug_seed)
        return self.augment(images, self.generator), labels.clone()


class _Loader(Loader):
    """``ffcv.loader.Loader`` with seeded augmentation and one live epoch at a time."""

    augment: Augment
    _last: EpochIterator | None = None

    def _stop_last(self) -> None:
        if self._last is not None:
            self._last.close()
            self._last = None

    def reset(self, *, seed: int) -> None:
        self._stop_last()
        self.seed = seed
        self._args["seed"] = seed
        self.traversal_order.seed = seed
        self.next_epoch = 0

    def __iter__(self) -> EpochIterator:  # FFCV 1.0.2's __iter__, plus the seed and the stop
        Compiler.set_num_threads(self.num_workers)
        epoch = self.next_epoch
        order = self.next_traversal_order()
        selected_order = order[: len(self) * self.batch_size]
        self.next_epoch += 1
        if self.code is None or self.recompile:
            self.generate_code()
        self._stop_last()
        # The iterator allocates the pipeline's buffers, which its thread fills in place (ToDevice's
        # copy_): they must be normal tensors even when the epoch starts under inference_mode.
        with torch.inference_mode(False):
            self._last = _SeededEpochIterator(self, selected_order, augment_seed(self.seed, epoch))
        return self._last


_CACHE: dict[tuple, _Loader] = {}
_CACHE_LOCK = threading.Lock()


def clear_loader_cache() -> None:
    """Forget every cached loader (the next ``make_loader`` compiles again)."""
    with _CACHE_LOCK:
        for loader in _CACHE.values():
            loader._stop_last()
        _CACHE.clear()


def _build(path: str, *, batch_size: int, train: bool, augment: Augment, device: torch.device,
           num_workers: int, seed: int, drop_last: bool) -> _Loader:
    to_device = [] if device.type == "cpu" else [ToDevice(device, non_blocking=True)]
    loader = _Loader(
        path,
        batch_size=batch_size,
        num_workers=num_workers,
        order=OrderOption.RANDOM if train else OrderOption.SEQUENTIAL,
        seed=seed,
        drop_last=drop_last,
        pipelines={
            IMAGE_FIELD: [NDArrayDecoder(), ToTensor(), *to_device],
            LABEL_FIELD: [IntDecoder(), ToTensor(), *to_device, Squeeze(1)],
        },
        batches_ahead=3,
    )
    loader.augment = augment
    return loader


def make_loader(
    path: str,
    *,
    batch_size: int,
    train: bool,
    mean: Sequence[float],
    std: Sequence[float],
    device: str | torch.device = "cpu",
    num_workers: int = 2,
    seed: int = 0,
    drop_last: bool | None = None,
    flip: bool = True,
    pad_crop: int = 2,
    channels_last: bool = False,
) -> Loader:
    """An ``ffcv.loader.Loader`` yielding ``(images float32 (B, C, H, W) normalised, labels int64 (B,))``.

    ``train=True``: random order (seeded, new each epoch), random pad-and-crop by up to
    ``pad_crop`` pixels and, if ``flip``, random horizontal flips; ``drop_last`` defaults to True.
    ``train=False``: file order, no augmentation (``flip``/``pad_crop`` ignored), ``drop_last``
    defaults to False (every image once). ``mean``/``std`` are per channel in [0, 1] pixel units.
    ``num_workers`` is the number of numba threads decoding batches. See the module docstring for
    the seed and the cache.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ConfigError(f"num_workers must be a positive integer, got {num_workers!r}")
    if not isinstance(pad_crop, int) or pad_crop < 0:
        raise ConfigError(f"pad_crop must be a non-negative integer, got {pad_crop!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    mean = tuple(float(m) for m in mean)
    std = tuple(float(s) for s in std)
    if len(mean) != len(std) or not mean or min(std) <= 0:
        raise ConfigError(f"mean {mean} and std {std} must be per-channel values of equal length, std > 0")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found; prepare the dataset again (delete its cache folder if it is incomplete)") from None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    drop_last = train if drop_last is None else bool(drop_last)
    flip = bool(flip) and train
    pad_crop = pad_crop if train else 0
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, batch_size, train, mean, std,
           str(device), num_workers, drop_last, flip, pad_crop, bool(channels_last))
    with _CACHE_LOCK:
        loader = _CACHE.get(key)
        if loader is None:
            augment = Augment(mean, std, pad=pad_crop, flip=flip, channels_last=bool(channels_last))
            loader = _build(str(path), batch_size=batch_size, train=train, augment=augment, device=device,
                            num_workers=num_workers, seed=seed, drop_last=drop_last)
            channels = loader.reader.handlers[IMAGE_FIELD].shape[-1]
            if channels != len(mean):
                raise ConfigError(f"{path}: images have {channels} channel(s) but mean/std give {len(mean)}")
            _CACHE[key] = loader
        loader.reset(seed=seed)
    if drop_last and len(loader) == 0:
        raise ConfigError(
            f"{path}: {len(loader.indices)} images, fewer than batch_size {batch_size}, so an epoch would have "
            "no batch; lower batch_size or raise the dataset's train_fraction"
        )
    return loader

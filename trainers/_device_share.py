"""Trials that share a device, and a throughput measurement that must have it to itself.

Several trials can share one device: fractional GPUs (``resources.gpus: 0.25``) put four on
one GPU, and trials on one machine share its CPU. A throughput measurement taken while another
trial trains on the same device measures the contention, not the model. So:

- a trial holds a *shared* lock on the device while it trains and evaluates an epoch;
- a measurement takes it *exclusively*: it waits until the trials on the device step aside,
  and they wait until it is done.

Writers first: a measurement first takes a second file, the *gate*, exclusively. Training
checks the gate once a step (a non-blocking shared lock, a microsecond); when a measurement
holds it, the trial releases its shared lock and waits at the gate. Without the gate, trials
overlapping their epochs would keep the shared lock held forever and the measurement would
starve.

The locks are ``flock`` files in a folder local to the machine (``LOCALITY_SEARCH_LOCKS``, by
default under the system temp folder), never in a shared cache: a lock means "this physical
device", so the file is named by the device (a GPU's UUID; ``cpu``), and Ray nodes started on
one machine (which share its CPU) share the CPU's lock.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["DeviceShare", "device_share", "device_key", "lock_dir"]


def lock_dir() -> Path:
    """The machine-local folder of the lock files."""
    return Path(os.environ.get("LOCALITY_SEARCH_LOCKS") or Path(tempfile.gettempdir()) / f"locality-search-{os.getuid()}-locks")


def device_key(device: torch.device) -> str:
    """A name for the physical device: the same for every process that uses it."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # CUDA_VISIBLE_DEVICES renumbers GPUs per process (Ray sets it per trial): the UUID does not.
        return f"cuda-{torch.cuda.get_device_properties(index).uuid}"
    return device.type


class DeviceShare:
    """The shared/exclusive lock of one device, for this process (see the module doc)."""

    def __init__(self, device: torch.device, directory: Path) -> None:
        key = device_key(device)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", key)
        directory.mkdir(parents=True, exist_ok=True)
        self.device, self.key = device, key
        self._device = open(directory / f"{safe}.lock", "a")  # noqa: SIM115 -- held for the process
        self._gate = open(directory / f"{safe}.gate", "a")  # noqa: SIM115
        self._sharing = 0  # nesting depth of training(): > 0 while this process holds the shared lock

    def close(self) -> None:
        """Close the lock files (releasing any lock this process holds on them)."""
        self._device.close()
        self._gate.close()

    # -- training ---------------------------------------------------------------------------
    def _acquire_shared(self) -> None:
        fcntl.flock(self._gate, fcntl.LOCK_SH)  # waits while a measurement holds the gate
        fcntl.flock(self._gate, fcntl.LOCK_UN)
        fcntl.flock(self._device, fcntl.LOCK_SH)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Hold the device (shared with other trials) for a stretch of training or evaluation."""
        if self._sharing == 0:
            self._acquire_shared()
        self._sharing += 1
        try:
            yield
        finally:
            self._sharing -= 1
            if self._sharing == 0:
                fcntl.flock(self._device, fcntl.LOCK_UN)

    def step(self) -> None:
        """Once a training step: step aside while a measurement waits for or has the device."""
        if self._sharing == 0:
            return
        try:
            fcntl.flock(self._gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # our queued kernels must not run into the measurement
            fcntl.flock(self._device, fcntl.LOCK_UN)
            self._acquire_shared()
        else:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    # -- measuring --------------------------------------------------------------------------
    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Have the device to itself: no other measurement, no trial training on it."""
        if self._sharing:  # our own shared lock would block us (e.g. T-CNN's mid-training measurement)
            fcntl.flock(self._device, fcntl.LOCK_UN)
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._device, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._device, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
            if self._sharing:
                self._acquire_shared()


_shares: dict[tuple[str, str], DeviceShare] = {}


@atexit.register
def _close_shares() -> None:  # at exit, not by the GC: an unclosed file warns (ResourceWarning)
    while _shares:
        _shares.popitem()[1].close()


def device_share(device: torch.device) -> DeviceShare:
    """This process's :class:`DeviceShare` of ``device`` (one per device and lock folder)."""
    key, directory = device_key(device), lock_dir()
    share = _shares.get((key, str(directory)))
    if share is None:
        share = _shares[(key, str(directory))] = DeviceShare(device, directory)
    return share

"""What a study needs before its first trial: the dataset converted, the CPU kernels built, Ray up.

All three before Tune starts, so that a missing dataset or an unreachable cluster stops the run
with one line, and no trial waits for a compiler. The kernels build in a thread meanwhile (a
first run's compiler and Ray's start-up overlap).
"""

from __future__ import annotations

import contextlib
import os
from typing import TextIO

from search.results.location import default_cache_dir
from search.spec import SearchSpec
from search.study.cluster import init_ray
from trainers.data import DatasetRequest, PreparedDataset, prepare_dataset

__all__ = ["prepare_study", "dataset_request", "seed_datasets"]


def prepare_study(spec: SearchSpec, *, address: str | None, dashboard_host: str,
                  cache_dir: str | os.PathLike | None, out: TextIO) -> PreparedDataset:
    """The spec's dataset converted and Ray started (`search.study.cluster.init_ray`), with the CPU
    kernels built meanwhile; the dataset as prepared."""
    with _cpu_kernels_built_meanwhile():
        data = _prepare_data(spec, cache_dir, out)
        init_ray(address, dashboard_host, out)
    return data


def dataset_request(spec: SearchSpec, seed: int | None = None) -> DatasetRequest:
    """The spec's dataset as ``prepare_dataset`` takes it (here, and in each trial on its node),
    its split drawn by ``seed`` (default: the study's, ``algorithm.seed``)."""
    return DatasetRequest(
        name=spec.dataset.name,
        data_dir=spec.dataset.data_dir,
        train_fraction=spec.dataset.train_fraction,
        val_fraction=spec.dataset.val_fraction,
        image_size=spec.dataset.image_size,
        seed=spec.algorithm.seed if seed is None else seed,
    )


def seed_datasets(spec: SearchSpec, cache_dir: str | os.PathLike | None) -> dict[int, PreparedDataset] | None:
    """With ``dataset.split_seed: trial``, the dataset as each training seed of the run draws it
    ({seed: prepared}); None where the study's seed draws one split for every trial."""
    if not spec.dataset.split_per_trial:
        return None
    cache = cache_dir or default_cache_dir()
    return {seed: prepare_dataset(dataset_request(spec, seed), cache_dir=cache) for seed in spec.trial_seeds}


def _prepare_data(spec: SearchSpec, cache_dir: str | os.PathLike | None, out: TextIO) -> PreparedDataset:
    # Converted here first: a missing or damaged dataset stops the run before Ray starts. Trials
    # prepare it again on their own node, which on this one finds these files (see search.study.trainable).
    data = prepare_dataset(dataset_request(spec), cache_dir=cache_dir or default_cache_dir())
    per_seed = seed_datasets(spec, cache_dir)
    drawn = (f", a split drawn by each trial's seed ({len(per_seed)} seeds)" if per_seed else "")
    print(
        f"dataset {data.name}: {data.counts['train']} train / {data.counts['val']} val images "
        f"({data.image_size}x{data.image_size}x{data.channels}, {data.num_classes} classes){drawn}",
        file=out, flush=True,
    )
    return data


def _prepare_cpu_kernel() -> None:
    """Trials on a CPU run the attention core's fused kernels: float32 everywhere, bf16 on a CPU with
    bf16 hardware; built here (once per machine and source; a build is slow) before any trial waits
    for them; where one cannot be built, one warning says why and trials run the core on torch ops."""
    import torch

    from trainers import prebuild_cpu_kernels

    if torch.cuda.is_available():
        return  # trials train on the GPU
    prebuild_cpu_kernels()


@contextlib.contextmanager
def _cpu_kernels_built_meanwhile():
    """`_prepare_cpu_kernel` in a thread while the body runs (the dataset's conversion, Ray's
    start: a first run's compiler and Ray's start-up overlap), joined before the body's result is
    used, so no trial starts before the kernels are there. Joined on errors too: a build killed
    halfway would leave its lock behind."""
    import threading

    failure: list[BaseException] = []

    def build() -> None:
        try:
            _prepare_cpu_kernel()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            failure.append(exc)

    thread = threading.Thread(target=build, name="cpu-kernels", daemon=False)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if failure:
        raise failure[0]

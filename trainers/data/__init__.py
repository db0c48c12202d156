"""Datasets for trials: a YAML catalog, raw readers, FFCV ``.beton`` conversion, FFCV loaders.

    request = DatasetRequest("fashion_mnist", train_fraction=0.1)
    data = prepare_dataset(request, cache_dir="~/.cache/locality-search/data")   # once per content
    train = make_loader(data.train_path, batch_size=128, train=True, mean=data.mean, std=data.std,
                        device="cuda", seed=0, flip=data.flip)
    for images, labels in train: ...        # float32 (B, C, H, W) normalised, int64 (B,)

``make_loader`` (and FFCV, numba) is imported on first use, so importing this package for
``DatasetRequest``/``PreparedDataset`` stays cheap. ``Augment`` is what a loader does to each batch
as it hands it out (pad-crop, flip, normalisation), for use on batches from elsewhere.
"""

from __future__ import annotations

from typing import Any

from ._prepare import (CATALOG_DIR, CATALOG_ENV, DatasetRequest, PreparedDataset, catalog_dirs, list_datasets,
                       load_catalog, prepare_dataset)

__all__ = ["DatasetRequest", "PreparedDataset", "list_datasets", "load_catalog", "prepare_dataset", "make_loader",
           "Augment", "CATALOG_DIR", "CATALOG_ENV", "catalog_dirs"]


def __getattr__(name: str) -> Any:
    if name in ("make_loader", "Augment"):
        from . import _loaders

        return getattr(_loaders, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

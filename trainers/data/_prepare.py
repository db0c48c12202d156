"""Dataset catalog and conversion to FFCV ``.beton`` files, cached by content hash.

    datasets/<name>.yaml --load_catalog--> catalog dict (validated by a pydantic model per format)
    raw files (or generated arrays) + request --sha256--> content hash
    <cache_dir>/<name>-<hash16>/{train,val,test}.beton + meta.json    (converted once)

Splits: the dataset's training split is divided, per class and with a permutation fixed by
``request.seed``, into a validation part (``val_fraction`` of the class, rounded half up, at
least one image when the class has two) and the rest, of which the first
``round(train_fraction * n)`` (at least one) are kept for training. Validation does not depend on
``train_fraction``, and a smaller fraction keeps a subset of what a larger one keeps. The
dataset's own test split is kept whole.

Concurrency: conversion runs under an exclusive ``fcntl.flock`` on
``<cache_dir>/.<name>-<hash16>.lock``, writes into a temporary directory next to the final one
and renames it into place, so several processes preparing the same data convert it once, and a
reader sees either nothing or the finished directory (``meta.json`` is written last).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import model_validator

from trainers._atomic import folder_problem
from trainers.errors import ConfigError

from . import _readers
from ._readers import RawData

__all__ = [
    "DatasetRequest",
    "PreparedDataset",
    "list_datasets",
    "load_catalog",
    "prepare_dataset",
    "split_indices",
    "CATALOG_DIR",
    "CATALOG_ENV",
    "catalog_dirs",
    "FORMAT_VERSION",
    "IMAGE_FIELD",
    "LABEL_FIELD",
]

log = logging.getLogger(__name__)

# The shipped catalog: the checkout's datasets/ (trainers/data/catalog links to it), package data
# once installed. A user's own entries go in the folders of $LOCALITY_SEARCH_CATALOG, searched first.
CATALOG_DIR = Path(__file__).resolve().parent / "catalog"
CATALOG_ENV = "LOCALITY_SEARCH_CATALOG"


def catalog_dirs() -> list[Path]:
    """Where catalog entries are looked for, first match wins: the folders of
    ``$LOCALITY_SEARCH_CATALOG`` (``os.pathsep``-separated), then the shipped catalog."""
    extra = [Path(p).expanduser() for p in os.environ.get(CATALOG_ENV, "").split(os.pathsep) if p.strip()]
    return [*extra, CATALOG_DIR]
FORMAT_VERSION = 1  # bump when the conversion changes what ends up in a .beton
IMAGE_FIELD = "image"  # NDArrayField uint8 (H, W, C)
LABEL_FIELD = "label"  # IntField (int64)
META_FILE = "meta.json"
SPLITS = ("train", "val", "test")


@dataclasses.dataclass(frozen=True)
class DatasetRequest:
    """Which data a search trains on. ``data_dir`` does not enter the content hash; content does."""

    name: str  # catalog name: a file datasets/<name>.yaml
    data_dir: str | None = None  # overrides the catalog's default path
    train_fraction: float = 1.0  # fraction of each class of the training split kept
    val_fraction: float = 0.1  # stratified validation split, carved out before subsampling
    image_size: int | None = None  # stored resized when it differs from the native size; None: native
    seed: int = 0  # picks the validation split and the kept training images


@dataclasses.dataclass(frozen=True)
class PreparedDataset:
    """Three ``.beton`` files and what a trainer needs to know about them."""

    name: str
    train_path: str
    val_path: str
    test_path: str
    num_classes: int
    image_size: int  # H == W
    channels: int  # 1 or 3
    mean: tuple[float, ...]  # per channel, pixels in [0, 1]
    std: tuple[float, ...]
    class_names: tuple[str, ...]
    counts: dict[str, int]  # {"train": n, "val": n, "test": n}
    content_hash: str  # sha256 hex of raw content + request + format version
    flip: bool  # whether horizontal flips are label-preserving


# -- catalog -------------------------------------------------------------------------------------

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

Number = Union[StrictInt, StrictFloat]  # kept as written (1 stays 1): the content hash reads the entry


def _key(kind: str, default: Any = ..., **constraints: Any) -> Any:
    """A catalog key (required unless given a default); ``kind`` is what an error says it must be
    ("channels must be an integer, got 'two'")."""
    return Field(default, description=kind, **constraints)


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Catalog(_Entry):
    """The keys every catalog file has (``datasets/<name>.yaml``); a format adds its own."""

    name: StrictStr = _key("a string")
    description: Optional[StrictStr] = _key("a string or null", None)
    format: StrictStr = _key("a string")
    default_path: Optional[StrictStr] = _key("a string or null")  # required; null: the data has no default place
    num_classes: Optional[StrictInt] = _key("an integer or null", None)
    class_names: Optional[list[StrictStr]] = _key("a list of strings or null", None)
    channels: StrictInt = _key("an integer")
    image_size: StrictInt = _key("an integer")
    mean: Optional[list[Number]] = _key("a list of numbers or null", None)
    std: Optional[list[Number]] = _key("a list of numbers or null", None)
    flip: StrictBool = _key("true or false")
    install_hint: StrictStr = _key("a string")

    @model_validator(mode="after")
    def _consistent(self) -> "_Catalog":
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if self.image_size < 1:
            raise ValueError(f"image_size must be positive, got {self.image_size}")
        for key in ("mean", "std"):
            value = getattr(self, key)
            if value is not None and len(value) != self.channels:
                raise ValueError(f"{key} needs one value per channel ({self.channels}), got {value}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("give both mean and std, or neither (then they are computed from the training split)")
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"std must be positive, got {self.std}")
        if self.num_classes is not None and self.num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {self.num_classes}")
        if self.class_names is not None and self.num_classes is not None and len(self.class_names) != self.num_classes:
            raise ValueError(f"class_names has {len(self.class_names)} names but num_classes is {self.num_classes}; "
                             "make them agree")
        return self


class _IdxFiles(_Entry):
    train_images: StrictStr = _key("a string")
    train_labels: StrictStr = _key("a string")
    test_images: StrictStr = _key("a string")
    test_labels: StrictStr = _key("a string")


class _IdxCatalog(_Catalog):
    files: _IdxFiles = _key("a mapping of file names")


class _Cifar10Files(_Entry):
    train: list[StrictStr] = _key("a non-empty list of strings", min_length=1)
    test: StrictStr = _key("a string")
    meta: StrictStr = _key("a string")


class _Cifar10Catalog(_Catalog):
    files: _Cifar10Files = _key("a mapping of file names")


class _ImagefolderCatalog(_Catalog):
    test_fraction: Number = _key("a number")
    split_seed: StrictInt = _key("an integer")

    @model_validator(mode="after")
    def _fraction(self) -> "_ImagefolderCatalog":
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        return self


class _SyntheticCatalog(_Catalog):
    n_train: StrictInt = _key("an integer")
    n_test: StrictInt = _key("an integer")
    seed: StrictInt = _key("an integer")

    @model_validator(mode="after")
    def _sizes(self) -> "_SyntheticCatalog":
        if self.num_classes is None:
            raise ValueError("synthetic data needs num_classes")
        for key in ("n_train", "n_test"):
            if getattr(self, key) < self.num_classes:
                raise ValueError(f"{key} must be at least num_classes ({self.num_classes}), got {getattr(self, key)}")
        return self


_FORMATS: dict[str, type[_Catalog]] = {"idx": _IdxCatalog, "cifar10_pickle": _Cifar10Catalog,
                                       "imagefolder": _ImagefolderCatalog, "synthetic": _SyntheticCatalog}


def _catalog_path(name: str) -> Path:
    """The first ``<name>.yaml`` of :func:`catalog_dirs` (the shipped one's path where none is there)."""
    for folder in catalog_dirs():
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    return CATALOG_DIR / f"{name}.yaml"


def list_datasets() -> list[str]:
    """The catalog's dataset names (``<catalog>/*.yaml`` of every :func:`catalog_dirs` folder), sorted."""
    names = {p.stem for folder in catalog_dirs() if folder.is_dir() for p in folder.glob("*.yaml")}
    return sorted(n for n in names if _NAME_RE.match(n))


def load_catalog(name: str) -> dict:
    """``datasets/<name>.yaml`` parsed and validated; optional keys are filled with None. A
    ConfigError, one line naming the file and the key, where it is not a valid entry."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or not _catalog_path(name).is_file():
        known = ", ".join(list_datasets()) or "none"
        mine = os.environ.get(CATALOG_ENV) or f"a folder named in ${CATALOG_ENV}"
        raise ConfigError(f"unknown dataset {name!r}; known: {known} (or add {name}.yaml to {mine})")
    path = _catalog_path(name)
    try:
        entry = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)}); fix the syntax") from None
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {type(entry).__name__}; see datasets/fashion_mnist.yaml")
    fmt = entry.get("format")
    if fmt not in _FORMATS:
        raise ConfigError(f"{path}: format must be one of {', '.join(_FORMATS)}, got {fmt!r}")
    model = _FORMATS[fmt]
    try:
        catalog = model.model_validate(entry).model_dump()
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_catalog_problem(model, entry, exc.errors())}") from None
    if catalog["name"] != name:
        raise ConfigError(f"{path}: name is {catalog['name']!r} but the file is {name}.yaml; make them the same")
    return catalog


def _catalog_problem(model: type[BaseModel], entry: dict, errors: list[Any]) -> str:
    """pydantic's first error (every unknown key of a mapping, before anything else) in the
    catalog's words: the key (``files.train`` inside ``files``), what it must be, what it was."""
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    first = unknown[0] if unknown else errors[0]
    if first["type"] == "value_error" and not first["loc"]:  # a rule across keys: its message names them
        return str(first["ctx"]["error"])
    keys: list[str] = []  # the loc's leading keys that name fields, down through nested mappings
    fields, field, value = model.model_fields, None, entry
    for key in first["loc"][:-1] if unknown else first["loc"]:
        if key not in fields:
            break  # a list index, a union member's tag
        keys.append(key)
        field, value = fields[key], value.get(key) if isinstance(value, dict) else None
        fields = getattr(field.annotation, "model_fields", {})
    path = ".".join(keys)
    if unknown:
        names = sorted(".".join([*keys, str(e["loc"][-1])]) for e in unknown if list(e["loc"][:-1]) == keys)
        scope = f" for format {entry['format']}" if not keys else ""
        return f"unknown key(s) {', '.join(names)}{scope}; allowed: {', '.join(fields)}"
    if first["type"] == "missing":
        return f"missing key {path if len(keys) > 1 else repr(path)} ({field.description})"
    return f"{path} must be {field.description}, got {value!r}"


# -- sources and content hash --------------------------------------------------------------------


@dataclasses.dataclass
class _Source:
    root: Path | None
    files: list[tuple[str, Path]]  # (name inside root, path), hashed in this order
    read: Callable[[], RawData]
    generated: RawData | None = None  # synthetic: the arrays, hashed instead of files


def _fail(catalog: dict, message: str) -> ConfigError:
    return ConfigError(f"dataset {catalog['name']}: {message}; {catalog['install_hint']}")


def _existing(catalog: dict, root: Path, name: str) -> Path:
    """``root/name``, or the same file with/without ``.gz`` when only that one exists."""
    path = root / name
    if path.is_file():
        return path
    alt = root / (name[:-3] if name.endswith(".gz") else name + ".gz")
    if alt.is_file():
        return alt
    raise _fail(catalog, f"{path} not found")


def _open_source(catalog: dict, request: DatasetRequest) -> _Source:
    fmt = catalog["format"]
    if fmt == "synthetic":
        data = _readers.make_synthetic(
            n_train=catalog["n_train"],
            n_test=catalog["n_test"],
            image_size=catalog["image_size"],
            channels=catalog["channels"],
            num_classes=catalog["num_classes"],
            seed=catalog["seed"],
        )
        return _Source(root=None, files=[], read=lambda: data, generated=data)

    location = request.data_dir if request.data_dir is not None else catalog["default_path"]
    if location is None:
        raise _fail(catalog, "no data directory (the catalog has no default_path)")
    root = Path(location).expanduser()
    if not root.is_dir():
        raise _fail(catalog, f"{root} not found" if not root.exists() else f"{root} is not a directory")
    if fmt == "idx":
        f = catalog["files"]
        paths = {key: _existing(catalog, root, f[key]) for key in ("train_images", "train_labels", "test_images", "test_labels")}

        def read() -> RawData:
            train_images, train_labels = _readers.read_idx_split(paths["train_images"], paths["train_labels"])
            test_images, test_labels = _readers.read_idx_split(paths["test_images"], paths["test_labels"])
            return RawData(train_images, train_labels, test_images, test_labels, None)

        return _Source(root, [(p.name, p) for p in paths.values()], read)
    if fmt == "cifar10_pickle":
        f = catalog["files"]
        base = _readers.cifar10_root(root, f["test"])
        names = [*f["train"], f["test"], f["meta"]]
        paths = [base / n for n in names]
        for p in paths:
            if not p.is_file():
                raise _fail(catalog, f"{p} not found")
        return _Source(
            base,
            [(n, p) for n, p in zip(names, paths)],
            lambda: _readers.read_cifar10_pickle(base, train=f["train"], test=f["test"], meta=f["meta"]),
        )
    if fmt == "imagefolder":
        _, _, listing = _readers.list_imagefolder(root)
        files = sorted((p.relative_to(root).as_posix(), p) for items in listing.values() for p, _ in items)
        size = request.image_size or catalog["image_size"]
        return _Source(
            root,
            files,
            lambda: _readers.read_imagefolder(
                root,
                channels=catalog["channels"],
                image_size=size,
                test_fraction=catalog["test_fraction"],
                split_seed=catalog["split_seed"],
            ),
        )
    raise AssertionError(fmt)


def _request_key(catalog: dict, request: DatasetRequest) -> dict:
    return {
        "name": request.name,
        "train_fraction": float(request.train_fraction),
        "val_fraction": float(request.val_fraction),
        "image_size": int(request.image_size or catalog["image_size"]),
        "seed": int(request.seed),
    }


def _content_hash(catalog: dict, request: DatasetRequest, source: _Source) -> str:
    """sha256 of the format version, the catalog's data-defining keys, the request and the raw bytes."""
    h = hashlib.sha256()
    described = {k: v for k, v in catalog.items() if k not in ("default_path", "description", "install_hint")}
    h.update(json.dumps({"format_version": FORMAT_VERSION, "catalog": described, "request": _request_key(catalog, request)},
                        sort_keys=True).encode())
    if source.generated is not None:
        g = source.generated
        for array in (g.train_images, g.train_labels, g.test_images, g.test_labels):
            h.update(repr((array.dtype.str, array.shape)).encode())
            h.update(np.ascontiguousarray(array).data)
    for name, path in source.files:
        h.update(name.encode() + b"\0" + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


# -- splits, resizing, statistics ----------------------------------------------------------------


def _round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


def split_indices(labels: np.ndarray, *, val_fraction: float, train_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, val) indices into ``labels``: stratified, disjoint, fixed by ``seed``.

    Per class (in sorted class order, one shared generator): permute the class's indices; the
    first ``round(val_fraction * n)`` go to validation (at least 1 when n >= 2, never all), and
    of the remaining ``m`` the first ``max(1, round(train_fraction * m))`` are kept for training.
    """
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        perm = idx[rng.permutation(len(idx))]
        n_val = min(max(_round_half_up(val_fraction * len(idx)), 1 if len(idx) >= 2 else 0), len(idx) - 1)
        pool = perm[n_val:]
        keep = max(1, _round_half_up(train_fraction * len(pool)))
        val.append(perm[:n_val])
        train.append(pool[:keep])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 (N, H, W, C) -> (N, size, size, C), bilinear (antialiased when shrinking), via PIL."""
    from PIL import Image

    n, h, w, c = images.shape
    if (h, w) == (size, size):
        return images
    out = np.empty((n, size, size, c), dtype=np.uint8)
    for i in range(n):
        img = Image.fromarray(images[i, :, :, 0] if c == 1 else images[i], mode="L" if c == 1 else "RGB")
        out[i] = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR)).reshape(size, size, c)
    return out


def _channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 (N, H, W, C) images, in [0, 1] pixel units."""
    c = images.shape[-1]
    total = np.zeros(c)
    total_sq = np.zeros(c)
    for start in range(0, len(images), 4096):
        chunk = images[start : start + 4096].reshape(-1, c).astype(np.float64)
        total += chunk.sum(axis=0)
        total_sq += np.square(chunk).sum(axis=0)
    count = images.size // c
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
    std = np.where(std > 0, std, 255.0)  # a constant channel: leave it unscaled rather than divide by 0
    return tuple(float(m / 255.0) for m in mean), tuple(float(s / 255.0) for s in std)


# -- conversion ----------------------------------------------------------------------------------


class _Arrays:
    """The indexable dataset FFCV's writer wants: ``(image uint8 (H, W, C), label int)``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.images[i], int(self.labels[i])


def _write_beton(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    from ._ffcv import ffcv

    f = ffcv()
    fields = {
        IMAGE_FIELD: f.fields.NDArrayField(dtype=np.dtype(np.uint8), shape=tuple(int(s) for s in images.shape[1:])),
        LABEL_FIELD: f.fields.IntField(),
    }
    # Each worker is a forked process; below a few thousand images forking costs more than it saves.
    workers = 1 if len(labels) < 8192 else max(1, min(os.cpu_count() or 1, 8))
    writer = f.writer.DatasetWriter(str(path), fields, num_workers=workers)
    writer.from_indexed_dataset(_Arrays(np.ascontiguousarray(images), labels), chunksize=1000)


def _convert(catalog: dict, request: DatasetRequest, source: _Source, out_dir: Path, content_hash: str) -> dict:
    """Decode, split, resize, write the three .beton files and meta.json into ``out_dir``."""
    name = catalog["name"]
    started = time.perf_counter()
    try:
        raw = source.read()
    except ConfigError as exc:
        raise _fail(catalog, str(exc)) from None
    n, h, w, c = raw.train_images.shape
    if h != w or raw.test_images.shape[1:] != (h, w, c):
        raise _fail(catalog, f"train images are {h}x{w}x{c} and test images {raw.test_images.shape[1:]}; expected square images of one size")
    if c != catalog["channels"]:
        raise _fail(catalog, f"images have {c} channel(s) but the catalog says channels: {catalog['channels']}; fix datasets/{name}.yaml")
    native = catalog["image_size"] if catalog["format"] != "imagefolder" else h
    if h != native:
        raise _fail(catalog, f"images are {h}x{w} but the catalog says image_size: {native}; fix datasets/{name}.yaml")
    class_names = tuple(catalog["class_names"] or raw.class_names or ())
    num_classes = catalog["num_classes"] or len(class_names) or int(max(raw.train_labels.max(), raw.test_labels.max())) + 1
    if not class_names:
        class_names = tuple(str(i) for i in range(num_classes))
    if len(class_names) != num_classes:
        raise _fail(catalog, f"{len(class_names)} class names for {num_classes} classes; fix class_names in datasets/{name}.yaml")
    for split, labels in (("train", raw.train_labels), ("test", raw.test_labels)):
        if len(labels) == 0:
            raise _fail(catalog, f"the {split} split is empty")
        if labels.min() < 0 or labels.max() >= num_classes:
            raise _fail(catalog, f"{split} labels span [{labels.min()}, {labels.max()}], outside [0, {num_classes}); check the files or num_classes")

    train_idx, val_idx = split_indices(
        raw.train_labels, val_fraction=request.val_fraction, train_fraction=request.train_fraction, seed=request.seed
    )
    for split, idx in (("train", train_idx), ("validation", val_idx)):
        if len(idx) == 0:
            raise _fail(catalog, f"too few images for a {split} split ({len(raw.train_labels)} training images); add images")
    size = int(request.image_size or native)
    arrays = {
        "train": (_resize(raw.train_images[train_idx], size), raw.train_labels[train_idx]),
        "val": (_resize(raw.train_images[val_idx], size), raw.train_labels[val_idx]),
        "test": (_resize(raw.test_images, size), raw.test_labels),
    }
    if catalog["mean"] is not None:
        mean, std = tuple(map(float, catalog["mean"])), tuple(map(float, catalog["std"]))
    else:
        mean, std = _channel_stats(arrays["train"][0])
    for split, (images, labels) in arrays.items():
        _write_beton(out_dir / f"{split}.beton", images, labels)

    dataset = {
        "name": name,
        "train_path": "train.beton",
        "val_path": "val.beton",
        "test_path": "test.beton",
        "num_classes": int(num_classes),
        "image_size": size,
        "channels": int(c),
        "mean": list(mean),
        "std": list(std),
        "class_names": list(class_names),
        "counts": {split: int(len(arrays[split][1])) for split in SPLITS},
        "content_hash": content_hash,
        "flip": bool(catalog["flip"]),
    }
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        "request": _request_key(catalog, request),
        "source": {"root": str(source.root) if source.root else None, "files": [n for n, _ in source.files]},
        "fields": {IMAGE_FIELD: f"NDArrayField uint8 {[size, size, int(c)]}", LABEL_FIELD: "IntField int64"},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pid": os.getpid(),
        "conversion_s": round(time.perf_counter() - started, 3),
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _load(final: Path) -> PreparedDataset | None:
    """The PreparedDataset stored in ``final``, or None when it is not a complete entry."""
    try:
        meta = json.loads((final / META_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    if meta.get("format_version") != FORMAT_VERSION:
        return None
    d = dict(meta["dataset"])
    for split in SPLITS:
        path = final / d[f"{split}_path"]
        if not path.is_file():
            return None
        d[f"{split}_path"] = str(path)
    d["mean"], d["std"], d["class_names"] = tuple(d["mean"]), tuple(d["std"]), tuple(d["class_names"])
    return PreparedDataset(**d)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _check_request(request: DatasetRequest) -> None:
    def bad(field: str, rule: str, value: Any) -> ConfigError:
        return ConfigError(f"dataset {request.name}: {field} must be {rule}, got {value!r}")

    if not isinstance(request.train_fraction, (int, float)) or not 0.0 < request.train_fraction <= 1.0:
        raise bad("train_fraction", "in (0, 1]", request.train_fraction)
    if not isinstance(request.val_fraction, (int, float)) or not 0.0 < request.val_fraction < 1.0:
        raise bad("val_fraction", "in (0, 1) (the validation split makes every search decision)", request.val_fraction)
    if request.image_size is not None and (not isinstance(request.image_size, int) or request.image_size < 4):
        raise bad("image_size", "an integer >= 4 or null (native size)", request.image_size)
    if not isinstance(request.seed, int) or isinstance(request.seed, bool) or request.seed < 0:
        raise bad("seed", "a non-negative integer", request.seed)


def prepare_dataset(request: DatasetRequest, *, cache_dir: str | os.PathLike) -> PreparedDataset:
    """Convert ``request``'s data to FFCV files under ``cache_dir`` once; later calls reuse them.

    Raises ConfigError for a missing or damaged dataset, a bad request or catalog entry, or an
    unwritable ``cache_dir``.
    """
    _check_request(request)
    catalog = load_catalog(request.name)
    source = _open_source(catalog, request)
    content_hash = _content_hash(catalog, request, source)
    cache_dir = Path(cache_dir).expanduser().resolve()  # absolute: Ray trials run in other directories
    stem = f"{request.name}-{content_hash[:16]}"
    final = cache_dir / stem
    prepared = _load(final)
    if prepared is not None:
        return prepared
    problem = folder_problem(cache_dir)
    if problem:
        raise ConfigError(f"dataset cache {cache_dir}: {problem}; choose another cache directory (--cache-dir DIR or "
                          "LOCALITY_SEARCH_CACHE)")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock_path = cache_dir / f".{stem}.lock"
        lock_path.touch(exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"dataset cache {cache_dir}: cannot write there ({exc.strerror or exc}); choose a writable cache directory") from None
    with _exclusive(lock_path):
        prepared = _load(final)  # another process may have finished while we waited
        if prepared is not None:
            return prepared
        if final.exists():  # incomplete or from an older format version
            shutil.rmtree(final)
        for stale in cache_dir.glob(f".{stem}.tmp-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{stem}.tmp-", dir=cache_dir))
        try:
            log.info("preparing dataset %s into %s (once; later runs reuse it)", request.name, final)
            meta = _convert(catalog, request, source, tmp, content_hash)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("dataset %s ready in %.1f s: %s", request.name, meta["conversion_s"], meta["dataset"]["counts"])
    prepared = _load(final)
    assert prepared is not None, f"{final} incomplete right after conversion"
    return prepared

"""Raw dataset readers: pure numpy (PIL for image files), no FFCV, no torch.

Every reader returns a :class:`RawData`: images ``uint8 (N, H, W, C)``, labels ``int64 (N,)``
for a train and a test split, and the class names. Problems with the user's files raise
:class:`~trainers.errors.ConfigError` naming the file; ``_prepare`` adds the dataset name and
the catalog's install hint.

Formats:

- ``idx``: the MNIST/Fashion-MNIST IDX format, gzipped or not (detected by content, not name);
  any element type and number of dimensions the header declares.
- ``cifar10_pickle``: the "python version" CIFAR-10 folder (``data_batch_1..5``, ``test_batch``,
  ``batches.meta``). These are pickles; they are read with an unpickler that only resolves the
  few numpy names an array needs, so a hostile file cannot run code. This is the only format that
  unpickles user files.
- ``imagefolder``: ``root/train/<class>/*`` and ``root/test/<class>/*`` are used as they are;
  otherwise ``root/<class>/*`` and a stratified ``test_fraction`` of every class (fixed by the
  catalog's ``split_seed``, not by the request's seed, so the test set never changes) is the
  test split. Images are converted to L or RGB, centre-cropped to a square and resized.
- ``synthetic``: generated from a seed (see :func:`make_synthetic`).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import os
import pickle
import zlib
from pathlib import Path

import numpy as np

from trainers.errors import ConfigError

__all__ = [
    "RawData",
    "read_idx",
    "read_idx_split",
    "read_cifar10_pickle",
    "cifar10_root",
    "list_imagefolder",
    "read_imagefolder",
    "make_synthetic",
    "SYNTHETIC_PATTERNS",
    "IMAGE_EXTENSIONS",
]


@dataclasses.dataclass(frozen=True)
class RawData:
    """Decoded splits, before validation split, subsampling or resizing."""

    train_images: np.ndarray  # uint8 (N, H, W, C)
    train_labels: np.ndarray  # int64 (N,)
    test_images: np.ndarray  # uint8 (M, H, W, C)
    test_labels: np.ndarray  # int64 (M,)
    class_names: tuple[str, ...] | None  # None: the format does not carry them (use the catalog's)


# -- IDX ---------------------------------------------------------------------------------------

_IDX_TYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def _read_maybe_gzipped(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path} not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise ConfigError(f"{path}: corrupt or truncated gzip file ({exc}); replace it with an intact copy") from None


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """One IDX file (gzipped or not) as an array of the shape and type its header declares.

    Header: two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), the number of dimensions, then each dimension as a big-endian
    uint32. The data must be exactly as long as the header says.
    """
    path = Path(path)
    data = _read_maybe_gzipped(path)
    fix = "replace it with an intact copy"
    if len(data) < 4:
        raise ConfigError(f"{path}: truncated IDX file ({len(data)} bytes, no header); {fix}")
    zero0, zero1, type_code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0 or type_code not in _IDX_TYPES or ndim == 0:
        raise ConfigError(f"{path}: not an IDX file (magic bytes {data[:4].hex(' ')}); {fix}")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise ConfigError(f"{path}: truncated IDX header ({len(data)} of {header_len} bytes); {fix}")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_TYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = len(data) - header_len
    if found < expected:
        raise ConfigError(
            f"{path}: truncated IDX file (header says {shape} {dtype.name}, {expected} data bytes; found {found}); {fix}"
        )
    if found > expected:
        raise ConfigError(f"{path}: {found - expected} unexpected bytes after the IDX data of shape {shape}; {fix}")
    array = np.frombuffer(data, dtype=dtype, count=expected // dtype.itemsize, offset=header_len)
    return array.reshape(shape).astype(dtype.newbyteorder("="), copy=True)


def read_idx_split(images_path: str | os.PathLike, labels_path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """An image IDX file ``(N, H, W)`` or ``(N, H, W, C)`` uint8 and its label IDX file ``(N,)``."""
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise ConfigError(
            f"{images_path}: expected uint8 images of shape (N, H, W) or (N, H, W, C), "
            f"got {images.dtype.name} {images.shape}; point the catalog's files at the image file"
        )
    if images.ndim == 3:
        images = images[..., None]
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise ConfigError(
            f"{labels_path}: expected integer labels of shape (N,), got {labels.dtype.name} {labels.shape}; "
            "point the catalog's files at the label file"
        )
    if len(labels) != len(images):
        raise ConfigError(
            f"{labels_path}: {len(labels)} labels for {len(images)} images in {images_path}; "
            "the two files do not belong together"
        )
    return images, labels.astype(np.int64)


# -- CIFAR-10 (python pickles) -------------------------------------------------------------------

_PICKLE_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how Python 2 pickles of byte strings are spelled under protocol 2
}


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Resolves only the globals a pickled numpy array needs; anything else is refused."""

    def find_class(self, module: str, name: str):  # noqa: D401
        if (module, name) in _PICKLE_ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _load_pickle(path: Path) -> dict:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path} not found") from None
    try:
        obj = _ArraysOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # noqa: BLE001  (any unpickling failure means a damaged/foreign file)
        raise ConfigError(f"{path}: not a CIFAR-10 python pickle ({type(exc).__name__}: {exc}); replace it with an intact copy") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a pickled dict, got {type(obj).__name__}; replace it with an intact copy")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def cifar10_root(root: str | os.PathLike, probe: str) -> Path:
    """``root`` itself, or its ``cifar-10-batches-py`` subfolder when that holds ``probe``."""
    root = Path(root)
    nested = root / "cifar-10-batches-py"
    if not (root / probe).exists() and (nested / probe).exists():
        return nested
    return root


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _load_pickle(path)
    if "data" not in batch or "labels" not in batch:
        raise ConfigError(f"{path}: missing 'data' or 'labels' in the CIFAR-10 batch; replace it with an intact copy")
    data = np.asarray(batch["data"])
    labels = np.asarray(batch["labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (len(data),):
        raise ConfigError(
            f"{path}: expected data uint8 (N, 3072) and N labels, got {data.dtype.name} {data.shape} "
            f"and {labels.shape}; replace it with an intact copy"
        )
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # (N, 32, 32, 3)
    return np.ascontiguousarray(images), labels.astype(np.int64)


def read_cifar10_pickle(root: str | os.PathLike, *, train: list[str], test: str, meta: str) -> RawData:
    """The CIFAR-10 python folder: ``train`` batch files, the ``test`` batch, the ``meta`` file."""
    root = cifar10_root(root, test)
    parts = [_cifar_batch(root / name) for name in train]
    test_images, test_labels = _cifar_batch(root / test)
    meta_dict = _load_pickle(root / meta)
    names = meta_dict.get("label_names")
    class_names = None
    if names is not None:
        class_names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    return RawData(
        train_images=np.concatenate([p[0] for p in parts]),
        train_labels=np.concatenate([p[1] for p in parts]),
        test_images=test_images,
        test_labels=test_labels,
        class_names=class_names,
    )


# -- image folders -------------------------------------------------------------------------------

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def _class_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
    )


def list_imagefolder(root: str | os.PathLike) -> tuple[str, tuple[str, ...], dict[str, list[tuple[Path, int]]]]:
    """Find the layout, the classes and every image file with its class index.

    Returns ``(layout, class_names, files)`` where layout is ``"train_test"`` (``root/train`` and
    ``root/test``) or ``"classes"`` (``root/<class>``); ``files`` maps ``"train"``/``"test"``
    (``"all"`` for the ``classes`` layout) to sorted ``(path, label)`` lists.
    """
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory")
    train_dir, test_dir = root / "train", root / "test"
    if train_dir.is_dir() or test_dir.is_dir():
        if not (train_dir.is_dir() and test_dir.is_dir()):
            missing = test_dir if train_dir.is_dir() else train_dir
            raise ConfigError(
                f"{missing} is missing; give both {train_dir}/<class>/ and {test_dir}/<class>/, "
                f"or put the class folders directly under {root} to carve the test split out"
            )
        class_names = tuple(p.name for p in _class_dirs(train_dir))
        test_classes = [p.name for p in _class_dirs(test_dir)]
        unknown = sorted(set(test_classes) - set(class_names))
        if unknown:
            raise ConfigError(f"{test_dir}: classes {unknown} have no folder in {train_dir}; add them or remove them")
        layout, splits = "train_test", {"train": train_dir, "test": test_dir}
    else:
        class_names = tuple(p.name for p in _class_dirs(root))
        layout, splits = "classes", {"all": root}
    if len(class_names) < 2:
        raise ConfigError(
            f"{splits.get('train', root)}: found {len(class_names)} class folder(s); "
            "an image folder needs one sub-folder per class, at least two"
        )
    files: dict[str, list[tuple[Path, int]]] = {}
    for split, folder in splits.items():
        files[split] = []
        for label, name in enumerate(class_names):
            if (folder / name).is_dir():
                files[split].extend((p, label) for p in _image_files(folder / name))
        if not files[split]:
            raise ConfigError(f"{folder}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in its class folders")
    return layout, class_names, files


def _load_image(path: Path, *, mode: str, size: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img = img.convert(mode)
            w, h = img.size
            if w != h:  # centre crop to the largest square
                s = min(w, h)
                left, top = (w - s) // 2, (h - s) // 2
                img = img.crop((left, top, left + s, top + s))
            if img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BILINEAR)
            array = np.asarray(img, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot decode image ({exc}); remove or replace the file") from None
    return array.reshape(size, size, -1)


def _stratified_holdout(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of a stratified ``fraction`` of every class (at least one image if it has two)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        n = int(np.floor(fraction * len(idx) + 0.5))
        n = min(max(n, 1 if len(idx) >= 2 else 0), len(idx) - 1)
        mask[idx[rng.permutation(len(idx))[:n]]] = True
    return mask


def read_imagefolder(
    root: str | os.PathLike, *, channels: int, image_size: int, test_fraction: float, split_seed: int
) -> RawData:
    """Decode an image folder (see the module docstring for the layouts)."""
    layout, class_names, files = list_imagefolder(root)
    mode = "L" if channels == 1 else "RGB"

    def decode(items: list[tuple[Path, int]]) -> tuple[np.ndarray, np.ndarray]:
        images = np.stack([_load_image(p, mode=mode, size=image_size) for p, _ in items])
        return images, np.array([label for _, label in items], dtype=np.int64)

    if layout == "train_test":
        train_images, train_labels = decode(files["train"])
        test_images, test_labels = decode(files["test"])
    else:
        images, labels = decode(files["all"])
        test = _stratified_holdout(labels, test_fraction, split_seed)
        train_images, train_labels = images[~test], labels[~test]
        test_images, test_labels = images[test], labels[test]
    return RawData(train_images, train_labels, test_images, test_labels, class_names)


# -- synthetic -----------------------------------------------------------------------------------

SYNTHETIC_PATTERNS = (
    "horizontal bar",
    "vertical bar",
    "diagonal",
    "anti-diagonal",
    "plus",
    "cross",
    "square outline",
    "L corner",
    "T",
    "filled square",
)


def _patterns(t: int) -> np.ndarray:
    """The ``(len(SYNTHETIC_PATTERNS), t, t)`` binary shapes; index = class."""
    w = max(1, t // 4)  # stroke width
    mid = slice((t - w) // 2, (t - w) // 2 + w)
    p = np.zeros((len(SYNTHETIC_PATTERNS), t, t), dtype=bool)
    eye = np.zeros((t, t), dtype=bool)
    for k in range(w):
        eye |= np.eye(t, k=k, dtype=bool)
    p[0][mid, :] = True
    p[1][:, mid] = True
    p[2] = eye
    p[3] = eye[:, ::-1]
    p[4] = p[0] | p[1]
    p[5] = p[2] | p[3]
    p[6][:w, :] = p[6][-w:, :] = p[6][:, :w] = p[6][:, -w:] = True
    p[7][:, :w] = p[7][-w:, :] = True
    p[8][:w, :] = True
    p[8][:, mid] = True
    if t > 2 * w:
        p[9][w:-w, w:-w] = True
    else:
        p[9][:] = True
    return p


def make_synthetic(
    *, n_train: int, n_test: int, image_size: int, channels: int, num_classes: int, seed: int
) -> RawData:
    """Images whose label is the shape of a small pattern drawn at a random place.

    Each image is a noisy background (random level, Gaussian noise) with one pattern (a bar in
    one of four orientations, a plus, a cross, a square outline, an L, a T or a filled square;
    ``num_classes`` <= 10 takes the first ones) of side ``max(3, image_size // 3)`` pasted at a
    uniformly random position with a random brightness (and, for 3 channels, a random colour).
    Only the local spatial structure carries the label, so a model with a locality prior learns
    it in an epoch or two. Orientation is the label, so horizontal flips are not label-preserving.
    Classes are balanced; everything is a function of ``seed``.
    """
    if not 2 <= num_classes <= len(SYNTHETIC_PATTERNS):
        raise ConfigError(f"synthetic: num_classes must be in [2, {len(SYNTHETIC_PATTERNS)}], got {num_classes}")
    t = max(3, image_size // 3)
    if t > image_size:
        raise ConfigError(f"synthetic: image_size must be at least 3, got {image_size}")
    patterns = _patterns(t)[:num_classes].astype(np.float32)
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
        background = rng.uniform(0.0, 0.35, size=(n, 1, 1, channels)).astype(np.float32)
        images = background + rng.normal(0.0, 0.08, size=(n, image_size, image_size, channels)).astype(np.float32)
        ys = rng.integers(0, image_size - t + 1, size=n)
        xs = rng.integers(0, image_size - t + 1, size=n)
        brightness = rng.uniform(0.45, 0.65, size=(n, channels)).astype(np.float32)
        if channels > 1:
            brightness *= rng.uniform(0.5, 1.0, size=(n, channels)).astype(np.float32)
        for i in range(n):
            stamp = patterns[labels[i]][:, :, None] * brightness[i]  # (t, t, C)
            images[i, ys[i] : ys[i] + t, xs[i] : xs[i] + t] += stamp
        return np.clip(images * 255.0 + 0.5, 0, 255).astype(np.uint8), labels

    train_images, train_labels = draw(n_train)
    test_images, test_labels = draw(n_test)
    return RawData(train_images, train_labels, test_images, test_labels, SYNTHETIC_PATTERNS[:num_classes])

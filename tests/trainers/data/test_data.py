"""trainers.data: readers, catalog, conversion cache, splits, FFCV loaders (tiny fixtures, < 60 s)."""

from __future__ import annotations

import gzip
import multiprocessing
import os
import pickle
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from trainers.data import DatasetRequest, PreparedDataset, list_datasets, load_catalog, make_loader, prepare_dataset
from trainers.data import _prepare, _readers
from trainers.errors import ConfigError

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FM_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


# -- fixtures ------------------------------------------------------------------------------------

_IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B, np.dtype(">i4"): 0x0C,
              np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    """Hand-written IDX encoding: 0, 0, type code, ndim, big-endian dims, big-endian data."""
    big = array.astype(array.dtype.newbyteorder(">")) if array.dtype.itemsize > 1 else array
    code = _IDX_CODES[np.dtype(big.dtype)]
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + big.tobytes()


def write_idx(path: Path, array: np.ndarray) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def tiny_fashion_dir(root: Path, *, per_class: int = 6, test_per_class: int = 2) -> Path:
    """Fashion-MNIST-named IDX files: 10 classes, 28x28, pixel value encodes the label."""
    rng = np.random.default_rng(1)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", per_class), ("test", test_per_class)):
        labels = np.repeat(np.arange(10, dtype=np.uint8), n)
        rng.shuffle(labels)
        images = rng.integers(0, 256, size=(len(labels), 28, 28), dtype=np.uint8)
        write_idx(root / FM_FILES[f"{split}_images"], images)
        write_idx(root / FM_FILES[f"{split}_labels"], labels)
    return root


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> PreparedDataset:
    return prepare_dataset(DatasetRequest("synthetic"), cache_dir=tmp_path_factory.mktemp("cache"))


# -- IDX -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_reader_reads_any_type_and_rank(tmp_path, suffix):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    ints = np.array([[1, -2], [300000, 4]], dtype=np.int32)
    floats = np.linspace(-1, 1, 5).astype(np.float32)
    for name, array in (("a", images), ("b", ints), ("c", floats)):
        back = _readers.read_idx(write_idx(tmp_path / f"{name}{suffix}", array))
        assert back.shape == array.shape
        np.testing.assert_array_equal(back, array)
    imgs, labels = _readers.read_idx_split(tmp_path / f"a{suffix}", write_idx(tmp_path / f"l{suffix}", np.array([3, 1], np.uint8)))
    assert imgs.shape == (2, 3, 4, 1) and imgs.dtype == np.uint8
    assert labels.dtype == np.int64 and labels.tolist() == [3, 1]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda good: good[:-5], "truncated IDX file"),
        (lambda good: good[:6], "truncated IDX header"),
        (lambda good: good + b"xx", "unexpected bytes"),
        (lambda good: b"\x01\x00" + good[2:], "not an IDX file"),
        (lambda good: good[:2] + b"\x07" + good[3:], "not an IDX file"),
        (lambda good: gzip.compress(good)[:-12], "corrupt or truncated gzip"),
    ],
)
def test_idx_reader_rejects_corrupt_files(tmp_path, corrupt, message):
    good = idx_bytes(np.zeros((3, 4, 4), np.uint8))
    path = tmp_path / "bad-idx"
    path.write_bytes(corrupt(good))
    with pytest.raises(ConfigError, match=message) as info:
        _readers.read_idx(path)
    assert str(path) in str(info.value)


def test_idx_labels_must_match_images(tmp_path):
    write_idx(tmp_path / "i", np.zeros((3, 4, 4), np.uint8))
    write_idx(tmp_path / "l", np.zeros(2, np.uint8))
    with pytest.raises(ConfigError, match="2 labels for 3 images"):
        _readers.read_idx_split(tmp_path / "i", tmp_path / "l")


# -- CIFAR-10 pickles ----------------------------------------------------------------------------


def write_cifar(root: Path, per_batch: int = 4) -> Path:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def batch(n: int, offset: int) -> dict:
        data = np.empty((n, 3, 32, 32), np.uint8)
        data[:, 0], data[:, 1], data[:, 2] = 10, 20, 30  # channel c is constant 10 * (c + 1)
        data[:, 0, 0, 0] = np.arange(n) + offset  # a marker per image
        return {b"data": data.reshape(n, 3072), b"labels": [int(x) for x in rng.integers(0, 10, n)],
                b"batch_label": b"x", b"filenames": [b"f"] * n}

    for i in range(5):
        (root / f"data_batch_{i + 1}").write_bytes(pickle.dumps(batch(per_batch, 100 + 10 * i), protocol=2))
    (root / "test_batch").write_bytes(pickle.dumps(batch(per_batch, 200), protocol=2))
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": names, b"num_vis": 3072}, protocol=2))
    return root


def test_cifar_reader(tmp_path):
    root = write_cifar(tmp_path / "cifar-10-batches-py")
    files = load_catalog("cifar10")["files"]
    for where in (root, tmp_path):  # the batches folder itself, or the folder that contains it
        raw = _readers.read_cifar10_pickle(_readers.cifar10_root(where, files["test"]), **files)
        assert raw.train_images.shape == (20, 32, 32, 3) and raw.train_images.dtype == np.uint8
        assert raw.test_images.shape == (4, 32, 32, 3)
        assert raw.train_images[0, 5, 5].tolist() == [10, 20, 30]  # CHW rows became HWC
        assert raw.train_images[:, 0, 0, 0].tolist()[:5] == [100, 101, 102, 103, 110]
        assert raw.class_names[0] == "airplane" and raw.train_labels.dtype == np.int64


def test_cifar_reader_refuses_code_in_pickles(tmp_path):
    root = write_cifar(tmp_path / "c")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (root / "data_batch_1").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(ConfigError, match="data_batch_1"):
        prepare_dataset(DatasetRequest("cifar10", data_dir=str(root)), cache_dir=tmp_path / "cache")
    assert not marker.exists()


def test_cifar_needs_data_dir(tmp_path):
    with pytest.raises(ConfigError, match="--data-dir"):
        prepare_dataset(DatasetRequest("cifar10"), cache_dir=tmp_path)


# -- image folders -------------------------------------------------------------------------------


def write_pngs(folder: Path, n: int, color: tuple[int, int, int], size: tuple[int, int] = (20, 20)) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", size, color).save(folder / f"img{i}.png")


def test_imagefolder_train_test_layout(tmp_path):
    write_pngs(tmp_path / "train" / "cat", 3, (255, 0, 0))
    write_pngs(tmp_path / "train" / "dog", 2, (0, 0, 255), size=(40, 30))  # non-square: cropped, resized
    write_pngs(tmp_path / "test" / "dog", 1, (0, 0, 255))
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    raw = _readers.read_imagefolder(tmp_path, channels=3, image_size=8, test_fraction=0.2, split_seed=0)
    assert raw.class_names == ("cat", "dog")
    assert raw.train_images.shape == (5, 8, 8, 3) and raw.test_images.shape == (1, 8, 8, 3)
    assert raw.train_labels.tolist() == [0, 0, 0, 1, 1] and raw.test_labels.tolist() == [1]
    assert raw.train_images[0, 4, 4].tolist() == [255, 0, 0] and raw.train_images[4, 4, 4].tolist() == [0, 0, 255]
    grey = _readers.read_imagefolder(tmp_path, channels=1, image_size=8, test_fraction=0.2, split_seed=0)
    assert grey.train_images.shape == (5, 8, 8, 1)


@pytest.mark.ffcv
def test_imagefolder_class_layout_carves_out_test(tmp_path):
    for name, color in (("a", (0, 0, 0)), ("b", (90, 90, 90)), ("c", (200, 200, 200))):
        write_pngs(tmp_path / "data" / name, 5, color)
    prepared = prepare_dataset(
        DatasetRequest("imagefolder", data_dir=str(tmp_path / "data"), val_fraction=0.25, image_size=16),
        cache_dir=tmp_path / "cache",
    )
    assert prepared.class_names == ("a", "b", "c") and prepared.num_classes == 3
    assert prepared.counts == {"train": 9, "val": 3, "test": 3}  # per class: 1 test, then 1 val, 3 train
    assert prepared.image_size == 16 and prepared.channels == 3
    assert len(prepared.mean) == 3 and 0 < prepared.mean[0] < 1  # computed from the training split


def test_imagefolder_errors(tmp_path):
    write_pngs(tmp_path / "train" / "a", 1, (0, 0, 0))
    with pytest.raises(ConfigError, match="test is missing"):
        _readers.list_imagefolder(tmp_path)
    write_pngs(tmp_path / "test" / "a", 1, (0, 0, 0))
    write_pngs(tmp_path / "train" / "b", 1, (0, 0, 0))
    (tmp_path / "train" / "b" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ConfigError, match="broken.png"):
        _readers.read_imagefolder(tmp_path, channels=3, image_size=8, test_fraction=0.2, split_seed=0)


# -- synthetic -----------------------------------------------------------------------------------


def test_synthetic_is_deterministic_per_seed():
    kw = dict(n_train=40, n_test=8, image_size=16, channels=3, num_classes=4)
    a, b, c = (_readers.make_synthetic(seed=s, **kw) for s in (0, 0, 1))
    np.testing.assert_array_equal(a.train_images, b.train_images)
    np.testing.assert_array_equal(a.test_labels, b.test_labels)
    assert not np.array_equal(a.train_images, c.train_images)
    assert a.train_images.shape == (40, 16, 16, 3) and a.train_images.dtype == np.uint8
    assert np.bincount(a.train_labels).tolist() == [10, 10, 10, 10]
    assert load_catalog("synthetic")["flip"] is False  # orientation is the label


def test_synthetic_patterns_are_distinct():
    patterns = _readers._patterns(5)
    flat = {p.tobytes() for p in patterns}
    assert len(flat) == len(_readers.SYNTHETIC_PATTERNS)


# -- catalog -------------------------------------------------------------------------------------


def test_every_catalog_entry_loads():
    names = list_datasets()
    assert {"fashion_mnist", "synthetic", "cifar10", "imagefolder"} <= set(names)
    for name in names:
        entry = load_catalog(name)
        assert entry["name"] == name and entry["channels"] in (1, 3)


def test_unknown_dataset_lists_known():
    with pytest.raises(ConfigError, match="known: .*fashion_mnist"):
        load_catalog("mnist-that-does-not-exist")


def test_malformed_catalog_names_file_and_key(tmp_path, monkeypatch):
    monkeypatch.setattr(_prepare, "CATALOG_DIR", tmp_path)
    good = (Path(__file__).resolve().parents[3] / "datasets" / "synthetic.yaml").read_text()
    (tmp_path / "synthetic.yaml").write_text(good + "colour: blue\n")
    with pytest.raises(ConfigError, match=r"synthetic\.yaml: unknown key\(s\) colour"):
        load_catalog("synthetic")
    (tmp_path / "synthetic.yaml").write_text(good.replace("channels: 1", "channels: two"))
    with pytest.raises(ConfigError, match="channels must be an integer"):
        load_catalog("synthetic")
    (tmp_path / "synthetic.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_catalog("synthetic")


def test_request_is_validated(tmp_path):
    for bad in (dict(train_fraction=0.0), dict(val_fraction=0.0), dict(val_fraction=1.0), dict(seed=-1), dict(image_size=2)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            prepare_dataset(DatasetRequest("synthetic", **bad), cache_dir=tmp_path)


# -- splits --------------------------------------------------------------------------------------


def test_split_is_stratified_disjoint_nested_and_fixed_by_seed():
    labels = np.repeat(np.arange(5), [100, 50, 20, 7, 2])
    np.random.default_rng(0).shuffle(labels)
    train_full, val = _prepare.split_indices(labels, val_fraction=0.1, train_fraction=1.0, seed=3)
    train_part, val_part = _prepare.split_indices(labels, val_fraction=0.1, train_fraction=0.25, seed=3)
    np.testing.assert_array_equal(val, val_part)  # validation does not depend on train_fraction
    assert not set(train_full) & set(val)
    assert set(train_part) <= set(train_full)  # a smaller fraction keeps a subset
    assert len(train_full) + len(val) == len(labels)
    assert np.bincount(labels[val], minlength=5).tolist() == [10, 5, 2, 1, 1]  # round half up, >= 1
    pool = np.bincount(labels[train_full], minlength=5)
    kept = np.bincount(labels[train_part], minlength=5)
    assert kept.tolist() == [max(1, int(np.floor(0.25 * n + 0.5))) for n in pool]
    _, val_other_seed = _prepare.split_indices(labels, val_fraction=0.1, train_fraction=1.0, seed=4)
    assert not np.array_equal(val, val_other_seed)


@pytest.mark.ffcv
def test_prepare_subsamples_per_class(tmp_path):
    root = tiny_fashion_dir(tmp_path / "fm", per_class=20)
    prepared = prepare_dataset(
        DatasetRequest("fashion_mnist", data_dir=str(root), train_fraction=0.5, val_fraction=0.1),
        cache_dir=tmp_path / "cache",
    )
    # per class: 20 -> 2 val, 18 left -> 9 kept
    assert prepared.counts == {"train": 90, "val": 20, "test": 20}
    assert prepared.class_names[0] == "T-shirt/top" and prepared.mean == (0.2860,)


# -- cache ---------------------------------------------------------------------------------------


@pytest.mark.ffcv
def test_cache_is_reused_and_keyed_by_content(tmp_path, monkeypatch):
    root = tiny_fashion_dir(tmp_path / "fm")
    cache = tmp_path / "cache"
    request = DatasetRequest("fashion_mnist", data_dir=str(root))
    first = prepare_dataset(request, cache_dir=cache)
    mtimes = [os.stat(p).st_mtime_ns for p in (first.train_path, first.val_path, first.test_path)]

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(_prepare, "_convert", no_conversion)
    again = prepare_dataset(request, cache_dir=cache)
    assert again == first
    assert [os.stat(p).st_mtime_ns for p in (again.train_path, again.val_path, again.test_path)] == mtimes
    # same bytes elsewhere: same entry; different bytes or request: a new entry
    moved = tiny_fashion_dir(tmp_path / "elsewhere")
    assert prepare_dataset(DatasetRequest("fashion_mnist", data_dir=str(moved)), cache_dir=cache) == first
    monkeypatch.undo()
    other = prepare_dataset(DatasetRequest("fashion_mnist", data_dir=str(root), seed=1), cache_dir=cache)
    assert other.content_hash != first.content_hash
    write_idx(root / FM_FILES["test_labels"], np.zeros(20, np.uint8))
    assert prepare_dataset(request, cache_dir=cache).content_hash not in (first.content_hash, other.content_hash)
    assert not list(cache.glob(".*.tmp-*"))


def _prepare_in_child(cache: str, log: str) -> None:
    original = _prepare._convert

    def counting(*args, **kwargs):
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return original(*args, **kwargs)

    _prepare._convert = counting
    prepare_dataset(DatasetRequest("synthetic", seed=7), cache_dir=cache)


@pytest.mark.ffcv
def test_concurrent_prepare_converts_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    log = tmp_path / "conversions.log"
    procs = [ctx.Process(target=_prepare_in_child, args=(str(tmp_path / "cache"), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1
    entries = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()
    assert not list((tmp_path / "cache").glob(".*.tmp-*"))


def test_missing_fashion_mnist_names_the_fix(tmp_path):
    with pytest.raises(ConfigError) as info:
        prepare_dataset(DatasetRequest("fashion_mnist", data_dir=str(tmp_path / "nowhere")), cache_dir=tmp_path)
    message = str(info.value)
    assert "nowhere" in message and "dataset-fashion-mnist" in message and "--data-dir" in message
    assert "\n" not in message
    (tmp_path / "partial").mkdir()
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte.gz not found; install Debian's dataset-fashion-mnist"):
        prepare_dataset(DatasetRequest("fashion_mnist", data_dir=str(tmp_path / "partial")), cache_dir=tmp_path)


# -- loaders -------------------------------------------------------------------------------------


def first_batch(loader) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch, copied out of FFCV's buffers; the epoch's thread is stopped."""
    it = iter(loader)
    try:
        x, y = next(it)
        return x.clone(), y.clone()
    finally:
        it.close()


def _read_all(loader) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = [], []
    for x, y in loader:
        images.append(x.clone())
        labels.append(y.clone())
    return torch.cat(images), torch.cat(labels)


@pytest.mark.ffcv
def test_eval_loader_round_trips_every_image(synthetic):
    loader = make_loader(synthetic.val_path, batch_size=64, train=False, mean=synthetic.mean, std=synthetic.std)
    images, labels = _read_all(loader)
    n = synthetic.counts["val"]
    assert images.shape == (n, 1, 16, 16) and images.dtype == torch.float32
    assert labels.shape == (n,) and labels.dtype == torch.int64
    assert set(labels.tolist()) == set(range(synthetic.num_classes))
    assert abs(images.mean().item()) < 0.1 and abs(images.std().item() - 1) < 0.1
    # the stored pixels are the generated ones (val = the seed's stratified pick of the train split)
    raw = _readers.make_synthetic(**{k: load_catalog("synthetic")[k] for k in ("n_train", "n_test", "image_size", "channels", "num_classes", "seed")})
    _, val_idx = _prepare.split_indices(raw.train_labels, val_fraction=0.1, train_fraction=1.0, seed=0)
    pixels = images * (synthetic.std[0] * 255) + synthetic.mean[0] * 255
    np.testing.assert_allclose(pixels.numpy().round(), raw.train_images[val_idx].transpose(0, 3, 1, 2), atol=0)
    np.testing.assert_array_equal(labels.numpy(), raw.train_labels[val_idx])


@pytest.mark.ffcv
@pytest.mark.cuda
def test_cuda_loader_epoch_started_under_inference_mode(synthetic):
    """Validation starts its epoch under inference_mode; FFCV's thread then copies each batch
    into the buffers that epoch allocated (ToDevice), which must be normal tensors."""
    kw = dict(batch_size=64, train=False, mean=synthetic.mean, std=synthetic.std)
    expected, expected_labels = _read_all(make_loader(synthetic.val_path, **kw))
    cuda = make_loader(synthetic.val_path, device="cuda", **kw)
    for _ in range(2):  # the second epoch reuses the loader
        with torch.inference_mode():
            images, labels = _read_all(cuda)
        assert images.device.type == "cuda"
        torch.testing.assert_close(images.cpu(), expected)
        assert torch.equal(labels.cpu(), expected_labels)
    images, _ = _read_all(cuda)  # and outside inference_mode again, as the next training epoch
    torch.testing.assert_close(images.cpu(), expected)


@pytest.mark.ffcv
@pytest.mark.cuda
def test_cuda_batches_stay_right_when_the_gpu_runs_behind(synthetic):
    """A GPU-bound consumer (a CUDA-graphed training step) lets the host run many batches ahead
    of the GPU; FFCV's pinned host buffers must not be decoded over before their copies ran."""
    kw = dict(batch_size=16, train=True, mean=synthetic.mean, std=synthetic.std, device="cuda", num_workers=2)
    loader = make_loader(synthetic.train_path, seed=3, **kw)
    expected = [(x.cpu(), y.cpu()) for x, y in loader]  # each batch read back: the GPU keeps up
    assert len(expected) >= 10  # more batches than FFCV's 5 slots
    loader = make_loader(synthetic.train_path, seed=3, **kw)  # the same epoch again
    behind = []
    for images, labels in loader:
        torch.cuda._sleep(5_000_000)  # a few ms of GPU work per batch, the host never waits for it
        behind.append((images, labels))
    torch.cuda.synchronize()
    for (x, y), (ex, ey) in zip(behind, expected, strict=True):
        assert torch.equal(y.cpu(), ey)
        torch.testing.assert_close(x.cpu(), ex, rtol=0, atol=0)


def _gpu_buffers(epoch, *, slot: int | None = None) -> list[torch.Tensor]:
    """The GPU buffers FFCV allocated for an epoch (one per slot for each ToDevice), or one slot's."""
    per_op = [v for v in epoch.memory_allocations["operation"].values() if isinstance(v, list)]
    return [t for per_slot in per_op for i, t in enumerate(per_slot) if t.is_cuda and slot in (None, i)]


def _spans(tensors) -> set[tuple[int, int]]:
    return {(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors}


@pytest.mark.ffcv
@pytest.mark.cuda
def test_cuda_epoch_waits_for_work_queued_on_the_memory_it_reuses(synthetic):
    """An epoch's GPU buffers come from the current stream's pool, which hands out at once a block
    the host freed while kernels queued on it have yet to run (validation starting behind the last
    training step's backward). The first batch's copy must wait for them: FFCV's own events cover
    every later one."""
    kw = dict(batch_size=16, train=False, mean=synthetic.mean, std=synthetic.std, device="cuda", num_workers=2)
    loader = make_loader(synthetic.val_path, **kw)
    expected = [(x.cpu(), y.cpu()) for x, y in loader]
    # Twice: on an H100 the first such start waited for the GPU's queue to drain (iter() took the
    # half second; a first-time allocation, it seems) and hid the hazard; the second did not.
    for _ in range(2):
        pool = torch.cuda.MemPool()  # a pool of only these blocks, so that the epoch gets them back
        with torch.cuda.use_mem_pool(pool):
            freed = [torch.empty_like(buffer) for buffer in _gpu_buffers(loader._last)]
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # about half a second of GPU work
        for block in freed:
            block.view(torch.uint8).fill_(255)  # queued behind it: labels of -1 once it runs
        junk = _spans(freed)
        del freed
        with torch.cuda.use_mem_pool(pool):
            epoch = iter(loader)
        assert _spans(_gpu_buffers(epoch, slot=0)) <= junk  # the first batch's blocks, their fills queued
        batches = list(epoch)
        torch.cuda.synchronize()
        for (x, y), (ex, ey) in zip(batches, expected, strict=True):
            assert torch.equal(y.cpu(), ey)
            torch.testing.assert_close(x.cpu(), ex, rtol=0, atol=0)
        del epoch, batches


@pytest.mark.ffcv
def test_train_loader_order_and_augmentation_are_seeded(synthetic):
    kw = dict(batch_size=256, train=True, mean=synthetic.mean, std=synthetic.std, flip=True, pad_crop=2)
    loader = make_loader(synthetic.train_path, seed=5, **kw)
    assert len(loader) == synthetic.counts["train"] // 256  # drop_last
    epoch0_x, epoch0_y = first_batch(loader)
    epoch1_y = first_batch(loader)[1]
    assert not torch.equal(epoch0_y, epoch1_y)  # a new order every epoch
    again = make_loader(synthetic.train_path, seed=5, **kw)  # cached, reset to epoch 0
    assert again is loader
    x, y = first_batch(again)
    assert torch.equal(y, epoch0_y) and torch.equal(x, epoch0_x)  # same order, same crops and flips
    other_x, other_y = first_batch(make_loader(synthetic.train_path, seed=6, **kw))
    assert not torch.equal(other_y, epoch0_y)
    plain = make_loader(synthetic.train_path, seed=5, **{**kw, "flip": False, "pad_crop": 0})
    plain_x, plain_y = first_batch(plain)
    assert torch.equal(plain_y, epoch0_y) and not torch.equal(plain_x, epoch0_x)  # augmentation changed pixels
    assert x.shape == (256, 1, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    # an epoch left early is stopped when the next one starts (FFCV's thread would spin on)
    left = iter(plain)
    next(left)
    next(iter(plain))
    left.join(timeout=10)
    assert not left.is_alive()


@pytest.mark.ffcv
def test_loader_rejects_batch_larger_than_train_split(synthetic):
    with pytest.raises(ConfigError, match="fewer than batch_size"):
        make_loader(synthetic.train_path, batch_size=10_000, train=True, mean=synthetic.mean, std=synthetic.std)


@pytest.mark.ffcv
def test_loader_three_channels_channels_last(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-py")
    prepared = prepare_dataset(DatasetRequest("cifar10", data_dir=str(tmp_path), val_fraction=0.2), cache_dir=tmp_path / "cache")
    assert prepared.channels == 3 and prepared.mean == (0.4914, 0.4822, 0.4465)
    assert sum(prepared.counts.values()) == 24
    loader = make_loader(prepared.test_path, batch_size=3, train=False, mean=prepared.mean, std=prepared.std, channels_last=True)
    x, y = first_batch(loader)
    assert x.shape == (3, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)
    expected = (torch.tensor([10.0, 20.0, 30.0]) / 255 - torch.tensor(prepared.mean)) / torch.tensor(prepared.std)
    torch.testing.assert_close(x[0, :, 5, 5], expected)


@pytest.mark.ffcv
def test_ffcv_leaves_torch_threads_alone(synthetic):
    torch.set_num_threads(2)
    loader = make_loader(synthetic.test_path, batch_size=100, train=False, mean=synthetic.mean, std=synthetic.std, num_workers=1)
    for _ in loader:
        pass
    assert torch.get_num_threads() == 2


# -- the real data -------------------------------------------------------------------------------


@pytest.mark.ffcv
@pytest.mark.skipif(
    not (FASHION_MNIST / FM_FILES["train_images"]).is_file(),
    reason=f"Fashion-MNIST IDX files not in {FASHION_MNIST} (install Debian's dataset-fashion-mnist)",
)
def test_real_fashion_mnist_small_fraction(tmp_path):
    prepared = prepare_dataset(DatasetRequest("fashion_mnist", train_fraction=0.02), cache_dir=tmp_path)
    assert prepared.counts == {"train": 1080, "val": 6000, "test": 10000}  # 10 x round(0.02 * 5400)
    assert (prepared.num_classes, prepared.image_size, prepared.channels) == (10, 28, 1)
    loader = make_loader(prepared.train_path, batch_size=540, train=True, mean=prepared.mean, std=prepared.std, flip=prepared.flip)
    images, labels = _read_all(loader)
    assert images.shape == (1080, 1, 28, 28)
    assert np.bincount(labels.numpy(), minlength=10).tolist() == [108] * 10


def test_a_failing_loader_thread_raises_instead_of_hanging(synthetic, monkeypatch):
    """FFCV's own iterator waits forever when its thread dies; ours hands the error over."""
    from ffcv.loader.epoch_iterator import EpochIterator

    def broken_pipeline(self, *args, **kwargs):
        raise ValueError("decoder exploded")

    loader = make_loader(synthetic.val_path, batch_size=50, train=False, mean=synthetic.mean,
                         std=synthetic.std, num_workers=1, seed=123)
    monkeypatch.setattr(EpochIterator, "run_pipeline", broken_pipeline)

    def hung(signum, frame):
        raise TimeoutError("the loader hung after its thread failed")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        with pytest.raises(RuntimeError, match="decoder exploded"):
            next(iter(loader))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_ffcv_rgb_images_round_trip_with_its_image_modes_as_a_plain_dict(tmp_path):
    """trainers.data._ffcv hands FFCV's import a plain dict for its numba.typed.Dict of image modes
    (6-10 s of numba compilation per process saved); FFCV's RGB field, which reads it when it writes
    and when its decoder generates code, still round-trips images, and numba's Dict is put back."""
    import numba.typed

    from trainers.data._ffcv import ffcv

    f = ffcv()
    from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from ffcv.transforms import ToTensor

    modes = f.fields.rgb_image.IMAGE_MODES
    assert type(modes) is dict and modes == {"jpg": 0, "raw": 1}  # not compiled by numba
    assert numba.typed.Dict is not dict and numba.typed.Dict.__module__.startswith("numba.")
    images = np.random.default_rng(0).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)

    class Images:
        def __len__(self):
            return len(images)

        def __getitem__(self, i):
            return images[i], i

    path = str(tmp_path / "rgb.beton")
    fields = {"image": f.fields.RGBImageField(write_mode="raw"), "label": f.fields.IntField()}
    f.writer.DatasetWriter(path, fields, num_workers=1).from_indexed_dataset(Images())
    loader = f.loader.Loader(path, batch_size=6, num_workers=1, order=f.loader.OrderOption.SEQUENTIAL,
                             pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()],
                                        "label": [IntDecoder(), ToTensor()]})
    (x, y), = list(loader)
    assert np.array_equal(x.numpy(), images) and y.flatten().tolist() == list(range(6))


def test_a_users_catalog_folder_is_searched_first(tmp_path, monkeypatch):
    import yaml

    from trainers.data import CATALOG_ENV, list_datasets, load_catalog

    mine = tmp_path / "mine"
    mine.mkdir()
    entry = yaml.safe_load((Path(__file__).resolve().parents[3] / "datasets" / "synthetic.yaml").read_text())
    (mine / "tiny_synthetic.yaml").write_text(yaml.safe_dump({**entry, "name": "tiny_synthetic", "n_train": 40}))
    (mine / "synthetic.yaml").write_text(yaml.safe_dump({**entry, "n_train": 44}))  # shadows the shipped one
    monkeypatch.setenv(CATALOG_ENV, str(mine))
    assert {"tiny_synthetic", "synthetic", "fashion_mnist"} <= set(list_datasets())
    assert load_catalog("tiny_synthetic")["n_train"] == 40 and load_catalog("synthetic")["n_train"] == 44
    monkeypatch.delenv(CATALOG_ENV)
    assert "tiny_synthetic" not in list_datasets() and load_catalog("synthetic")["n_train"] != 44

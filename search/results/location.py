"""Where a study lives: a folder, or a URI that every node of a cluster can reach.

``storage`` (the spec's key, ``--storage``) is a path -- on one machine, or a shared mount such
as NFS that every node sees at the same path -- or a URI that pyarrow's filesystems open:
``s3://bucket/prefix``, ``gs://bucket/prefix``, ``hdfs://...``, ``file:///mnt/shared`` (the same
filesystems Ray Tune uses for its ``storage_path``; S3 options go in the query string, e.g.
``s3://bucket/studies?endpoint_override=http://10.0.0.2:9000&scheme=http``).

With a URI:

- Ray Tune writes trial checkpoints and its experiment state there itself, from every node;
- the driver keeps the study's own files (``experiment.json``, the Parquet files, the Optuna
  journal) in a *staging* folder on its machine and uploads each one after every write. An
  upload never leaves a half-written object: object stores (S3, GCS, Azure) make an object
  visible only once its upload completes; on other filesystems the file is written under a
  temporary name and renamed;
- ``python -m search resume URI`` (from any machine with access) and the readers (``pareto``,
  ``search.load``, ...) download those files into the staging folder first.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from trainers.errors import ConfigError

__all__ = ["default_cache_dir", "is_uri", "StudyLocation", "study_location", "resuming_at", "resumed_location", "STUDY_FILES", "JOURNAL_FILE"]

JOURNAL_FILE = "optuna.journal"  # the Optuna study (search.study.searcher.HonestOptunaSearch)
# The study's own files, beside Tune's folder ("ray"): what is uploaded and downloaded.
STUDY_FILES = ("experiment.json", "trials.parquet", "epochs.parquet", "pareto.parquet", "progress.parquet", JOURNAL_FILE,
               "confirm.json", "heldout.json")  # search.study.confirm's plan, search.study.heldout's record
_READ_ATTEMPTS = 5  # StudyLocation.read: tries before an object that keeps changing is an error
_OBJECT_STORES = {"s3", "gcs", "abfs"}  # an upload is all or nothing; no rename needed (nor cheap)
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(location: str | os.PathLike) -> bool:
    return bool(_URI.match(str(location)))


def _check_uri(uri: str) -> None:
    """ConfigError for a URI that names no bucket or path (``s3://``, ``file:///``)."""
    scheme, _, rest = uri.partition("?")[0].partition("://")
    if not rest.strip("/"):
        example = "file:///shared/studies" if scheme == "file" else f"{scheme}://bucket/studies"
        raise ConfigError(f"storage {uri}: no bucket or path after {scheme}://; pass one such as {example}")


# During `search resume`: the study's location now, and the other locations Tune's snapshot named.
_resuming: "tuple[StudyLocation, list[str]] | None" = None


def _unpickled_location(where: str) -> "StudyLocation":
    if _resuming is None:
        return StudyLocation(where)
    location, elsewhere = _resuming
    if where != str(location) and where not in elsewhere:
        elsewhere.append(where)
    return location


def resumed_location() -> "StudyLocation | None":
    """The study `search resume` is restoring (inside `resuming_at`), else None."""
    return None if _resuming is None else _resuming[0]


@contextlib.contextmanager
def resuming_at(location: "StudyLocation") -> Iterator[list[str]]:
    """While a resume unpickles Tune's snapshot (the store, the searcher's journal), every study
    location in it is `location`, the folder or URI the user resumed: a study folder moved or
    copied since it stopped carries on where it is now, not in the old place (which may be
    gone, or hold the original). Yields the old locations met, filled in as they are met."""
    global _resuming
    previous, _resuming = _resuming, (location, [])
    try:
        yield _resuming[1]
    finally:
        _resuming = previous


# Arrow's GCS client retries an unreachable or unauthorised bucket for 15 minutes by default: a
# command on a gs:// study without network or credentials looked hung. Ask for a bound instead.
GCS_RETRY_LIMIT_S = 30


def _bounded_retries(uri: str) -> str:
    """``uri`` with a retry limit where its scheme retries unbounded by default and it sets none."""
    if not uri.startswith("gs://") or "retry_limit_seconds=" in uri:
        return uri
    return f"{uri}{'&' if '?' in uri else '?'}retry_limit_seconds={GCS_RETRY_LIMIT_S}"


def default_cache_dir() -> Path:
    """Where converted datasets (.beton files) are kept between studies; staged study files go
    beside it (``studies/``)."""
    env = os.environ.get("LOCALITY_SEARCH_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "locality-search" / "datasets"


def _staging_root() -> Path:
    return default_cache_dir().parent / "studies"


class StudyLocation:
    """One study's place: ``local`` is the folder the driver reads and writes; with a URI it
    is a staging copy, and ``push``/``pull`` move the study files to and from the URI."""

    def __init__(self, location: str | os.PathLike) -> None:
        self.uri = str(location) if is_uri(location) else None
        if self.uri is None:
            self.local = Path(location).expanduser().resolve()
            self.fs, self.path = None, None
            return
        import pyarrow.fs

        _check_uri(self.uri)
        try:
            self.fs, self.path = pyarrow.fs.FileSystem.from_uri(_bounded_retries(self.uri))
        except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError, OSError) as exc:
            raise ConfigError(f"storage {self.uri}: pyarrow cannot open it ({str(exc).splitlines()[0]}); "
                              "use a path, or an s3://, gs://, hdfs:// or file:// URI") from None
        self.path = self.path.rstrip("/")
        digest = hashlib.sha256(self.uri.encode()).hexdigest()[:16]
        self.local = _staging_root() / f"{Path(self.path).name or 'study'}-{digest}"

    def __repr__(self) -> str:
        return f"StudyLocation({self.uri or str(self.local)!r})"

    def __str__(self) -> str:
        return self.uri or str(self.local)

    # pyarrow filesystems pickle, but the staging folder is this machine's: rebuild it from the
    # URI wherever the location is unpickled (Tune restores the store on another machine), and
    # during a resume take the study's location now (see `resuming_at`).
    def __reduce__(self):
        return (_unpickled_location, (self.uri or str(self.local),))

    # -- Tune -------------------------------------------------------------------------------
    def tune_storage(self) -> tuple[str, object | None]:
        """``(storage_path, storage_filesystem)`` for Tune's RunConfig and Tuner.restore."""
        if self.uri is None:
            return str(self.local), None
        return self.path, self.fs

    def tune_dir(self, name: str = "ray") -> str:
        return f"{self.path}/{name}" if self.uri else str(self.local / name)

    # -- files ------------------------------------------------------------------------------
    def unreachable(self, exc: OSError) -> ConfigError:
        """The one-line error for a storage URI that cannot be read or written."""
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return ConfigError(f"storage {self.uri}: cannot reach it ({reason}); check the URI, the credentials "
                           "(e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS) and the network")

    def exists(self, name: str) -> bool:
        if self.uri is None:
            return (self.local / name).exists()
        import pyarrow.fs

        try:
            return self.fs.get_file_info(f"{self.path}/{name}").type != pyarrow.fs.FileType.NotFound
        except OSError as exc:
            raise self.unreachable(exc) from None

    def push(self, names: Iterable[str] = STUDY_FILES) -> None:
        """Upload the staged files ``names`` (those that exist) to the URI, each all or nothing."""
        if self.uri is None:
            return
        self.fs.create_dir(self.path, recursive=True)
        for name in names:
            source = self.local / name
            if not source.is_file():
                continue
            target = f"{self.path}/{name}"
            direct = self.fs.type_name in _OBJECT_STORES
            temporary = target if direct else f"{self.path}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
            with open(source, "rb") as src, self.fs.open_output_stream(temporary) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if not direct:
                self.fs.move(temporary, target)

    def read(self, name: str) -> bytes | None:
        """The study file ``name`` as one upload of it wrote it (None where there is none yet).

        An upload replaces the whole object, but a reader can still mix two of them: pyarrow
        looks up the size first and then fetches byte ranges, so an upload landing in between
        gives a truncated or spliced copy (seen: a Parquet file without its footer while the
        driver uploaded). So the object is fetched in one request and kept only if its size
        and time are the same before and after and the bytes are that size; else read again."""
        if self.uri is None:
            path = self.local / name
            return path.read_bytes() if path.is_file() else None  # written by rename: whole
        import pyarrow.fs

        source = f"{self.path}/{name}"
        try:
            for attempt in range(_READ_ATTEMPTS):
                before = self.fs.get_file_info(source)
                if before.type != pyarrow.fs.FileType.File:
                    return None
                with self.fs.open_input_file(source) as src:
                    data = src.read()
                after = self.fs.get_file_info(source)
                if len(data) == before.size == after.size and before.mtime == after.mtime:
                    return data
                time.sleep(0.1 * (attempt + 1))  # an upload is landing: let it finish
        except OSError as exc:
            raise self.unreachable(exc) from None
        raise ConfigError(f"storage {self.uri}: {name} changed during each of {_READ_ATTEMPTS} reads; "
                          "try again, or once the study's driver stops writing it")

    def pull(self, names: Iterable[str] = STUDY_FILES) -> list[str]:
        """Download ``names`` (those the URI has) into the staging folder; the names fetched."""
        if self.uri is None:
            return [n for n in names if (self.local / n).is_file()]
        fetched = []
        for name in names:
            data = self.read(name)
            if data is None:
                continue
            self.local.mkdir(parents=True, exist_ok=True)  # (not for a URI that holds no study)
            staged = self.local / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
            staged.write_bytes(data)
            os.replace(staged, self.local / name)
            fetched.append(name)
        return fetched


def study_location(storage: str | os.PathLike, name: str | None = None) -> StudyLocation:
    """The study ``name`` under ``storage`` (a path or URI), or the study at ``storage`` itself."""
    if name is None:
        return StudyLocation(storage)
    if is_uri(storage):
        _check_uri(str(storage))  # (else "s3://" + name would be a relative path)
        base, sep, query = str(storage).partition("?")  # s3://bucket/prefix?endpoint_override=...
        return StudyLocation(f"{base.rstrip('/')}/{name}{sep}{query}")
    return StudyLocation(Path(storage).expanduser() / name)

"""Settings for the whole test session.

pyproject's addopts run the tests on two pytest-xdist workers (`-n 2 --dist loadfile`: a file's
tests stay together, so its module fixtures run once): most of the slow tests wait on processes
(Ray clusters, drivers, trial workers) rather than compute, so two at once take about a quarter
less wall time on the 2-core CI machine. Each worker's own torch ops get one thread, so a worker
computing beside another one's Ray trials does not oversubscribe the cores (OpenMP threads that
outnumber the cores spin against each other: a 7 s test took 94 s that way). `-n 0` runs serially.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests import _hardware

_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
# the local clusters the tests start (in this process or in `search run` subprocesses) go without
# Ray's dashboard: its processes cost a few CPU seconds per start, on a machine saturated by two
# workers; tests/search/study/test_end_to_end.py turns it on to check the URL that `run` prints
os.environ.setdefault("LOCALITY_SEARCH_RAY_DASHBOARD", "0")
RAY_TEST_SECONDS = 30  # a ray test's length where its marker gives none


def pytest_collection_modifyitems(config, items):
    """A test marked with hardware this machine lacks (cuda, triton, avx2, avx512, avx512_bf16,
    chromium) is skipped, saying what it needs; the markers are the only hardware gates.

    Files with ``ray`` tests (the slow ones: minutes each) go first, the longest first: xdist hands
    out files in this order, so the long ones start early and the short ones fill in beside them,
    instead of one worker running the last long file while the other waits (longest processing
    time first, Graham 1969; pyproject's --no-loadscope-reorder keeps xdist from sorting the files by
    their number of tests instead, which put the ray files, a few tests each, last). A file's length: its ray tests' ``seconds`` (``pytest.mark.ray(seconds=N)``,
    as measured in a clean-clone run's --durations), 30 for one that gives none."""
    for item in items:
        for name in dict.fromkeys(mark.name for mark in item.iter_markers()):
            reason = name in _hardware.MARKERS and _hardware.missing(name)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
                break
    length: dict = {}
    for item in items:
        mark = item.get_closest_marker("ray")
        if mark:
            length[item.path] = length.get(item.path, 0) + mark.kwargs.get("seconds", RAY_TEST_SECONDS)
    items.sort(key=lambda item: -length.get(item.path, 0))  # stable: the order within a file stays


@pytest.fixture(autouse=True)
def _one_torch_thread_per_xdist_worker():
    if _XDIST_WORKER:
        torch.set_num_threads(1)  # per test: a test may set its own (test_data sets 2)
    yield


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_running():
    """A test file that starts Ray in this process (``main(["run", ...])`` leaves it up, as the CLI's
    process ends there) must not hand it to the next file on this xdist worker: a test that starts
    its own local cluster would fail with "called ray.init twice". Per file, not per test: a file's
    tests may share one cluster (a module fixture, torn down before this one)."""
    yield
    import sys

    ray = sys.modules.get("ray")  # a file that never imported Ray started none
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture()
def s3(monkeypatch):
    """A real S3-protocol server (moto's) on loopback, with credentials in the environment."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)
    yield f"endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    server.stop()


@pytest.fixture()
def s3_storage(s3) -> str:
    """A storage URI on the `s3` server, its bucket created: s3://bucket/studies?<options>."""
    import pyarrow.fs

    storage = f"s3://bucket/studies?{s3}"
    pyarrow.fs.FileSystem.from_uri(storage + "&allow_bucket_creation=true")[0].create_dir("bucket")
    return storage

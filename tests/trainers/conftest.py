"""Fixtures for the trainers' tests."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest

from trainers import kernels


@pytest.fixture
def kernel_backends() -> Iterator[Callable[..., kernels.Backends]]:
    """``kernel_backends(name=flag, ...)``: `kernels.backends` for the rest of the test (as
    monkeypatch sets an attribute), the selection before the first call back at teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda **switches: stack.enter_context(kernels.backends(**switches))

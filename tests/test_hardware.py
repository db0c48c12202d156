"""The hardware markers: each one pyproject.toml declares has its check in tests/_hardware.py, and
tests/conftest.py's hook skips a marked test exactly where this machine lacks what it names."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests import _hardware

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_every_declared_hardware_marker_has_a_check():
    markers = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]["markers"]
    declared = {line.split(":")[0].strip() for line in markers}
    assert declared - {"ray", "ffcv"} == set(_hardware.MARKERS)


@pytest.mark.parametrize("name", [pytest.param(name, marks=getattr(pytest.mark, name)) for name in _hardware.MARKERS])
def test_a_marked_test_runs_only_where_its_hardware_is_here(name):
    assert _hardware.missing(name) is None  # else the hook should have skipped it

"""./with-deps respects the user's environment: an active venv it was not asked to use is left
alone, and it leaves no temporary file behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_an_active_venv_is_left_alone_and_nothing_is_left_in_tmp(tmp_path):
    venv = Path(sys.prefix)
    if venv.parent.name != "locality-search" or venv.name != "venv":
        pytest.skip(f"the suite runs in {venv}, not ./with-deps' default venv: nothing to compare the default against")
    foreign = tmp_path / "their-venv"  # the user's own, active
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCALITY_SEARCH_VENV", "LOCALITY_SEARCH_USE_ACTIVE_VENV")}
    env.update(VIRTUAL_ENV=str(foreign), XDG_CACHE_HOME=str(venv.parent.parent), TMPDIR=str(tmp),
               LOCALITY_SEARCH_NO_APT="1")
    done = subprocess.run([str(ROOT / "with-deps"), "python", "-c", "import sys; print(sys.prefix)"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(venv)  # ran in its own venv
    assert f"not installing into the active {foreign}" in done.stderr
    assert not foreign.exists()  # the user's venv untouched (here: not even created)
    assert list(tmp.iterdir()) == []  # no temporary file left

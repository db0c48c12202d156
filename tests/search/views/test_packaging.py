"""The Pareto page is package data: its files are found through importlib.resources (not a path
into a checkout), and pyproject's package-data ships every one of them."""

from __future__ import annotations

import fnmatch
import importlib.resources
import tomllib
from pathlib import Path

from search.views.dashboard import STATIC_DIR, render_page

ROOT = Path(__file__).resolve().parents[3]
PAGE_FILES = ("pareto.html", "pareto.css", "pareto.js")


def test_static_files_are_package_resources():
    static = importlib.resources.files("search.views.dashboard") / "static"
    assert all((static / name).is_file() for name in PAGE_FILES)
    assert str(STATIC_DIR) == str(static)
    page = render_page()
    assert all((static / name).read_text().strip().splitlines()[-1] in page for name in ("pareto.css", "pareto.js"))


def test_package_data_ships_every_static_file():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["search.views.dashboard"]
    static = Path(str(importlib.resources.files("search.views.dashboard") / "static"))
    files = sorted(p.relative_to(static.parent).as_posix() for p in static.iterdir() if p.is_file())
    assert set(PAGE_FILES) <= {Path(f).name for f in files}
    unshipped = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert unshipped == [], f"add these to [tool.setuptools.package-data] in pyproject.toml: {unshipped}"

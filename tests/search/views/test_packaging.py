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


def test_the_built_wheel_holds_the_catalog_and_finds_it_outside_the_checkout(tmp_path):
    """`pip wheel .` as a packager builds it; the wheel, unpacked away from the checkout, lists the
    shipped datasets and loads their entries (an installed copy once answered 'known: none')."""
    import os
    import subprocess
    import sys
    import zipfile

    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("locality_search-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).name for n in names if n.startswith("trainers/data/catalog/")}
    assert {p.name for p in (ROOT / "datasets").glob("*.yaml")} <= shipped
    assert "search/views/dashboard/static/pareto.js" in names and "trainers/kernels/csrc/attention_core.cpp" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = ("import trainers.data as d, search; "
             "assert 'fashion_mnist' in d.list_datasets(), d.list_datasets(); "
             "assert d.load_catalog('synthetic')['format'] == 'synthetic'; "
             "assert str(d.CATALOG_DIR).startswith(%r); print(search.__file__)" % str(site))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith(str(site))  # the wheel's copy, not the checkout's

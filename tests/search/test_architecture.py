"""The architecture holds: import-linter's contracts (pyproject.toml: search's layers, trainers
never importing search, private modules kept private, trainers.kernels knowing nothing of the
families), no import cycle among the modules of search and trainers, and `import search` (what
`search pareto` starts with) importing neither torch nor Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("search", "trainers")


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every import cycle of ``graph``: its strongly connected components of more than one module,
    and the modules that import themselves (Tarjan's algorithm, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in edges:
                    continue  # outside the packages
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(edges[succ])))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in edges[node]:
                        cycles.append(sorted(component))
    return cycles


def test_import_cycles_are_found():
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c", "p.d", "p.e"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")  # a -> b -> c -> a
    graph.add_import(importer="p.c", imported="p.d")
    graph.add_import(importer="p.e", imported="p.e")  # one module importing itself
    assert sorted(import_cycles(graph)) == [["p.a", "p.b", "p.c"], ["p.e"]]


def test_no_import_cycle():
    # grimp reads every import statement, also those inside functions and under TYPE_CHECKING:
    # an import made lazy only to dodge a cycle still counts.
    cycles = import_cycles(grimp.build_graph(*PACKAGES, cache_dir=None))
    assert cycles == [], "import cycles (break each one: move the shared piece down a layer): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_import_linter_contracts_kept():
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_import_search_is_light():
    # `python -m search pareto` (and every reader) starts by importing the package and its CLI
    code = ("import sys, search, search.views.cli; "
            "print(sorted(m for m in ('torch', 'ray', 'optuna', 'timm', 'ffcv') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_trainers_public_api_resolves():
    import trainers

    missing = [name for name in trainers.__all__ if getattr(trainers, name, None) is None]
    assert missing == []
    with pytest.raises(AttributeError):
        trainers.no_such_name  # noqa: B018

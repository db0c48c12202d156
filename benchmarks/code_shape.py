"""Code shape: front computations, output formatters, private names imported across modules, the largest modules and functions.

What a newcomer meets, counted the same way before and after a refactor (``python -m
benchmarks code_shape [--out PATH]``). The counts are syntactic (Python's ``ast``), so they are
exact for what they count:

- front computations: calls of the functions that take a Pareto front (``pareto_mask``,
  ``pareto_front``, ``config_front``, ``compute_front`` and the old ``_complete_front``) outside
  the module that defines the rule (``search/results/pareto.py``) and tests; and the functions
  of ``search/`` that call the dominance rule itself (``pareto_mask``/``pareto_front``): each is
  a pipeline of its own from rows to a front;
- formatters: functions named ``format_*`` or ``render_*`` that turn results into text;
- private cross-module imports: ``from a.b import _name`` or ``import a._b`` where the private
  name is not defined in the importing module's own package;
- the ten largest modules (lines) and functions (lines from ``def`` to its last line).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("search", "trainers", "benchmarks")
FRONT_CALLS = {"pareto_mask", "pareto_front", "config_front", "compute_front", "_complete_front"}


def _modules(folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).parent.parts)


def _inside(own: str, package: str) -> bool:
    """Whether the package ``own`` is ``package`` or under it (where ``package``'s private modules may be imported)."""
    return own == package or own.startswith(package + ".")


def _private_imports(path: Path, tree: ast.AST) -> list[str]:
    """Private names this module takes from outside their package: a private module
    (``trainers._x``) imported from outside ``trainers``, or a private name (``from a.b import
    _c``) imported from another module. Third-party libraries' private names count too."""
    own = _package_of(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            # a private module on the path (trainers._x), or a private name (from a import _b)
            private_mod = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
            if private_mod is not None and not _inside(own, ".".join(parts[:private_mod])):
                out.append(f"from {node.module} import {', '.join(names)}")
            elif private_mod is None and any(n.startswith("_") and not n.startswith("__") for n in names) \
                    and node.module != own:  # a package's own private submodules are its own
                out.append(f"from {node.module} import {', '.join(n for n in names if n.startswith('_'))}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                i = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
                if i is not None and not _inside(own, ".".join(parts[:i])):
                    out.append(f"import {alias.name}")
    return out


def measure() -> dict:
    front_calls: list[str] = []
    front_pipelines: list[str] = []
    formatters: list[str] = []
    private: dict[str, list[str]] = {}
    third_party: dict[str, list[str]] = {}
    sizes: list[tuple[int, str]] = []
    functions: list[tuple[int, str]] = []
    for path in _modules(PACKAGES):
        rel = str(path.relative_to(ROOT))
        source = path.read_text()
        tree = ast.parse(source)
        sizes.append((len(source.splitlines()), rel))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in FRONT_CALLS and rel != "search/results/pareto.py":
                    front_calls.append(f"{rel}:{node.lineno} {name}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and rel.startswith("search/") \
                    and rel != "search/results/pareto.py":
                calls = {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", None)
                         for c in ast.walk(node) if isinstance(c, ast.Call)}
                if calls & {"pareto_mask", "pareto_front"}:
                    front_pipelines.append(f"{rel}:{node.lineno} {node.name}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name.startswith(("format_", "render_")) and rel.startswith("search/"):
                    formatters.append(f"{rel}:{node.lineno} {node.name}")
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
        found = _private_imports(path, tree)
        ours = [f for f in found if f.split()[1].split(".")[0] in PACKAGES]
        if ours:
            private[rel] = ours
        if len(ours) < len(found):
            third_party[rel] = [f for f in found if f not in ours]
    tests_private = 0
    test_files = _modules(("tests",))
    for path in test_files:
        if any(f.split()[1].split(".")[0] in PACKAGES for f in _private_imports(path, ast.parse(path.read_text()))):
            tests_private += 1
    return {
        "front_computations": {"count": len(front_calls), "where": front_calls},
        "functions_calling_the_dominance_rule": {"count": len(front_pipelines), "where": front_pipelines},
        "formatters": {"count": len(formatters), "where": formatters},
        "private_cross_module_imports": {"count": sum(map(len, private.values())), "where": private},
        "private_third_party_imports": {"count": sum(map(len, third_party.values())), "where": third_party},
        "test_files_importing_private_names": {"count": tests_private, "of": len(test_files)},
        "largest_modules": [{"lines": n, "module": m} for n, m in sorted(sizes, reverse=True)[:10]],
        "largest_functions": [{"lines": n, "function": f} for n, f in sorted(functions, reverse=True)[:10]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here as well")
    args = parser.parse_args()
    result = measure()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

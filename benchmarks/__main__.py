"""``python -m benchmarks NAME [ARGS]``: run one benchmark (``python -m benchmarks`` lists them).

Each benchmark is also a module of its own (``python -m benchmarks.NAME``); every one prints
ratios measured side by side in one run and writes JSON with the environment to
``benchmarks/results/``.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def available() -> dict[str, str]:
    """name -> the first line of its docstring."""
    out = {}
    for info in pkgutil.iter_modules([str(Path(__file__).resolve().parent)]):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"benchmarks.{info.name}")
        out[info.name] = (module.__doc__ or "").strip().splitlines()[0]
    return out


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m benchmarks NAME [ARGS]\n")
        for name, line in sorted(names.items()):
            print(f"  {name:<20} {line}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"error: no benchmark {name!r}; choose one of {', '.join(sorted(names))}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{name}")
    sys.argv = [f"python -m benchmarks {name}", *rest]
    module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

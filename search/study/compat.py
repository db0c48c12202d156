"""Names that moved, still found where Tune's snapshots of earlier studies look for them.

Tune pickles a study's searcher, its space and the trial-naming functions into its snapshot
(``tuner.pkl``, the searcher's state) by module and name. A study started before a name moved
resumes only if that module still answers for it: ``__getattr__ = moved_names(__name__, {...})``
at the bottom of the old module (PEP 562) imports the new one when, and only when, asked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names"]


def moved_names(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving each name of ``moved`` (name -> the module it moved to)."""

    def __getattr__(name: str) -> Any:
        if name in moved:
            return getattr(importlib.import_module(moved[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__

"""A recorded grid whose model is a choice (``record_curves``' ``zoo``): the conditional space of
``spaces/locality_zoo.yaml`` as the replay's searchers meet it.

A configuration is one value per knob, in the grid's column order (``model`` first), with None for
the knobs its model lacks, as a study's rows hold null there. Every searcher of the replay asks
for ``model`` first and then only that model's knobs (Optuna's define-by-run, as
``search.study.searcher.OptunaSpace`` asks a conditional spec; ConfigSpace conditions for SMAC and
DEHB); a searcher without conditions (Syne Tune) proposes every knob, and ``_peers.snap`` drops
the ones the model lacks.
"""

from __future__ import annotations

__all__ = ["ConditionalGrid", "active_knobs", "recorded_grid"]


class ConditionalGrid(dict):
    """knob -> its recorded values (``model`` first), and ``models``: model -> its knobs (its own
    and the shared ones), in column order."""

    def __init__(self, values: dict[str, list], models: dict[str, tuple[str, ...]]):
        super().__init__(values)
        self.models = models


def active_knobs(grid: dict, config: tuple) -> list[str]:
    """The knobs a configuration has: every knob of a plain grid; ``model`` and the model's own
    and shared knobs of a conditional one."""
    if isinstance(grid, ConditionalGrid):
        return ["model", *grid.models[config[0]]]
    return list(grid)


def recorded_grid(chosen: dict, curves: dict[tuple, dict]) -> dict:
    """The grid the searchers draw from: each knob's values among the recorded configurations
    (``curves``' keys, in the grid's column order); a ``ConditionalGrid`` for an entry of
    ``record_curves.GRIDS`` with ``models``, a plain dict otherwise."""
    from benchmarks.record_curves import knob_values

    columns = list(knob_values(chosen))
    values = {k: sorted({key[i] for key in curves if key[i] is not None}) for i, k in enumerate(columns)}
    if "models" not in chosen:
        return values
    models = {m: tuple(k for k in columns if k in space or k in chosen["grid"])
              for m, space in chosen["models"].items() if m in values["model"]}
    return ConditionalGrid({**values, "model": [m for m in chosen["models"] if m in models]}, models)

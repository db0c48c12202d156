"""The replay on a conditional recording (benchmarks._conditional, record_curves' zoo): the model is
a choice and each model has its own knobs. Every method asks for recorded configurations only, with
None for the knobs their model lacks; the mapping and the GP's encoding on values worked out by hand."""

from __future__ import annotations

import pyarrow as pa
import pytest

from benchmarks import _peers
from benchmarks._conditional import ConditionalGrid, active_knobs, recorded_grid
from benchmarks.record_curves import grid_configs, knob_values, schema
from benchmarks.replay_search import BOTORCH, GROUP, LATE, METHODS, RUNG, load_curves, replay
from search.results.hypervolume import hypervolume
from search.results.store import write_atomic

CHOSEN = {"models": {"a": {"depth": [1, 2]}, "b": {"width": [16, 32, 64]}}, "grid": {"lr": [0.001, 0.004]}}
EPOCHS = 4


def _recording(tmp_path):
    rows = []
    for config_id, config in enumerate(grid_configs(CHOSEN)):
        size = config["depth"] * 40 if config["model"] == "a" else config["width"]
        final = 0.5 + 0.002 * size + (0.02 if config["lr"] > 0.002 else 0.0)
        for epoch in range(1, EPOCHS + 1):
            acc = final * epoch / EPOCHS
            rows.append({"config_id": config_id, **config, "epoch": epoch, "max_epochs": EPOCHS, "val_acc": acc,
                         "best_val_acc": acc, "val_loss": 1 - acc, "params": size, "throughput": 1e4 / size,
                         "epoch_time_s": 1.0, "throughput_device": "cpu: test"})
    path = tmp_path / "curves.parquet"
    write_atomic(pa.Table.from_pylist(rows, schema=schema(knob_values(CHOSEN))), path)
    curves, epochs = load_curves(path, knob_values(CHOSEN))
    return curves, epochs, recorded_grid(CHOSEN, curves)


def test_a_conditional_grid_is_each_models_knobs_crossed_with_the_shared_ones(tmp_path):
    configs = grid_configs(CHOSEN)
    assert len(configs) == 2 * 2 + 3 * 2
    assert configs[0] == {"model": "a", "depth": 1, "width": None, "lr": 0.001}
    assert configs[-1] == {"model": "b", "depth": None, "width": 64, "lr": 0.004}
    curves, epochs, grid = _recording(tmp_path)
    assert len(curves) == 10 and epochs == EPOCHS and ("b", None, 32, 0.004) in curves
    assert isinstance(grid, ConditionalGrid) and list(grid) == ["model", "depth", "width", "lr"]
    assert grid.models == {"a": ("depth", "lr"), "b": ("width", "lr")}
    assert active_knobs(grid, ("b", None, 16, 0.001)) == ["model", "width", "lr"]


def test_a_proposal_goes_to_its_models_nearest_recorded_configuration_by_hand(tmp_path):
    curves, _, grid = _recording(tmp_path)
    # the knob model a lacks is dropped: then it is recorded
    assert _peers.snap(grid, curves, ("a", 2, 64, 0.004)) == ("a", 2, None, 0.004)
    # b lacks depth; width 40 is nearest 32 (positions 0, 0.5, 1 of 16, 32, 64)
    assert _peers.snap(grid, curves, ("b", 1, 40, 0.001)) == ("b", None, 32, 0.001)
    # a GP's input: the model one-hot, each knob's position, 0 where the model lacks it
    assert _peers.encode(grid, ("a", 2, None, 0.004)) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert _peers.encode(grid, ("b", None, 32, 0.001)) == [0.0, 1.0, 0.0, 0.5, 0.0]


@pytest.mark.parametrize("method", [m for m in (*METHODS, *LATE, *RUNG, *GROUP, *_peers.STRONG) if not m.startswith("syne")])
def test_every_method_asks_recorded_configurations_with_none_where_the_model_lacks_a_knob(tmp_path, method,
                                                                                          monkeypatch):
    for module in _peers.imports(method):
        pytest.importorskip(module)
    curves, epochs, grid = _recording(tmp_path)
    asked, real_snap = [], _peers.snap

    def snap(grid, recorded, proposal):  # the real mapping, its answers kept
        asked.append(real_snap(grid, recorded, proposal))
        return asked[-1]

    monkeypatch.setattr(_peers, "snap", snap)
    finals = [[c["best"][-1], c["log_throughput"]] for c in curves.values()]
    reference = [min(p[0] for p in finals), min(p[1] for p in finals)]
    history = replay(method, curves=curves, grid=grid, epochs=epochs, budget=8 * EPOCHS, seed=2, reference=reference)
    resumes = method in ("smac-ParEGO+HB", "dehb")  # pays only a resumed trial's extra epochs: may run dry first
    assert history[-1][0] == 8 * EPOCHS or (resumes and history[-1][0] < 8 * EPOCHS)
    assert history[-1][1] <= hypervolume(finals, modes=["max", "max"], reference=reference) * (1 + 1e-9)
    assert asked and set(asked) <= set(curves)
    assert {c[0] for c in asked} <= {"a", "b"}


def test_smac_and_dehb_see_a_knob_only_under_the_models_that_have_it(tmp_path):
    pytest.importorskip("ConfigSpace")
    _, _, grid = _recording(tmp_path)
    space = _peers._config_space(grid, seed=0)
    for config in space.sample_configuration(20):
        values = dict(config)
        assert ("depth" in values) == (values["model"] == "a") and ("width" in values) == (values["model"] == "b")
        assert "lr" in values


@pytest.mark.parametrize("method", BOTORCH)
def test_the_specs_botorch_refuses_a_conditional_grid_as_a_spec_does(tmp_path, method):
    curves, epochs, grid = _recording(tmp_path)
    with pytest.raises(SystemExit, match="refuses a conditional space"):
        replay(method, curves=curves, grid=grid, epochs=epochs, budget=8, seed=0, reference=[0.0, 0.0])


def test_every_configuration_of_the_zoo_builds_as_recorded():
    from benchmarks.record_curves import GRIDS, model_and_args
    from search.spec.meta import build_on_meta

    configs = grid_configs(GRIDS["zoo"])
    assert len(configs) == len({tuple(c.values()) for c in configs}) == 90
    for config in configs:
        model, args = model_and_args(GRIDS["zoo"], config)
        built = build_on_meta(model, args)
        assert isinstance(built, type), (config, built)  # a class, not the exception a build raised


def test_botorch_on_a_conditional_grid_fits_its_gp_and_proposes_unasked_recorded_configurations(tmp_path):
    pytest.importorskip("botorch")
    curves, _, grid = _recording(tmp_path)
    bo = _peers.DiscreteQNEHVI(grid, curves, seed=0)
    bo.startup = 3  # the GP's proposals from the fourth on (the replay's 10 would exhaust this grid)
    asked = []
    for _ in range(10):
        config = bo.propose(set(asked))
        asked.append(config)
        bo.tell(config, [curves[config]["best"][-1], curves[config]["log_throughput"]])
    assert bo._scored_at >= 3 and len(set(asked)) == 10 and set(asked) == set(curves)

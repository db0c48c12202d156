"""The search-efficiency replay (benchmarks.replay_search) on a small made-up recording: budgets
are kept, fronts hold only full-budget trials, and the recording's points are what is searched;
its statistics (Holm, ranks, Friedman) on numbers worked out by hand."""

from __future__ import annotations

import itertools
import math

import optuna
import pyarrow as pa
import pytest

from benchmarks.record_curves import schema
from benchmarks import _peers
from benchmarks.replay_search import (GROUP, LATE, METHODS, RUNG, at_epochs, epochs_to_reach, friedman, holm, load_curves, ranks,
                                      replay)
from search.results.hypervolume import hypervolume
from search.results.store import write_atomic

GRID = {"depth": [1, 2, 3], "embed_dim": [16, 32], "lr": [0.001, 0.004]}
EPOCHS = 4


def _recording(tmp_path, skip=()):
    rows = []
    for config_id, (depth, width, lr) in enumerate(itertools.product(*GRID.values())):
        if (depth, width, lr) in skip:
            continue
        final = 0.5 + 0.05 * depth + 0.001 * width + (0.02 if lr > 0.002 else 0.0)
        for epoch in range(1, EPOCHS + 1):
            acc = final * epoch / EPOCHS
            rows.append({"config_id": config_id, "depth": depth, "embed_dim": width, "lr": lr, "epoch": epoch,
                         "max_epochs": EPOCHS, "val_acc": acc, "best_val_acc": acc, "val_loss": 1 - acc,
                         "params": depth * width, "throughput": 1e5 / (depth * width), "epoch_time_s": 1.0,
                         "throughput_device": "cpu: test"})
    path = tmp_path / "curves.parquet"
    write_atomic(pa.Table.from_pylist(rows, schema=schema(GRID)), path)
    return path


@pytest.mark.parametrize("method", [m for m in (*METHODS, *LATE, *RUNG, *GROUP, *_peers.STRONG) if not m.startswith("syne")])
def test_every_method_keeps_the_budget_and_fronts_hold_full_budget_trials_only(tmp_path, method):
    for module in _peers.imports(method):
        pytest.importorskip(module)
    curves, epochs = load_curves(_recording(tmp_path), GRID)
    assert len(curves) == 12 and epochs == EPOCHS
    finals = [[c["best"][-1], c["log_throughput"]] for c in curves.values()]
    reference = [min(p[0] for p in finals), min(p[1] for p in finals)]
    true = hypervolume(finals, modes=["max", "max"], reference=reference)
    history = replay(method, curves=curves, grid=GRID, epochs=epochs, budget=6 * EPOCHS, seed=3, reference=reference)
    spent = [s for s, _ in history]
    assert spent == sorted(spent) and spent[-1] == 6 * EPOCHS  # the budget, all of it, no more
    assert all(0.0 <= v <= true * (1 + 1e-9) for _, v in history)
    if "ASHA" not in method and method not in ("smac-ParEGO+HB", "dehb"):  # no stopping: every trial runs in full
        assert spent == [EPOCHS * (i + 1) for i in range(6)]
    # without noise the volume never falls, even in the last bit (one front summed in another order)
    volumes = [v for _, v in history]
    assert volumes == sorted(volumes) and at_epochs(history, 0) == 0.0 and at_epochs(history, spent[-1]) == volumes[-1]
    assert epochs_to_reach(history, history[-1][1]) <= spent[-1] and epochs_to_reach(history, 2 * true) is None


def test_a_search_is_the_same_for_the_same_seed(tmp_path):
    curves, epochs = load_curves(_recording(tmp_path), GRID)
    runs = [replay("tpe+MO-ASHA", curves=curves, grid=GRID, epochs=epochs, budget=40, seed=1, reference=[0.0, 0.0])
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_syne_tune_reads_its_rung_ranking_as_indices_and_the_fix_as_ranks():
    pytest.importorskip("syne_tune")
    from benchmarks.replay_search import syne_tune_ranking_check

    assert syne_tune_ranking_check() == {"as shipped": "STOP", "fixed": "CONTINUE"}


def test_a_multi_fidelity_peer_resumes_a_configuration_asked_again_at_a_higher_fidelity(tmp_path):
    pytest.importorskip("dehb")
    curves, epochs = load_curves(_recording(tmp_path), GRID)
    history = replay("dehb", curves=curves, grid=GRID, epochs=epochs, budget=60, seed=0, reference=[0.0, 0.0])
    # twelve configurations of four epochs hold 48 epochs in all: a search that resumes never pays more
    assert history[-1][0] <= 48 and len(history) > 12


def test_a_gp_sampler_proposes_recorded_points_after_its_start_up_trials(tmp_path):
    curves, epochs = load_curves(_recording(tmp_path), GRID)
    asks: list[float] = []
    history = replay("gp", curves=curves, grid=GRID, epochs=epochs, budget=12 * EPOCHS, seed=0, reference=[0.0, 0.0],
                     asks=asks)
    assert len(history) == 12 and len(asks) == 12  # 10 start-up trials, then two GP proposals


def test_botorch_on_the_grid_proposes_recorded_configurations_it_has_not_asked_after_its_start_up(tmp_path):
    pytest.importorskip("botorch")
    curves, epochs = load_curves(_recording(tmp_path), GRID)
    bo = _peers.DiscreteQNEHVI(GRID, curves, seed=0)
    asked = []
    for _ in range(12):  # 10 random, then 2 from the GP's acquisition
        config = bo.propose(set(asked))
        asked.append(config)
        bo.tell(config, [curves[config]["best"][-1], curves[config]["log_throughput"]])
    assert len(set(asked)) == 12 and set(asked) <= set(curves)
    with pytest.raises(_peers.Exhausted):  # all 12 asked: nothing left to propose
        bo.propose(set(asked))


def test_botorch_on_the_grid_fits_once_per_trial_told_and_proposes_what_botorchs_optimiser_picks(tmp_path):
    """Between two COMPLETE trials (a stopped one tells nothing) the proposals come from one fit's
    scores; they are the ones optimize_acqf_discrete gives when called afresh for every proposal."""
    pytest.importorskip("botorch")
    import torch
    from botorch.optim import optimize_acqf_discrete

    curves, _ = load_curves(_recording(tmp_path), GRID)

    class Fresh(_peers.DiscreteQNEHVI):  # BoTorch's optimiser on every proposal (what it was before)
        def propose(self, asked):
            free = [c for c in self._configs if c not in asked]
            if len(self._told) < self.startup:
                return self._rng.choice(free)
            choices = torch.tensor([self._x[c] for c in free], dtype=torch.float64)
            best, _ = optimize_acqf_discrete(self.acquisition_function(), q=1, choices=choices)
            return free[int(torch.cdist(best, choices).argmin())]

    def search(bo) -> list:
        asked = []
        for number in range(11):
            config = bo.propose(set(asked))
            asked.append(config)
            if number < 4 or number % 3 == 0:  # the others "stopped" by MO-ASHA: not told
                bo.tell(config, [curves[config]["best"][-1], curves[config]["log_throughput"]])
        return asked

    cached, fresh = _peers.DiscreteQNEHVI(GRID, curves, seed=3), Fresh(GRID, curves, seed=3)
    cached.startup = fresh.startup = 4
    fits = []
    original = cached.acquisition_function
    cached.acquisition_function = lambda: fits.append(len(cached._told)) or original()
    assert search(cached) == search(fresh)
    assert fits == [4, 5, 6]  # once per number told, though 7 proposals came after the start-up


def test_a_proposal_that_was_not_recorded_goes_to_the_nearest_recorded_configuration(tmp_path):
    curves, _ = load_curves(_recording(tmp_path, skip={(2, 32, 0.004)}), GRID)
    assert _peers.snap(GRID, curves, (1, 16, 0.001)) == (1, 16, 0.001)  # recorded: itself
    # (2, 32, 0.004) is missing; its neighbours at distance 1/2 (depth 1 or 3) and 1 (width, lr):
    # depth 1 and 3 tie at a half, and the first recorded of them wins
    assert _peers.snap(GRID, curves, (2, 32, 0.004)) == (1, 32, 0.004)
    assert _peers.snap(GRID, curves, (3, 30, 0.0035)) == (3, 32, 0.004)  # off the grid: each knob to its nearest


def test_holm_adjusts_the_sorted_p_values_by_the_tests_left_and_keeps_them_monotone():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (monotone)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([]) == []


def test_ranks_put_the_highest_score_first_and_share_ties():
    assert ranks({"a": 0.9, "b": 0.8, "c": 0.9, "d": 0.5}) == {"a": 1.5, "b": 3.0, "c": 1.5, "d": 4.0}


def test_friedman_on_four_benchmarks_of_three_methods():
    # ranks (A, B, C): (1, 2, 3), (1, 3, 2), (1, 2, 3), (2, 1, 3); sums 5, 8, 11 of N = 4, k = 3:
    # chi2 = 12 / (N k (k + 1)) * (25 + 64 + 121) - 3 N (k + 1) = 52.5 - 48 = 4.5, p = exp(-4.5 / 2)
    scores = {"b1": {"A": 0.9, "B": 0.8, "C": 0.7}, "b2": {"A": 0.9, "B": 0.5, "C": 0.6},
              "b3": {"A": 0.95, "B": 0.9, "C": 0.1}, "b4": {"A": 0.8, "B": 0.85, "C": 0.2}}
    out = friedman(scores)
    assert out["mean_rank"] == pytest.approx({"A": 1.25, "B": 2.0, "C": 2.75})
    assert out["ranks"]["b2"] == {"A": 1.0, "B": 3.0, "C": 2.0}
    assert out["friedman_statistic"] == pytest.approx(4.5)
    assert out["friedman_p"] == pytest.approx(math.exp(-2.25))


def test_friedman_ranks_only_the_methods_every_benchmark_has_and_needs_three():
    out = friedman({"b1": {"A": 0.9, "B": 0.8, "C": 0.1}, "b2": {"A": 0.7, "B": 0.9}})
    assert out["methods"] == ["A", "B"] and out["mean_rank"] == {"A": 1.5, "B": 1.5}
    assert out["friedman_p"] is None


@pytest.mark.parametrize("method", ["tpe", "gp", "random+MO-ASHA"])
def test_proposal_seconds_times_the_asks_once_the_search_holds_that_many_trials(tmp_path, method):
    from benchmarks.replay_search import proposal_seconds

    curves, epochs = load_curves(_recording(tmp_path), GRID)
    seconds = proposal_seconds(method, curves=curves, grid=GRID, epochs=epochs, at=11, repeats=2)
    assert len(seconds) == 2 and all(wall >= 0 and cpu >= 0 for wall, cpu in seconds)


def test_the_curve_at_every_step_is_at_epochs_at_each():
    from benchmarks.replay_search import curve

    history = [(3, 0.0), (5, 0.2), (5, 0.3), (9, 0.3), (12, 0.5)]
    steps = list(range(0, 15))
    assert list(curve(history, steps)) == [at_epochs(history, s) for s in steps]
    assert list(curve([], [1, 2])) == [0.0, 0.0]


def test_the_summary_merges_a_benchmarks_files_and_its_markdown_shows_every_method(tmp_path):
    import json

    from benchmarks.replay_search import _summarise, summary_markdown, summary_over_benchmarks

    curves, epochs = load_curves(_recording(tmp_path), GRID)
    finals = [[c["best"][-1], c["log_throughput"]] for c in curves.values()]
    reference = [min(p[0] for p in finals), min(p[1] for p in finals)]
    true = hypervolume(finals, modes=["max", "max"], reference=reference)
    paths = []
    for grid_name, methods in (("a", ["random", "tpe+MO-ASHA"]), ("a", ["nsga2", "tpe+MO-ASHA"]),
                               ("b", ["random", "nsga2", "tpe+MO-ASHA"])):
        runs = {m: [replay(m, curves=curves, grid=GRID, epochs=epochs, budget=24, seed=s, reference=reference)
                    for s in range(3)] for m in methods}
        result = _summarise(methods, runs, 24, true, {m: 0.0 for m in methods}, {m: [] for m in methods})
        path = tmp_path / f"{grid_name}-{len(paths)}.json"
        path.write_text(json.dumps({"grid": grid_name, "configurations": 12, "budget_epochs": 24, **result}))
        paths.append(path)
    summary = summary_over_benchmarks(paths, min_seeds=3)
    a = summary["benchmarks"]["a (12 configurations, budget 24 epochs)"]
    assert a["files"] == ["a-0.json", "a-1.json"] and set(a["seeds"]) == {"random", "tpe+MO-ASHA", "nsga2"}
    assert set(a["wilcoxon"]) == {"tpe+MO-ASHA vs random", "tpe+MO-ASHA vs nsga2"}  # redone over the merged methods
    assert summary["final"]["methods"] == ["random", "tpe+MO-ASHA", "nsga2"]  # both benchmarks have all three
    text = summary_markdown(summary)
    assert text.count("| **tpe+MO-ASHA** | 3 |") == 2 and text.count("| tpe+MO-ASHA vs nsga2 | 3 |") == 2
    assert "Friedman p = " in text and text.count("| mean rank | a | b |") == 2


def test_the_true_front_members_with_their_own_share_and_their_accuracy_at_each_rung(tmp_path):
    from benchmarks.replay_search import front_shares

    curves, epochs = load_curves(_recording(tmp_path), GRID)
    members = front_shares(curves, epochs)
    # lr 0.004 beats 0.001 at the same speed; (2, 16) beats (1, 32) and (3, 16) beats (2, 32) at the
    # same or a higher speed (1e5 / (depth x width)): four members, the most accurate first
    assert [m["config"] for m in members] == [(3, 32, 0.004), (3, 16, 0.004), (2, 16, 0.004), (1, 16, 0.004)]
    # the slowest sets the reference point's speed: its volume has no width, so no share of its own
    assert members[0]["share"] == pytest.approx(0, abs=1e-12) and all(0 < m["share"] < 1 for m in members[1:])
    assert sum(m["share"] for m in members) < 1
    final = 0.5 + 0.05 * 3 + 0.001 * 32 + 0.02
    assert members[0]["at_rungs"] == pytest.approx({1: final / 4, 2: final / 2})  # rungs 1 and 2 of 4 epochs


def _seeded_recording(tmp_path, second=lambda acc: acc, incomplete=()):
    """_recording's curves as seed 0 and ``second`` of them as seed 1; ``incomplete`` configs lack seed 1."""
    rows = []
    for row in load_rows(_recording(tmp_path)):
        rows.append({**row, "seed": 0})
        key = (row["depth"], row["embed_dim"], row["lr"])
        if key not in incomplete:
            acc = second(row["best_val_acc"])
            rows.append({**row, "seed": 1, "val_acc": acc, "best_val_acc": acc})
    path = tmp_path / "seeded.parquet"
    write_atomic(pa.Table.from_pylist(rows, schema=schema(GRID, seeds=True)), path)
    return path


def load_rows(path):
    from search.results.store import read_table

    return read_table(path).to_pylist()


def test_a_seeded_recording_gives_each_seeds_curve_and_their_mean_and_drops_a_configuration_half_recorded(tmp_path):
    curves, epochs = load_curves(_seeded_recording(tmp_path, lambda acc: acc - 0.1, incomplete=[(1, 16, 0.001)]),
                                 GRID)
    assert len(curves) == 11 and (1, 16, 0.001) not in curves and epochs == EPOCHS
    final = 0.5 + 0.05 * 3 + 0.001 * 32 + 0.02  # (3, 32, 0.004): seed 0 ends there, seed 1 0.1 lower
    c = curves[(3, 32, 0.004)]
    assert c["seeds"][0][-1] == pytest.approx(final) and c["seeds"][1][-1] == pytest.approx(final - 0.1)
    assert c["best"][-1] == pytest.approx(final - 0.05)


def test_a_front_seen_through_noise_is_scored_at_its_true_values():
    from benchmarks.replay_search import scored_volume

    # A looked best and fastest through a lucky seed; B is truly better on accuracy. Seen, A
    # dominates B, so the front is A alone, at its true (0.5, 2.0): (0.5 - 0.4) x (2.0 - 0.5) = 0.15,
    # not the 0.15 + (0.6 - 0.5) x (1.0 - 0.5) = 0.20 that A and B together would hold
    seen, true = [[0.9, 2.0], [0.6, 1.0]], [[0.5, 2.0], [0.6, 1.0]]
    assert scored_volume(seen, true, [0.4, 0.5]) == pytest.approx(0.15)
    assert scored_volume(true, true, [0.4, 0.5]) == pytest.approx(0.20)
    assert scored_volume([], [], [0.4, 0.5]) == 0.0


@pytest.mark.parametrize("method", ["random", "tpe+MO-ASHA"])
def test_seeds_that_agree_replay_as_the_recording_without_seeds(tmp_path, method):
    plain, epochs = load_curves(_recording(tmp_path), GRID)
    seeded, _ = load_curves(_seeded_recording(tmp_path), GRID)
    runs = [replay(method, curves=c, grid=GRID, epochs=epochs, budget=40, seed=2, reference=[0.0, 0.0])
            for c in (plain, seeded)]
    assert [s for s, _ in runs[0]] == [s for s, _ in runs[1]]
    assert [v for _, v in runs[1]] == pytest.approx([v for _, v in runs[0]])


def test_a_noisy_search_sees_a_drawn_seed_and_its_volume_can_fall(tmp_path):
    # seed 1 sees every configuration at 0.99 from the first epoch: a fast one it draws pushes the
    # truly more accurate members off the front the search sees
    curves, epochs = load_curves(_seeded_recording(tmp_path, lambda acc: 0.99), GRID)
    finals = [[c["best"][-1], c["log_throughput"]] for c in curves.values()]
    reference = [min(p[0] for p in finals), min(p[1] for p in finals)]
    true = hypervolume(finals, modes=["max", "max"], reference=reference)
    history = replay("random", curves=curves, grid=GRID, epochs=epochs, budget=20 * EPOCHS, seed=0,
                     reference=reference)
    volumes = [v for _, v in history]
    assert all(0.0 <= v <= true * (1 + 1e-9) for v in volumes)
    assert any(b < a for a, b in itertools.pairwise(volumes))  # a lucky draw pushed a true member off


def test_the_curve_follows_a_volume_that_falls():
    from benchmarks.replay_search import curve

    history = [(2, 0.3), (4, 0.1)]
    assert list(curve(history, range(6))) == [0.0, 0.0, 0.3, 0.3, 0.1, 0.1]
    assert at_epochs(history, 5) == 0.1


def test_a_resumed_replay_runs_only_the_seeds_it_lacks_and_ends_where_one_run_would(tmp_path, monkeypatch):
    import json

    import benchmarks.replay_search as rs
    from benchmarks.replay_search import _resumed, _writer, replay_methods

    def write_result(name, record):  # what benchmarks._env.write_result writes, into tmp_path
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
        return tmp_path / f"{name}.json"

    monkeypatch.setattr(rs, "write_result", write_result)

    curves, epochs = load_curves(_recording(tmp_path), GRID)
    finals = [[c["best"][-1], c["log_throughput"]] for c in curves.values()]
    reference = [min(p[0] for p in finals), min(p[1] for p in finals)]
    true = hypervolume(finals, modes=["max", "max"], reference=reference)
    payload = {"curves_file": "curves.parquet", "grid": "t", "budget_epochs": 24, "reference_point": reference,
               "true_front_hypervolume": true, "seeds": 4, "slow_seeds": 3, "slow_methods": ["nsga2"]}
    methods, calls = ["tpe+MO-ASHA", "nsga2"], []

    def one(method, seed, asks):
        calls.append((method, seed))
        return replay(method, curves=curves, grid=GRID, epochs=epochs, budget=24, seed=seed, reference=reference,
                      asks=asks)

    def run(name, seeds, prior=None):
        return replay_methods(methods, seeds, one, _writer(name, payload, 24, true), slow=["nsga2"], prior=prior)

    whole, _ = run("whole", {"tpe+MO-ASHA": 4, "nsga2": 3})
    calls.clear()
    run("part", {"tpe+MO-ASHA": 2, "nsga2": 1})
    assert calls == [("tpe+MO-ASHA", 0), ("tpe+MO-ASHA", 1), ("nsga2", 0)]
    calls.clear()
    resumed, path = run("part", {"tpe+MO-ASHA": 4, "nsga2": 3}, prior=_resumed(tmp_path / "part.json", payload, methods))
    assert calls == [("tpe+MO-ASHA", 2), ("tpe+MO-ASHA", 3), ("nsga2", 1), ("nsga2", 2)]  # only what it lacked
    assert resumed["per_seed"] == whole["per_seed"] and resumed["methods"].keys() == whole["methods"].keys()
    assert json.loads(path.read_text())["complete"]
    with pytest.raises(SystemExit, match="budget_epochs"):  # another budget: refuse, name the fix
        _resumed(tmp_path / "part.json", {**payload, "budget_epochs": 12}, methods)


@pytest.mark.parametrize("stopping", ["", "+MO-ASHA"])
def test_the_products_botorch_sampler_replays_as_the_botorch_grid_peer_on_a_full_grid(tmp_path, stopping):
    # the same rule written twice: search.study.finite_bo as an Optuna sampler (algorithm: botorch),
    # and benchmarks._peers.DiscreteQNEHVI against the recording. On a full grid, with the knobs as
    # ordered indices, they propose the same configurations and so replay the same curve.
    curves, epochs = load_curves(_recording(tmp_path), GRID)
    finals = [[c["best"][-1], c["log_throughput"]] for c in curves.values()]
    reference = [min(p[0] for p in finals), min(p[1] for p in finals)]
    runs = {m: replay(m + stopping, curves=curves, grid=GRID, epochs=epochs, budget=11 * EPOCHS, seed=5,
                      reference=reference) for m in ("botorch", "botorch-grid")}
    assert runs["botorch"] == runs["botorch-grid"] and len(runs["botorch"]) >= 11


def test_the_late_variant_puts_the_first_rung_at_a_sixteenth_of_the_epochs_and_is_ours_on_short_budgets(tmp_path):
    from benchmarks.replay_search import _Stopping

    # max(1, round(epochs / 16)): LCBench's 52 epochs -> 3 (rungs 3, 6, 12, 24, 48); 8 -> 1; 40 -> 2 (round half to even)
    assert _Stopping("tpe+MO-ASHA-late", 52)._scheduler.milestones == [3, 6, 12, 24, 48]
    assert _Stopping("tpe+MO-ASHA-late", 40)._scheduler.milestones == [2, 4, 8, 16, 32]
    assert _Stopping("tpe+MO-ASHA-late", 8)._scheduler.milestones == _Stopping("tpe+MO-ASHA", 8)._scheduler.milestones == [1, 2, 4]
    curves, epochs = load_curves(_recording(tmp_path), GRID)  # 4 epochs: the same first rung, the same search
    runs = [replay(m, curves=curves, grid=GRID, epochs=epochs, budget=40, seed=1, reference=[0.0, 0.0])
            for m in ("tpe+MO-ASHA", "tpe+MO-ASHA-late")]
    assert runs[0] == runs[1]


def test_tpes_group_decomposition_is_plain_tpe_on_a_grid_every_trial_asks_whole(tmp_path):
    curves, epochs = load_curves(_recording(tmp_path), GRID)  # no conditions: one group, the same model
    for stopping in ("", "+MO-ASHA"):
        runs = [replay(m + stopping, curves=curves, grid=GRID, epochs=epochs, budget=60, seed=3, reference=[0.0, 0.0])
                for m in ("tpe", "tpe-group")]
        assert runs[0] == runs[1]


def test_the_rung_tpe_learns_from_stopped_trials_at_the_highest_rung_that_enough_trials_reached(tmp_path):
    from benchmarks.replay_search import _RungTPESearch

    curves, epochs = load_curves(_recording(tmp_path), GRID)
    search = _RungTPESearch("tpe-rung+MO-ASHA", GRID, epochs, seed=0)
    assert list(search._observed) == [1, 2, 4]  # MO-ASHA's rungs below 4 epochs, and the full budget
    seen = []
    for number in range(9):  # nine trials that each stop at the first rung
        key = _peers.snap(GRID, curves, search.ask(number))
        assert search._study is search._studies[1]  # no rung has 8 observations yet: the first rung's (random) TPE
        result = {"epoch": 1, "best_val_acc": curves[key]["best"][0], "log_throughput": curves[key]["log_throughput"]}
        search.report(result)
        search.done(result, False)
        seen.append([result["best_val_acc"], result["log_throughput"]])
    assert search._observed == {1: 9, 2: 0, 4: 0}
    rung = search._studies[1]
    complete = rung.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert [t.values for t in complete] == seen  # each stopped trial, at what it scored at its rung
    assert len(rung.get_trials(states=(optuna.trial.TrialState.FAIL,))) == 9  # the proposals, not read by TPE
    search.ask(9)
    assert search._study is search._studies[1]  # rung 1 has 9 >= 8 observations; rungs 2 and 4 none
    for rung in (2, 4):  # once 8 trials reach the full budget, its model proposes
        search._observed[rung] = 8
    search.ask(10)
    assert search._study is search._studies[4]


def test_the_rung_tpe_with_stops_tells_each_higher_rung_a_stopped_trial_as_pruned(tmp_path):
    from benchmarks.replay_search import _RungTPESearch

    curves, epochs = load_curves(_recording(tmp_path), GRID)
    for method, pruned in (("tpe-rung+MO-ASHA", 0), ("tpe-rung-stops+MO-ASHA", 1)):
        search = _RungTPESearch(method, GRID, epochs, seed=0)
        key = _peers.snap(GRID, curves, search.ask(0))
        result = {"epoch": 1, "best_val_acc": curves[key]["best"][0], "log_throughput": curves[key]["log_throughput"]}
        search.report(result)
        search.done(result, False)  # stopped at rung 1
        states = {r: [t.state for t in s.get_trials() if t.state != optuna.trial.TrialState.FAIL]
                  for r, s in search._studies.items()}
        assert states[1] == [optuna.trial.TrialState.COMPLETE]
        assert states[2] == states[4] == [optuna.trial.TrialState.PRUNED] * pruned
        assert search._observed == {1: 1, 2: 0, 4: 0}  # a PRUNED trial is no observation


def test_a_candidate_is_tested_against_the_first_baseline_each_benchmark_holds_with_holm_over_all(tmp_path):
    import json

    from benchmarks.replay_search import candidate_tests

    def bench(path, grid, per_seed):
        methods = {m: {"seeds": len(v["final"]), "hv_fraction": {"100%": {"median": 0.5}},
                       "area_fraction": {"median": 0.5}, "epochs_to": {}} for m, v in per_seed.items()}
        path.write_text(json.dumps({"grid": grid, "configurations": 9, "budget_epochs": 10, "methods": methods,
                                    "per_seed": per_seed}))
        return path

    up = [0.1 * (i + 1) for i in range(8)]  # eight seeds, the candidate higher by 0.1 .. 0.8: exact p 2/2**8
    flat = [0.5] * 8
    a = bench(tmp_path / "a.json", "long", {"late": {"final": flat, "area": flat}, "ours": {"final": flat, "area": flat},
                                            "cand-late": {"final": [0.5 + d for d in up], "area": flat}})
    b = bench(tmp_path / "b.json", "short", {"ours": {"final": flat, "area": flat},
                                             "cand": {"final": [0.5 - d for d in up], "area": flat}})
    result = candidate_tests([a, b], [("cand-late", "late"), ("cand", "ours")])
    rows = list(result["benchmarks"].values())
    assert [(r["candidate"], r["baseline"]) for r in rows] == [("cand-late", "late"), ("cand", "ours")]
    assert result["holm_family"] == 4  # final and area on each benchmark
    assert rows[0]["final"]["p_value"] == pytest.approx(2 / 2 ** 8)  # all eight higher: 2 of 256 sign patterns
    # Holm: the two tied smallest of four times 4, then max(that, 3 x p): both 4 x 2/256
    assert rows[0]["final"]["p_holm"] == rows[1]["final"]["p_holm"] == pytest.approx(4 * 2 / 2 ** 8)
    assert rows[0]["area"]["p_value"] == 1.0 and rows[0]["final"]["higher"] == 8
    assert (result["wins"], result["losses"]) == (1, 1)


def test_rung_correlations_by_hand():
    from benchmarks.replay_search import rung_correlations

    # three configurations over 4 epochs: rung 1 ranks them in reverse of the end, rung 2 as the end
    curves = {"a": {"best": [0.3, 0.1, 0.2, 0.2]}, "b": {"best": [0.2, 0.2, 0.3, 0.5]},
              "c": {"best": [0.1, 0.3, 0.4, 0.9]}}
    assert rung_correlations(curves, 4) == {1: pytest.approx(-1.0), 2: pytest.approx(1.0)}

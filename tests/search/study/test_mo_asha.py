"""MO-ASHA: the ranking and the promotion rule by hand, then against Ray's ASHA in real Tune runs.

The Tune runs use a fake trainable (no training): each config reports a fixed accuracy curve and
a constant throughput per epoch. One config is fast but inaccurate, on the accuracy/throughput
front; ASHA on accuracy stops it at the first rung, MO-ASHA lets it run to max_t.
"""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from search.study.mo_asha import (
    CONTINUE,
    STOP,
    MOASHAScheduler,
    _crowding_distance,
    _decide,
    _nondominated_ranks,
    _objective_vector,
    _rung_order,
)

NAN = math.nan
INF = math.inf
OBJECTIVES = [("best_val_acc", "max"), ("throughput", "max")]


def _rung(*points: tuple[float, ...]) -> dict[str, np.ndarray]:
    """A rung table: trial ids t0, t1, ... in arrival order, vectors already maximised."""
    return {f"t{i}": np.asarray(p, dtype=float) for i, p in enumerate(points)}


def _trial(trial_id: str) -> SimpleNamespace:
    return SimpleNamespace(trial_id=trial_id)  # all the scheduler reads of a Trial


# ---------------------------------------------------------------- ranking and crowding


def test_ranks_peel_fronts_and_nan_rows_get_none():
    points = np.array([
        [0.9, 100.0],   # front
        [0.5, 1000.0],  # front
        [0.8, 90.0],    # dominated by row 0 only -> rank 1
        [0.4, 900.0],   # dominated by row 1 only -> rank 1
        [0.3, 80.0],    # dominated by rows 2 and 3 -> rank 2
        [NAN, 5000.0],  # unknown -> -1
        [0.9, 100.0],   # duplicate of row 0: duplicates do not dominate each other
    ])
    assert _nondominated_ranks(points).tolist() == [0, 0, 1, 1, 2, -1, 0]


def test_ranks_of_empty_and_all_nan_tables():
    assert _nondominated_ranks(np.empty((0, 2))).tolist() == []
    assert _nondominated_ranks(np.array([[NAN, 1.0], [2.0, NAN]])).tolist() == [-1, -1]


@pytest.mark.parametrize("seed", range(5))
def test_ranks_match_the_definition_on_random_tables(seed):
    rng = np.random.default_rng(seed)
    points = rng.integers(0, 6, size=(40, 2 + seed % 2)).astype(float)  # ties on purpose
    ranks = _nondominated_ranks(points)

    def dominates(p, q):
        return (p >= q).all() and (p > q).any()

    for i, r in enumerate(ranks):
        # Nothing of the same or a worse rank dominates it; something one rank better does.
        assert not any(dominates(points[j], points[i]) for j in np.flatnonzero(ranks >= r))
        if r > 0:
            assert any(dominates(points[j], points[i]) for j in np.flatnonzero(ranks == r - 1))


def test_crowding_distance_by_hand():
    # Sorted on objective 0: a, b, c, d; on objective 1 the reverse. Ranges 4 and 4.
    front = np.array([[0.0, 4.0], [1.0, 3.0], [2.0, 1.0], [4.0, 0.0]])
    distance = _crowding_distance(front)
    assert distance[0] == distance[3] == INF
    assert distance[1] == pytest.approx((2 - 0) / 4 + (4 - 1) / 4)
    assert distance[2] == pytest.approx((4 - 1) / 4 + (3 - 0) / 4)
    assert _crowding_distance(front[:2]).tolist() == [INF, INF]  # two points: both extremes


def test_crowding_distance_survives_flat_and_infinite_objectives():
    flat = np.array([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0]])
    assert _crowding_distance(flat)[1] == pytest.approx(1.0)  # the flat objective adds nothing
    infinite = np.array([[-INF, 3.0], [1.0, 2.0], [2.0, 1.0], [3.0, 0.0]])
    distance = _crowding_distance(infinite)
    assert not np.isnan(distance).any()


def test_order_is_rank_then_crowding_then_judged_trial_then_arrival():
    points = np.array([
        [0.0, 4.0], [1.0, 3.0], [2.0, 1.0], [4.0, 0.0],  # rank 0; crowding inf, 1.25, 1.5, inf
        [0.5, 2.0], [3.0, -1.0],                          # rank 1, both extremes of that front
    ])
    ranks, crowding, order = _rung_order(points)
    assert ranks.tolist() == [0, 0, 0, 0, 1, 1]
    assert order.tolist() == [0, 3, 2, 1, 4, 5]
    _, _, order = _rung_order(points, favoured=5)  # exact tie: the judged trial goes first
    assert order.tolist() == [0, 3, 2, 1, 5, 4]


def test_hv_contribution_orders_a_front_by_the_area_each_point_alone_adds():
    """(5, 9) alone adds 5 x 6 = 30 to its front's area (up to the rung's worst values), (6, 3)
    adds 1 x 3 = 3: by hypervolume contribution (5, 9) goes first, though crowding (1.3 against
    1.4) puts it behind. The extremes keep infinity either way."""
    points = np.array([[0.0, 10.0], [5.0, 9.0], [6.0, 3.0], [10.0, 0.0], [1.0, 1.0], [2.0, 0.5]])
    _, crowding, order = _rung_order(points)
    assert crowding[1:3].tolist() == pytest.approx([1.3, 1.4]) and order.tolist() == [0, 3, 2, 1, 4, 5]
    _, contribution, order = _rung_order(points, ranking="hv_contribution")
    assert contribution[1:3].tolist() == pytest.approx([30.0, 3.0]) and order.tolist() == [0, 3, 1, 2, 4, 5]
    assert np.isinf(contribution[[0, 3, 4, 5]]).all()
    with pytest.raises(ValueError, match="ranking must be one of crowding, hv_contribution"):
        MOASHAScheduler(objectives=[("a", "max")], max_t=4, ranking="epsilon")


def test_without_keep_front_the_quota_alone_decides():
    """Five trade-offs at a rung, rf 4: all on the front, so rule 4 lets the newcomer on; with
    keep_front=False it is last in the order (the most crowded) and the quota is 2."""
    recorded = _rung((0.1, 5.0), (0.5, 4.0), (0.9, 1.0), (0.2, 4.9), (0.6, 3.5))
    assert _decide(recorded, "t3", 4) == CONTINUE
    assert _decide(recorded, "t3", 4, keep_front=False) == STOP
    assert _decide(recorded, "t2", 4, keep_front=False) == CONTINUE  # an extreme: first in the order


# ---------------------------------------------------------------- the promotion rule


def test_first_trial_at_a_rung_continues():
    assert _decide(_rung((0.1, 1.0)), "t0", 2) == CONTINUE


def test_second_trial_dominated_by_the_first_stops_like_asha():
    # ASHA with one recorded value v continues a trial iff it is >= v; the MO reading: stop
    # when the earlier trial is better on every objective.
    assert _decide(_rung((0.9, 100.0), (0.8, 90.0)), "t1", 2) == STOP
    assert _decide(_rung((0.9, 100.0), (0.8, 900.0)), "t1", 2) == CONTINUE  # a trade-off
    assert _decide(_rung((0.9, 100.0), (0.8, 90.0)), "t1", 4) == STOP  # quota 1 while n < rf


def test_a_trial_on_the_front_continues_beyond_the_quota():
    # Five points on the front, rf 4: the quota is ceil(5 / 4) = 2, and the newcomer is an
    # interior point with the smallest crowding distance (last in the order), yet it goes on.
    rung = _rung((0.0, 10.0), (1.5, 8.5), (5.0, 5.0), (10.0, 0.0), (1.0, 9.0))
    ranks, crowding, order = _rung_order(np.array(list(rung.values())), favoured=4)
    assert (ranks == 0).all() and order[-1] == 4
    assert _decide(rung, "t4", 4) == CONTINUE


def test_dominated_trials_within_the_quota_continue_beyond_it_stop():
    # A front of one (t0), then dominated trials; rf 2.
    front = (1.0, 1.0)
    # n = 2, quota 1: t1 is second -> stop.
    assert _decide(_rung(front, (0.5, 0.5)), "t1", 2) == STOP
    # n = 4, quota 2: rank 1 is the trade-off {t1, t2, t3}; t3 is its interior point (finite
    # crowding, behind the two infinite extremes), so position 3 -> stop.
    rung = _rung(front, (0.9, 0.1), (0.1, 0.9), (0.5, 0.5))
    assert _decide(rung, "t3", 2) == STOP
    # n = 3, quota 2: the two rank-1 extremes tie (both infinite); the judged one goes first
    # (ASHA's ">= cutoff"), so each of them, judged, is at position 1 -> continue.
    rung = _rung(front, (0.9, 0.1), (0.1, 0.9))
    assert _decide(rung, "t1", 2) == _decide(rung, "t2", 2) == CONTINUE
    # n = 5, quota 3: rank 1 = {t1, t2, t4}, rank 2 = {t3}. Extreme t4 at position <= 2 goes on,
    # t3 at position 4 stops.
    rung = _rung(front, (0.9, 0.1), (0.5, 0.5), (0.4, 0.4), (0.1, 0.9))
    assert _decide(rung, "t4", 2) == CONTINUE
    assert _decide(rung, "t3", 2) == STOP


def test_a_dominated_trial_within_the_quota_continues():
    # rf 2, n = 3: quota 2. t0 dominates t1 and t2; t1 dominates t2. t1 is position 1 -> go on.
    rung = _rung((1.0, 1.0), (0.9, 0.9), (0.8, 0.8))
    assert _decide(rung, "t1", 2) == CONTINUE
    assert _decide(rung, "t2", 2) == STOP


def test_nan_vector_stops_and_is_not_counted_in_the_quota():
    assert _decide(_rung((NAN, NAN)), "t0", 2) == STOP  # even alone at the rung
    assert _decide(_rung((1.0, 1.0), (NAN, NAN)), "t1", 2) == STOP
    # Two NaN rows do not raise the quota of the valid ones: n = 2 valid -> quota 1.
    rung = _rung((1.0, 1.0), (NAN, NAN), (NAN, NAN), (0.5, 0.5))
    assert _decide(rung, "t3", 2) == STOP


def test_objective_vector_orients_min_and_poisons_bad_values():
    objectives = [("acc", "max"), ("latency_ms", "min")]
    assert _objective_vector({"acc": 0.9, "latency_ms": 3}, objectives).tolist() == [0.9, -3.0]
    assert _objective_vector({"acc": np.float32(0.5), "latency_ms": np.int64(2)}, objectives).tolist() == [0.5, -2.0]
    for bad in ({"acc": 0.9}, {"acc": 0.9, "latency_ms": None}, {"acc": NAN, "latency_ms": 1},
                {"acc": "0.9", "latency_ms": 1}, {"acc": True, "latency_ms": 1}):
        assert np.isnan(_objective_vector(bad, objectives)).all(), bad


# ---------------------------------------------------------------- the scheduler, no Ray actors


def test_min_mode_objective_through_the_scheduler():
    # Latency is minimised: the slow-and-inaccurate trial is dominated, the fast one is not.
    s = MOASHAScheduler(objectives=[("acc", "max"), ("latency_ms", "min")], time_attr="epoch",
                        max_t=4, grace_period=1, reduction_factor=2)
    assert s.on_trial_result(None, _trial("a"), {"epoch": 1, "acc": 0.9, "latency_ms": 10.0}) == CONTINUE
    assert s.on_trial_result(None, _trial("fast"), {"epoch": 1, "acc": 0.5, "latency_ms": 1.0}) == CONTINUE
    assert s.on_trial_result(None, _trial("slow"), {"epoch": 1, "acc": 0.5, "latency_ms": 20.0}) == STOP
    # Had latency been maximised, "slow" would be on the front and "fast" dominated by it.
    s = MOASHAScheduler(objectives=[("acc", "max"), ("latency_ms", "max")], time_attr="epoch", max_t=4)
    s.on_trial_result(None, _trial("a"), {"epoch": 1, "acc": 0.9, "latency_ms": 10.0})
    s.on_trial_result(None, _trial("slow"), {"epoch": 1, "acc": 0.5, "latency_ms": 20.0})
    assert s.on_trial_result(None, _trial("fast"), {"epoch": 1, "acc": 0.5, "latency_ms": 1.0}) == STOP


def test_rungs_judgement_once_per_rung_and_max_t():
    s = MOASHAScheduler(objectives=OBJECTIVES, time_attr="epoch", max_t=8, grace_period=1, reduction_factor=2)
    assert s.milestones == [1, 2, 4]
    assert MOASHAScheduler(objectives=OBJECTIVES, max_t=9, grace_period=1, reduction_factor=3).milestones == [1, 3]
    good = {"best_val_acc": 0.9, "throughput": 100.0}
    bad = {"best_val_acc": 0.1, "throughput": 10.0}
    assert s.on_trial_result(None, _trial("a"), {"epoch": 1, **good}) == CONTINUE
    assert s.on_trial_result(None, _trial("b"), {"epoch": 1, **bad}) == STOP
    # Already judged at rung 1, between milestones: no new decision, whatever the values.
    assert s.on_trial_result(None, _trial("a"), {"epoch": 1, **bad}) == CONTINUE
    assert s.on_trial_result(None, _trial("b"), {"epoch": 1.5, **bad}) == CONTINUE
    assert s.on_trial_result(None, _trial("a"), {"epoch": 3, **good}) == CONTINUE
    assert list(s._rungs[1].recorded) == ["a"]
    assert s.on_trial_result(None, _trial("a"), {"epoch": 8, **good}) == STOP  # budget spent
    assert s.on_trial_result(None, _trial("a"), {"training_iteration": 9}) == CONTINUE  # no epoch: no decision
    assert "num_stopped=1" in s.debug_string() and "Iter 1: 2 recorded" in s.debug_string()


def test_missing_or_nan_objective_stops_never_raises():
    s = MOASHAScheduler(objectives=OBJECTIVES, time_attr="epoch", max_t=4)
    assert s.on_trial_result(None, _trial("a"), {"epoch": 1, "best_val_acc": 0.9}) == STOP
    assert s.on_trial_result(None, _trial("b"), {"epoch": 1, "best_val_acc": NAN, "throughput": 1.0}) == STOP
    assert s.on_trial_result(None, _trial("c"), {"epoch": 1, "best_val_acc": None, "throughput": "x"}) == STOP
    # The valid trial that comes after them is alone among valid ones: it goes on.
    assert s.on_trial_result(None, _trial("d"), {"epoch": 1, "best_val_acc": 0.1, "throughput": 1.0}) == CONTINUE
    assert s.on_trial_result(None, _trial("e"), {"epoch": NAN, "best_val_acc": 0.1}) == CONTINUE
    s.on_trial_complete(None, _trial("f"), {})  # nothing to record; must not raise


def test_on_trial_complete_records_without_deciding():
    s = MOASHAScheduler(objectives=OBJECTIVES, time_attr="epoch", max_t=4)
    s.on_trial_complete(None, _trial("a"), {"epoch": 2, "best_val_acc": 0.9, "throughput": 100.0})
    assert list(s._rungs[1].recorded) == ["a"] and s._num_stopped == 0
    assert s.on_trial_result(None, _trial("b"), {"epoch": 2, "best_val_acc": 0.8, "throughput": 90.0}) == STOP


def test_search_properties_save_restore_and_validation(tmp_path):
    s = MOASHAScheduler(objectives=OBJECTIVES, time_attr="epoch", max_t=4)
    assert s.set_search_properties("best_val_acc", "max") is True
    assert s.set_search_properties(None, None, config={}) is True
    assert s.metric is None  # so Tune's strict metric check does not demand a single metric
    s.on_trial_result(None, _trial("a"), {"epoch": 1, "best_val_acc": 0.9, "throughput": 100.0})
    path = tmp_path / "sched.pkl"
    s.save(str(path))
    restored = MOASHAScheduler(objectives=[("x", "min")], max_t=2)
    restored.restore(str(path))
    assert restored.objectives == OBJECTIVES and list(restored._rungs[0].recorded) == ["a"]
    assert restored.on_trial_result(None, _trial("b"), {"epoch": 1, "best_val_acc": 0.8, "throughput": 90.0}) == STOP
    pickle.dumps(s)  # Tune may pickle the scheduler with the experiment state

    for kwargs in (
        {"objectives": [], "max_t": 4},
        {"objectives": [("a", "up")], "max_t": 4},
        {"objectives": [("a", "max"), ("a", "min")], "max_t": 4},
        {"objectives": OBJECTIVES, "max_t": 0},
        {"objectives": OBJECTIVES, "max_t": 4, "grace_period": 5},
        {"objectives": OBJECTIVES, "max_t": 4, "reduction_factor": 1},
    ):
        with pytest.raises(ValueError):
            MOASHAScheduler(**kwargs)
    with pytest.raises(TypeError):
        MOASHAScheduler(OBJECTIVES, max_t=4)  # keyword-only


# ---------------------------------------------------------------- real Tune runs against ASHA

MAX_T, GRACE, RF = 4, 1, 2
# In submission order (max_concurrent_trials=1 runs them one after the other).
CONFIGS = [
    {"name": "accurate", "acc": 0.90, "throughput": 100.0},
    {"name": "balanced", "acc": 0.85, "throughput": 120.0},  # slightly less accurate, a bit faster
    {"name": "fast", "acc": 0.50, "throughput": 1000.0},     # far less accurate, 10x faster: on the front
    {"name": "dominated", "acc": 0.60, "throughput": 90.0},  # worse than "accurate" on both
]


def _make_trainable():
    # Defined inside a function so that cloudpickle ships it by value: the Ray workers need
    # not import this test module.
    def fake_trainable(config):
        import time

        from ray import tune

        started_at = time.time()  # the run order, checked by the test
        for epoch in range(1, MAX_T + 1):
            # A rising curve that keeps the configs' accuracy order at every epoch.
            acc = config["cfg"]["acc"] * (1 - 0.5**epoch)
            tune.report({"epoch": epoch, "best_val_acc": acc, "throughput": config["cfg"]["throughput"],
                         "started_at": started_at})

    return fake_trainable


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
        mp.setenv("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
        mp.delenv("RAY_ADDRESS", raising=False)  # always a fresh local cluster here
        started = not ray.is_initialized()
        if started:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     configure_logging=True, logging_level="WARNING")
        yield ray
        if started:
            ray.shutdown()


def _epochs_reached(scheduler, storage) -> dict[str, int]:
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    tuner = tune.Tuner(
        _make_trainable(),
        param_space={"cfg": tune.grid_search(CONFIGS)},
        tune_config=tune.TuneConfig(scheduler=scheduler, max_concurrent_trials=1, reuse_actors=True),
        # The JSON logger only so that the ResultGrid finds result.json and does not warn.
        run_config=tune.RunConfig(name="run", storage_path=str(storage), verbose=0,
                                  callbacks=[JsonLoggerCallback()]),
    )
    grid = tuner.fit()
    assert not grid.errors, grid.errors
    results = [grid[i] for i in range(len(grid))]
    order = sorted(results, key=lambda r: r.metrics["started_at"])
    assert [r.config["cfg"]["name"] for r in order] == [c["name"] for c in CONFIGS]
    return {r.config["cfg"]["name"]: int(r.metrics["epoch"]) for r in results}


@pytest.mark.ray
def test_asha_stops_the_fast_config_mo_asha_keeps_it(ray_cluster, tmp_path):
    from ray.tune.schedulers import ASHAScheduler

    asha = ASHAScheduler(time_attr="epoch", metric="best_val_acc", mode="max",
                         max_t=MAX_T, grace_period=GRACE, reduction_factor=RF)
    asha_epochs = _epochs_reached(asha, tmp_path / "asha")
    assert asha_epochs["accurate"] == MAX_T
    assert asha_epochs["fast"] < MAX_T, asha_epochs  # below the accuracy median at rung 1

    mo = MOASHAScheduler(objectives=OBJECTIVES, time_attr="epoch",
                         max_t=MAX_T, grace_period=GRACE, reduction_factor=RF)
    mo_epochs = _epochs_reached(mo, tmp_path / "mo")
    assert mo_epochs["fast"] == MAX_T, mo_epochs  # on the front at every rung
    assert mo_epochs["accurate"] == mo_epochs["balanced"] == MAX_T, mo_epochs
    assert mo_epochs["dominated"] < MAX_T, mo_epochs  # not a no-op: dominated and past the quota
    assert "num_stopped=1" in mo.debug_string()

"""The race's rule (search.study.race) on labelled pools, and its spec."""

from __future__ import annotations

import pytest

from search.results.intervals import wilson_interval
from search.spec import SearchSpec
from search.study.race import race_step, unresolved
from trainers.errors import ConfigError

OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]


def _config(trial_id: str, acc: float, tput: float) -> dict:
    low, high = wilson_interval(acc, 3000)
    return {"trial_id": trial_id, "state": "COMPLETE", "family": "convit", "val_acc": acc, "val_images": 3000,
            "val_acc_low": low, "val_acc_high": high, "throughput": tput, "throughput_low": tput * 0.85,
            "throughput_high": tput * 1.15, "throughput_device": "cpu"}


def _seed(trial_id: str, of: str, acc: float) -> dict:
    return {"trial_id": trial_id, "replicate_of": of, "val_acc": acc, "val_images": 3000}


# a and b: level within noise on both (0.80 vs 0.805 on 3,000 images is +-1.4 pp; 1,000 vs 1,050
# img/s within +-15%): tied. c: 5x faster and 10 points less accurate, beyond noise on both: a
# trade-off, separated. d: as fast as c, 10 points below it: dominated outright.
POOL = [_config("a", 0.800, 1000.0), _config("b", 0.805, 1050.0), _config("c", 0.700, 5000.0),
        _config("d", 0.600, 5100.0)]


# d's three seeds agree: the seeds' spread is known (pooled SD 0 on 2 degrees of freedom), so the
# intervals are the validation set's, and the race decides on ties alone
SETTLED = [_seed("d1", "d", 0.60), _seed("d2", "d", 0.60), _seed("d3", "d", 0.60)]


def test_tied_members_are_unresolved_the_separated_and_the_beaten_are_not():
    assert unresolved(POOL, SETTLED, OBJECTIVES) == ["b", "a"]  # best first


def test_until_the_seeds_spread_is_known_every_member_is_raced():
    # no config has two fresh seeds: the intervals lack the seed's noise, so nothing counts as separated
    assert unresolved(POOL, [], OBJECTIVES) == ["b", "c", "a"]
    assert race_step(POOL, [], OBJECTIVES, max_seeds=3, running={}) == "b"
    assert race_step(POOL, [], OBJECTIVES, max_seeds=3, running={"b": 1}) == "c"


def test_the_next_seed_goes_to_the_least_seeded_unresolved_config_best_first():
    assert race_step(POOL, SETTLED, OBJECTIVES, max_seeds=3, running={}) == "b"
    assert race_step(POOL, SETTLED, OBJECTIVES, max_seeds=3, running={"b": 1}) == "a"
    assert race_step(POOL, SETTLED, OBJECTIVES, max_seeds=1, running={"a": 1, "b": 1}) is None  # at the cap
    assert race_step(POOL, SETTLED + [_seed("b1", "b", 0.81)], OBJECTIVES, max_seeds=3, running={}) == "a"


def test_seeds_that_separate_the_tie_end_the_race():
    # b's seeds agree at 0.90, a's at 0.80: the pooled seed SD is 0, the intervals are the
    # validation set's (+-1.1 and +-1.4 pp): b is more accurate beyond noise and level on
    # throughput, so a is dominated within noise, on throughput, which seeds cannot move.
    seeds = [_seed("a1", "a", 0.80), _seed("a2", "a", 0.80), _seed("b1", "b", 0.90), _seed("b2", "b", 0.90)]
    assert unresolved(POOL, seeds, OBJECTIVES) == []
    assert race_step(POOL, seeds, OBJECTIVES, max_seeds=5, running={}) is None


def test_dominated_within_noise_on_accuracy_is_raced():
    # e is beaten beyond noise on throughput by f and level with it on accuracy: another seed can
    # lift e's accuracy above f's beyond noise (a trade-off again), so e stays in the race.
    pool = [_config("e", 0.802, 1000.0), _config("f", 0.800, 3000.0), _config("g", 0.50, 9000.0)]
    settled = [_seed("g1", "g", 0.50), _seed("g2", "g", 0.50), _seed("g3", "g", 0.50)]
    assert unresolved(pool, settled, OBJECTIVES) == ["e"]
    assert race_step(pool, settled, OBJECTIVES, max_seeds=2, running={}) == "e"


def _spec(**confirm) -> dict:
    return {"name": "r", "dataset": {"name": "synthetic"}, "model": {"name": "ls_convit_nano"},
            "space": {"lr": {"type": "loguniform", "low": 1e-3, "high": 1e-2}},
            "objectives": [{"metric": "val_acc", "mode": "max"}, {"metric": "throughput", "mode": "max"}],
            "budget": {"trials": 4, "max_epochs": 1, "confirm": confirm}}


def test_the_race_is_a_confirm_strategy_with_its_own_budget(tmp_path):
    import yaml

    from search.spec import load_spec

    def load(**confirm) -> SearchSpec:
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(_spec(**confirm)))
        return load_spec(path, check_model=False)

    assert load(strategy="race", seeds=4, top=3).budget.confirm.budget == 12  # top x seeds unless replicates says
    assert load(strategy="race", seeds=4, top=3, replicates=5).budget.confirm.budget == 5
    with pytest.raises(ConfigError, match="replicates.*strategy: race"):
        load(seeds=2, replicates=5)
    with pytest.raises(ConfigError, match="strategy"):
        load(strategy="fast", seeds=2)
    # a fixed confirmation written out in full hashes as one that leaves the new keys out
    assert load(seeds=2, top=3, strategy="fixed").spec_hash == load(seeds=2, top=3).spec_hash
    assert load(seeds=2, top=3, strategy="race").spec_hash != load(seeds=2, top=3).spec_hash


def test_the_searcher_taken_up_from_its_snapshot_decides_as_the_uninterrupted_one(tmp_path):
    from search.study.searcher import RaceSearcher

    plan = {"pool": POOL, "pool_configs": {c["trial_id"]: {"lr": i * 1e-3} for i, c in enumerate(POOL)},
            "seeds": 3, "replicates": 5}

    def run(searcher, steps, results):
        out = []
        for n in steps:
            out.append(searcher.suggest(f"r{n}"))
            searcher.on_trial_complete(f"r{n}", results[n])
        return out

    results = {n: {"best_val_acc": acc, "val_images": 3000, "stop_reason": "max_epochs"}
               for n, acc in enumerate([0.80, 0.81, 0.79, 0.80, 0.82])}
    whole = run(RaceSearcher(plan, OBJECTIVES, base_seed=0), range(6), {**results, 5: None})
    first = RaceSearcher(plan, OBJECTIVES, base_seed=0)
    head = run(first, range(2), results)
    first.save(str(tmp_path / "snapshot"))
    second = RaceSearcher(plan, OBJECTIVES, base_seed=0)
    second.restore(str(tmp_path / "snapshot"))
    assert head + run(second, range(2, 6), {**results, 5: None}) == whole
    # b (0.805, best first); c (the next member with no seed: the seeds' spread is unknown, every
    # member is raced); c again: its seed scored 0.81 at 5x b's speed, so c alone is on the front,
    # and it is raced until the seeds' spread is known. Seeds count from the study's seed + 1.
    assert [(c["replicate_of"], c["seed"]) for c in whole[:3]] == [("b", 1), ("c", 1), ("c", 2)]
    assert whole[-1] == "FINISHED"

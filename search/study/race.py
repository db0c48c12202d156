"""Racing the confirmation: each further seed goes where it can still change the front.

``budget.confirm: {strategy: race, seeds: S, top: K, replicates: R}``. The pool is what a fixed
confirmation would confirm (the front, then the configs tied with it; at most K). A fixed
confirmation trains each of them S more times. A race hands out R replicates one at a time: the
next goes to a config whose place on the front another seed is most likely to change, and it
stops when every config of the pool is separated (or the budget ends).

After every finished replicate, the pool's front is computed as the study computes it
(``search.results.front.compute_front`` over the pool's search trials and the replicates so far:
fresh-seed means, pooled seed SD, both noises; ``search.results.replicates``). A config is
**unresolved** when it is on that front and tied with a member, or off it but level within noise
with a member on every objective, or dominated within noise: more
seeds narrow its interval, which can separate it or drop it (dominated within noise counts only
where it is level with a dominating config on accuracy: seeds do not move a throughput). A
config off the front outright, or on it and separated from every member, is resolved; but until
the seeds' spread is known (a pooled seed SD on ``MIN_SEED_DF`` degrees of freedom) the intervals
hold the validation set's noise alone, and every member is raced: a race must not end separated
because it knows least. The next
replicate goes to the unresolved config with the fewest seeds (running ones counted), the
better-ranked first on ties; none goes to one that has S seeds. This is racing in the sense of F-race (Birattari et al. 2002; irace,
López-Ibáñez et al. 2016: candidates that are statistically settled stop receiving evaluations)
with the Pareto front's own interval rules as the test, and the allocation of multi-objective
ranking-and-selection (MOCBA, Lee et al. 2010) reduced to its simplest form: samples go to the
designs whose dominance status is uncertain, the least-sampled first.

``race_step`` is the rule, free of Tune: Tune's searcher of the stage
(``search.study.searcher.RaceSearcher``) and the benchmark that measures the race against the fixed
confirmation (``benchmarks.race_confirmation``) both call it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from search.results.front import DOMINATED_COLUMN, compute_front, configs
from search.results.intervals import bounds
from search.results.pareto import DEVICE_METRICS
from search.results.replicates import REPLICATE_COLUMN, pooled_sd

__all__ = ["unresolved", "race_step", "POOL_COLUMNS", "MIN_SEED_DF"]

MIN_SEED_DF = 2  # degrees of freedom of the pooled seed SD before a race may call configs separated

# What the front needs of a pool config's search trial (kept in confirm.json: the race decides
# from the plan and its own replicates, the same after a resume).
POOL_COLUMNS = ("trial_id", "state", "family", "val_acc", "val_images", "val_acc_low", "val_acc_high", "val_loss",
                "throughput", "throughput_low", "throughput_high", "throughput_device", "params", "flops")


def unresolved(pool: Sequence[Mapping[str, Any]], replicates: Sequence[Mapping[str, Any]],
               objectives: Sequence[tuple[str, str]]) -> list[str]:
    """The pool's configs whose status another seed could change (the front's first, best first): on
    the front of the pool (with ``replicates`` folded in) and tied with a member; off it but level
    within noise with a member on every objective; or dominated within noise by a
    config it is level with on an objective seeds move (accuracy, not throughput: a device's
    measurement of the architecture is the same for every seed, so more seeds cannot separate it)."""
    rows = pd.DataFrame.from_records([dict(r, **{REPLICATE_COLUMN: None}) for r in pool]
                                     + [dict(r, state="COMPLETE") for r in replicates])
    front = compute_front(rows, objectives, dominated=True).to_dict("records")
    by_id = {r["trial_id"]: r for r in configs(rows, objectives).to_dict("records")}
    members = [r for r in front if not isinstance(r.get(DOMINATED_COLUMN), str)]
    seeded = [c for c, _ in objectives if c not in DEVICE_METRICS]
    picked = set()
    # a member tied with another config of the pool, on the front or off it on the point values
    # (the pool holds those for that reason, confirm.configs_to_confirm): another seed can part them
    for m in members:
        for other in by_id.values():
            if other["trial_id"] != m["trial_id"] and all(_overlap(m, other, c) for c, _ in objectives):
                picked |= {m["trial_id"], other["trial_id"]}
    for row in front:
        if isinstance(row.get(DOMINATED_COLUMN), str):
            rivals = [by_id[t.strip()] for t in row[DOMINATED_COLUMN].split(",")]
            if any(_overlap(row, rival, c) for rival in rivals for c in seeded):
                picked.add(row["trial_id"])
    # Until the seeds' spread is known (a pooled SD on MIN_SEED_DF degrees of freedom), intervals
    # hold the validation set's noise alone and separate what a seed could still move: every
    # member stays in the race until then, or a race would end "separated" by knowing least.
    fresh = {}
    for r in replicates:
        fresh.setdefault(r[REPLICATE_COLUMN], []).append(r[first_column(objectives)])
    if pooled_sd([v for v in fresh.values() if all(x == x and x is not None for x in v)])[1] < MIN_SEED_DF:
        picked |= {m["trial_id"] for m in members}
    first, mode = objectives[0]
    order = [r["trial_id"] for r in front] + sorted(
        (t for t in by_id if t not in {r["trial_id"] for r in front}),
        key=lambda t: by_id[t][first], reverse=mode == "max")
    return [t for t in order if t in picked]


def first_column(objectives: Sequence[tuple[str, str]]) -> str:
    """The accuracy whose seed spread the race needs: the first objective seeds move."""
    return next((c for c, _ in objectives if c not in DEVICE_METRICS), objectives[0][0])


def _overlap(a: Mapping[str, Any], b: Mapping[str, Any], column: str) -> bool:
    """Whether ``a``'s and ``b``'s intervals of ``column`` overlap (a value without one: the point)."""
    low, high = bounds([a, b], column)
    return bool(low[0] <= high[1] and low[1] <= high[0])


def race_step(pool: Sequence[Mapping[str, Any]], replicates: Sequence[Mapping[str, Any]],
              objectives: Sequence[tuple[str, str]], *, max_seeds: int, running: Mapping[str, int]) -> str | None:
    """The pool config (search trial id) the next replicate trains, or None: every config is
    separated, or the unresolved ones have ``max_seeds`` seeds (finished + ``running``)."""
    done = Counter(r[REPLICATE_COLUMN] for r in replicates)
    order = unresolved(pool, replicates, objectives)
    open_ = [c for c in order if done[c] + running.get(c, 0) < max_seeds]
    if not open_:
        return None
    return min(open_, key=lambda c: (done[c] + running.get(c, 0), order.index(c)))

"""Search efficiency on replayed real learning curves: methods and peers side by side, many seeds.

    python -m benchmarks.record_curves --grid convit-wide   # once (resumable): trains the grid for real
    python -m benchmarks.replay_search                      # then: replays searches, no training
    python -m benchmarks.replay_search --seeds 50 --budget 400
    python -m benchmarks.replay_search --peers strong         # BoTorch, Optuna's GP, SMAC3, DEHB (.[bench])
    python -m benchmarks.replay_search --grid lcbench-126025  # LCBench (record_lcbench), or convit-fashion_mnist
    python -m benchmarks.replay_search --grid convit-wide-seeds  # two trial seeds a configuration: noise
    python -m benchmarks.replay_search --grid zoo             # every family: a conditional space (_conditional)
    python -m benchmarks.replay_search --proposal-times 50,400  # seconds per proposal, no replay
    python -m benchmarks.replay_search --summary benchmarks/results/replay_search*-<device>.json [--markdown]
    python -m benchmarks.replay_search --grid lcbench-126025 --front  # the true front, share and rungs per member

Every trial of a replayed search reads its learning curve and throughput from the recording
(``benchmarks/data/curves-*.parquet``) instead of training. Trials run one after another, so
"epochs spent" is what a single device would pay; every method gets the same budget of epochs,
the same curves and the same rungs (grace 1 epoch, reduction factor 2). Only trials that ran
the full budget are COMPLETE and can be on the front (``search.study.searcher.optuna_state_for``).

Methods (ours last):
  random             Optuna RandomSampler, no early stopping
  tpe                Optuna TPE (multi-objective), no early stopping
  nsga2              Optuna NSGA-II (population 8), no early stopping
  random+ASHA        RandomSampler, Ray Tune's ASHAScheduler on val_acc
  syne-MOASHA        Syne Tune 0.16.0's MOASHA as shipped (its own random suggestions,
                     NonDominatedPriority: an epsilon-net order of the rung)
  syne-MOASHA-fixed  the same with the rung's ranking read as ranks (see below)
  random+MO-ASHA     RandomSampler, this project's MOASHAScheduler on (val_acc, throughput)
  tpe+MO-ASHA        Optuna TPE, the same MO-ASHA (what a study with scheduler: mo_asha runs)
  random+MO-ASHA-hvc, tpe+MO-ASHA-hvc
                     the same with a rung's fronts ordered by hypervolume contribution
                     (MOASHAScheduler's ranking="hv_contribution") instead of crowding distance
  random+MO-ASHA-quota, tpe+MO-ASHA-quota
                     the same without rule 4 (a trial on its rung's front always goes on): the
                     quota of the rung's order alone decides (keep_front=False), as published
  tpe+MO-ASHA-late   the same with MO-ASHA's first rung later on long budgets: at
                     max(1, round(epochs / 16)) epochs (1 on an 8-epoch grid, 3 on LCBench's 52),
                     the rule chosen on LCBench 126025 (not run by default: --methods);
                     tpe-ordered+MO-ASHA-late: the same with TPE's knobs ordered
  tpe-rung+MO-ASHA, tpe-rung+MO-ASHA-late
                     the same stopping, and TPE fitted to every trial at the highest rung that
                     8 trials reached (BOHB's rule, one multi-objective TPE per rung), so that a
                     trial MO-ASHA stopped teaches it what it scored there (not run by default)
  tpe-rung-stops+MO-ASHA, tpe-rung-stops+MO-ASHA-late
                     the same, each rung's TPE also told the trials stopped below it as PRUNED
  tpe-ordered, tpe-ordered+MO-ASHA
                     TPE told each knob as its position among its ordered values (an int), as a
                     spec's `ordered: true` choice or int range gives it, where `tpe` sees
                     unordered categories: its Parzen estimators then see neighbours
  botorch, botorch+MO-ASHA
                     a spec's ``algorithm: botorch`` (search.study.finite_bo): BoTorch's
                     qLogNEHVI over every point of the grid not yet asked, each knob an ordered
                     index; slow (a GP fit per COMPLETE trial), so among --slow-methods

The strong peers (``--peers strong``; ``benchmarks._peers`` has their settings): BoTorch's
qNEHVI through Optuna's BoTorchSampler and Optuna's own GPSampler, each without stopping and with
our MO-ASHA; SMAC3's ParEGO, alone and with Hyperband; DEHB. A GP proposal takes seconds to
minutes on a CPU, so the GP peers run ``--slow-seeds`` seeds (paired tests use the seeds both
methods ran). Every method's proposal goes to the nearest recorded configuration
(``_peers.snap``: itself on a full grid).

Syne Tune's ``Bracket.on_result`` reads what ``MOPriority`` returns as one priority per trial
(lower is better), but ``NonDominatedPriority`` returns the rung's trials' *indices* in their
order, best first. The rank it then computes for the new trial is the index of whichever trial is
ordered last, over n, not the new trial's position. ``syne-MOASHA-fixed`` passes a priority that
is each trial's position in that order (``_RankedNonDominated``): the ranking as meant.

On a recording with two trial seeds per configuration (``convit-wide-seeds``) each trial draws
one; the search sees that seed's curve, and its front (the Pareto set of what it saw) is scored at
its members' mean over the seeds, so a search misled by a lucky seed pays for it.

Objectives and their hypervolume: val_acc (best so far, max) and log10(throughput) (max): a
user weighs speed by ratio (2x faster is 2x faster at any speed), and on a linear axis the
fastest few configurations would hold almost all of the volume. The reference point is the worst
value of each objective over the recorded configurations (a user accepts at least that). Reported:
the share of the true front's hypervolume the best single configuration holds (how much a search
that finds one point already has); per method the median and IQR of the hypervolume fraction at
25/50/100% of the budget, the epochs to reach 90% and 95% of the true front (median over the
seeds that do, and how many), and, paired by seed, Wilcoxon's signed-rank test of tpe+MO-ASHA
and random+MO-ASHA against each other method on the final fraction and on the mean fraction over
the budget (the area under the curve: how early a method gets there), with Holm's correction
over all of a benchmark's comparisons. Written to benchmarks/results/replay_search-<device>.json
(replay_search_<grid>-<device>.json for another grid). ``--summary`` ranks the methods on each
benchmark (by the median final fraction and by the median area) and tests the mean ranks with
Friedman's test, as Demsar (2006) sets out for comparing methods over several data sets.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import optuna
from ray.tune.schedulers import ASHAScheduler

from benchmarks import _peers
from benchmarks._conditional import ConditionalGrid, active_knobs, recorded_grid
from benchmarks._env import result_path, write_result
from benchmarks._lcbench import GRIDS as LCBENCH_GRIDS
from benchmarks.record_curves import DATA_DIR, GRIDS as RECORDED_GRIDS, grid_configs, knob_values
from search.results.hypervolume import hypervolume
from search.results.pareto import pareto_mask
from search.results.store import read_table
from search.spec.records import first_rung
from search.study.finite_bo import FiniteQNEHVISampler
from search.study.mo_asha import MOASHAScheduler
from search.study.searcher import optuna_state_for

GRID_NAME = "convit-wide"
GRIDS = {**RECORDED_GRIDS, **LCBENCH_GRIDS}  # recorded here by training; LCBench from YAHPO Gym's surrogate
OBJECTIVES = [("best_val_acc", "max"), ("log_throughput", "max")]
MODES = ["max", "max"]
METHODS = ("random", "tpe", "nsga2", "random+ASHA", "syne-MOASHA", "syne-MOASHA-fixed", "random+MO-ASHA",
           "tpe+MO-ASHA", "random+MO-ASHA-hvc", "tpe+MO-ASHA-hvc", "random+MO-ASHA-quota", "tpe+MO-ASHA-quota",
           "tpe-ordered", "tpe-ordered+MO-ASHA")
OURS = ("tpe+MO-ASHA", "tpe-ordered+MO-ASHA", "random+MO-ASHA")
BOTORCH = ("botorch", "botorch+MO-ASHA")  # the product's algorithm: botorch (search.study.finite_bo)
LATE = ("tpe+MO-ASHA-late", "tpe-ordered+MO-ASHA-late")  # candidates: MO-ASHA's first rung at a sixteenth of the epochs
RUNG = ("tpe-rung+MO-ASHA", "tpe-rung+MO-ASHA-late", "tpe-rung-stops+MO-ASHA", "tpe-rung-stops+MO-ASHA-late")  # a candidate: TPE fitted at the highest rung with data
GROUP = ("tpe-group", "tpe-group+MO-ASHA")  # a candidate: TPE's group decomposition (differs on conditional grids only)
ALL_METHODS = (*METHODS, *LATE, *RUNG, *GROUP, *BOTORCH, *_peers.STRONG)
SLOW = ("botorch-qNEHVI", "botorch-qNEHVI+MO-ASHA", "botorch-grid", "botorch-grid+MO-ASHA", "gp", "gp+MO-ASHA",
        *BOTORCH)  # a GP proposal takes seconds: fewer seeds
SYNE_TUNE = "syne-tune==0.16.0"


def load_curves(path: Path, grid: dict) -> tuple[dict[tuple, dict], int]:
    """knob values (in the grid's order) -> {"best": [best_val_acc per epoch], "log_throughput": x}; epochs.

    A recording with a ``seed`` column (several trial seeds per configuration) also gives
    ``"seeds"``: each seed's curve, which a replay draws from per trial; ``"best"`` is then their
    mean, the configuration's true value, on which fronts are scored."""
    rows = read_table(path).to_pylist()
    if not rows:
        raise SystemExit(f"{path} is empty; run python -m benchmarks.record_curves first")
    epochs = rows[0]["max_epochs"]
    by_seed: dict[tuple, dict[int, list]] = {}
    speeds: dict[tuple, float] = {}
    for row in sorted(rows, key=lambda r: (r["config_id"], r.get("seed", 0), r["epoch"])):
        key = tuple(row[k] for k in grid)
        by_seed.setdefault(key, {}).setdefault(row.get("seed", 0), []).append(row["best_val_acc"])
        speeds[key] = math.log10(row["throughput"])
    seeded = "seed" in rows[0]
    curves: dict[tuple, dict] = {}
    for key, seeds in by_seed.items():
        full = [c for _, c in sorted(seeds.items()) if len(c) == epochs]
        if not full or len(full) < len(seeds) or (seeded and len(full) < 2):
            continue  # a configuration still being recorded
        curves[key] = {"best": list(np.mean(full, axis=0)) if seeded else full[0], "log_throughput": speeds[key]}
        if seeded:
            curves[key]["seeds"] = full
    return curves, epochs


def _point(curve: dict, epoch: int) -> list[float]:
    return [curve["best"][epoch - 1], curve["log_throughput"]]


# --- the two Syne Tune variants ------------------------------------------------------------------
def _syne_tune():
    try:
        from syne_tune.backend.trial_status import Trial
        from syne_tune.config_space import choice
        from syne_tune.optimizer.scheduler import SchedulerDecision
        from syne_tune.optimizer.schedulers.multiobjective.moasha import MOASHA
        from syne_tune.optimizer.schedulers.multiobjective.multiobjective_priority import NonDominatedPriority
    except ImportError:
        raise SystemExit(f"the syne-MOASHA peers need Syne Tune: pip install --no-deps {SYNE_TUNE} dill (its scheduler "
                         "needs none of its other dependencies), or leave them out with --methods") from None

    class _RankedNonDominated(NonDominatedPriority):
        """NonDominatedPriority read as meant: each trial's position in the order, not the order."""

        def priority_unsafe(self, objectives: np.ndarray) -> np.ndarray:
            order = np.asarray(super().priority_unsafe(objectives))
            ranks = np.empty(len(order), dtype=float)
            ranks[order] = np.arange(len(order))
            return ranks

    return SimpleNamespace(Trial=Trial, choice=choice, STOP=SchedulerDecision.STOP, MOASHA=MOASHA,
                           fixed=_RankedNonDominated)


def syne_tune_ranking_check() -> dict[str, str]:
    """The reading of the rung's ranking, shown on one rung: six trials recorded (metrics
    minimised, each dominating the next), then a seventh that dominates them all. Syne Tune's
    Bracket as shipped computes the newcomer's rank from the index of the trial ordered last (5 of
    7: 0.71 > 1/rf) and stops it; with the ranking read as ranks it is first and goes on."""
    st = _syne_tune()
    from syne_tune.optimizer.schedulers.asha import Bracket
    from syne_tune.optimizer.schedulers.multiobjective.multiobjective_priority import NonDominatedPriority

    out = {}
    for name, priority in (("as shipped", NonDominatedPriority()), ("fixed", st.fixed())):
        bracket = Bracket(min_t=1, max_t=8, reduction_factor=2, s=0, priority=priority)
        for i, v in enumerate((0.3, 0.4, 0.5, 0.6, 0.7, 0.9)):
            bracket.on_result(trial_id=i, cur_iter=1, metrics={"error": v, "cost": v})
        out[name] = str(bracket.on_result(trial_id=6, cur_iter=1, metrics={"error": 0.1, "cost": 0.1}))
    return out


class _SyneSearch:
    """Syne Tune's MOASHA driving one replayed search: its suggestions and its stop decisions."""

    def __init__(self, grid: dict, epochs: int, seed: int, *, fixed: bool):
        from datetime import datetime

        st = _syne_tune()
        np.random.seed(seed)  # its suggestions and bracket choice draw from numpy's global generator
        self._st, self._now = st, datetime.now
        self._scheduler = st.MOASHA(
            config_space={k: st.choice(list(v)) for k, v in grid.items()}, metrics=[m for m, _ in OBJECTIVES],
            do_minimize=False, time_attr="epoch", max_t=epochs, grace_period=1, reduction_factor=2,
            multiobjective_priority=st.fixed() if fixed else None, random_seed=seed)
        self._grid, self._trial = grid, None

    def ask(self, number: int) -> tuple:
        config = self._scheduler.suggest().config
        self._trial = self._st.Trial(trial_id=number, config=config, creation_time=self._now())
        self._scheduler.on_trial_add(self._trial)
        return tuple(config[k] for k in self._grid)

    def report(self, result: dict) -> bool:
        """Whether the trial goes on after this epoch."""
        return self._scheduler.on_trial_result(self._trial, result) != self._st.STOP

    def done(self, result: dict, reached_max: bool) -> None:
        if reached_max:
            self._scheduler.on_trial_complete(self._trial, result)


class _Stopping:
    """A method's early stopping, by its name: our MO-ASHA, Ray's ASHA, or none."""

    def __init__(self, method: str, epochs: int):
        if "MO-ASHA" in method:
            grace = first_rung(epochs) if method.endswith("-late") else 1
            self._scheduler = MOASHAScheduler(objectives=OBJECTIVES, time_attr="epoch", max_t=epochs, grace_period=grace,
                                              reduction_factor=2,
                                              ranking="hv_contribution" if method.endswith("-hvc") else "crowding",
                                              keep_front=not method.endswith("-quota"))
        elif method.endswith("ASHA"):
            self._scheduler = ASHAScheduler(time_attr="epoch", metric="best_val_acc", mode="max", max_t=epochs,
                                            grace_period=1, reduction_factor=2)
        else:
            self._scheduler = None

    def _started(self, number: int) -> None:
        self._handle = SimpleNamespace(trial_id=str(number))
        if self._scheduler is not None:
            self._scheduler.on_trial_add(None, self._handle)

    def report(self, result: dict) -> bool:
        if self._scheduler is None:
            return True
        return self._scheduler.on_trial_result(None, self._handle, result) != "STOP"

    def _ended(self, result: dict) -> None:
        if self._scheduler is not None and result:
            self._scheduler.on_trial_complete(None, self._handle, result)


class _OptunaSearch(_Stopping):
    """An Optuna sampler asked for the grid's knobs, with Ray's ASHA, our MO-ASHA or no stopping."""

    def __init__(self, method: str, grid: dict, epochs: int, seed: int):
        super().__init__(method, epochs)
        name = method.split("+")[0]
        sampler = {"random": lambda: optuna.samplers.RandomSampler(seed=seed),
                   "tpe": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8),
                   "tpe-ordered": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8),
                   # Optuna's advice for a conditional space: one multivariate model per group of knobs
                   # that occur together (each model's own), not only the knobs every trial has
                   "tpe-group": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                                                   n_startup_trials=8),
                   "tpe-rung": lambda: optuna.samplers.RandomSampler(seed=seed),  # unused: one TPE per rung
                   "tpe-rung-stops": lambda: optuna.samplers.RandomSampler(seed=seed),
                   "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=seed, population_size=8),
                   "gp": lambda: _peers.gp_sampler("gp", seed),
                   "botorch-qNEHVI": lambda: _peers.gp_sampler("botorch", seed),
                   "botorch": lambda: FiniteQNEHVISampler(
                       {k: optuna.distributions.IntDistribution(0, len(v) - 1) for k, v in grid.items()}, seed=seed),
                   }[name]()
        # a GP proposes in a box, and tpe-ordered's Parzen estimators see neighbours: an ordered
        # index per knob (as a spec's ordered choice gives it)
        self._by_index = name in ("gp", "botorch-qNEHVI", "tpe-ordered", "botorch")
        self._study = optuna.create_study(directions=["maximize", "maximize"], sampler=sampler)
        self._grid, self._epochs = grid, epochs

    def ask(self, number: int) -> tuple:
        if getattr(self._study.sampler, "exhausted", lambda study: False)(self._study):
            raise _peers.Exhausted  # botorch proposes each point once; the peer ends there too
        self._trial = self._study.ask()
        self._started(number)
        grid = self._grid
        if isinstance(grid, ConditionalGrid):  # the model first, then its knobs (as OptunaSpace asks)
            model = self._trial.suggest_categorical("model", grid["model"])
            chosen = {k: self._suggest(k, grid[k]) for k in grid.models[model]}
            return tuple(model if k == "model" else chosen.get(k) for k in grid)
        return tuple(self._suggest(k, values) for k, values in grid.items())

    def _suggest(self, knob: str, values: list):
        if self._by_index:
            return values[self._trial.suggest_int(knob, 0, len(values) - 1)]
        return self._trial.suggest_categorical(knob, values)

    def recorded_trial(self, key: tuple, values: list[float]):
        """A COMPLETE Optuna trial of a recorded configuration, with the parameters ``ask`` gives it."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        params, dists = {}, {}
        for k, v in zip(self._grid, key):
            if k not in active_knobs(self._grid, key):
                continue
            options = self._grid[k]
            if self._by_index and k != "model":
                params[k], dists[k] = options.index(v), IntDistribution(0, len(options) - 1)
            else:
                params[k], dists[k] = v, CategoricalDistribution(options)
        return optuna.trial.create_trial(params=params, distributions=dists, values=values)

    def done(self, result: dict, reached_max: bool) -> None:
        self._ended(result)
        state, values = optuna_state_for(result, error=False, metrics=[k for k, _ in OBJECTIVES])
        self._study.tell(self._trial, values, state=getattr(optuna.trial.TrialState, state))


class _RungTPESearch(_OptunaSearch):
    """TPE that learns from every trial at the highest rung that enough trials reached, BOHB's rule
    (Falkner et al. 2018, sec. 4.1: the model of the largest budget with enough observations) with
    Optuna's multi-objective TPE as the model and our MO-ASHA's rungs as the budgets. A trial
    MO-ASHA stopped at rung r is an observation at r (its best val_acc there and its throughput);
    plain TPE sees it only as PRUNED, which ranks below every COMPLETE trial. ``tpe-rung-stops``
    also tells each rung's model the trials stopped below it, as PRUNED (what ours tells its one
    model): its full-budget model then holds what ours holds, and the lower rungs' models lead
    until it has 8 observations."""

    min_points = 8  # TPE's start-up trials: below them a rung's model would sample at random anyway

    def __init__(self, method: str, grid: dict, epochs: int, seed: int):
        super().__init__(method, grid, epochs, seed)
        rungs = [*self._scheduler.milestones, epochs]
        self._studies = {r: optuna.create_study(directions=["maximize", "maximize"], sampler=optuna.samplers.TPESampler(
            seed=seed + 7919 * i, multivariate=True, n_startup_trials=self.min_points)) for i, r in enumerate(rungs)}
        self._observed = dict.fromkeys(rungs, 0)
        self._stops = method.startswith("tpe-rung-stops")

    def ask(self, number: int) -> tuple:
        rung = max((r for r, n in self._observed.items() if n >= self.min_points), default=min(self._observed))
        self._study = self._studies[rung]
        key = super().ask(number)
        self._asked = dict(self._trial.params), dict(self._trial.distributions)
        # a proposal, not an observation: FAIL keeps it out of the rung's model (TPE reads COMPLETE
        # and PRUNED trials); the trial is added COMPLETE at each rung it reaches (report)
        self._study.tell(self._trial, state=optuna.trial.TrialState.FAIL)
        return key

    def report(self, result: dict) -> bool:
        if result["epoch"] in self._observed:
            params, distributions = self._asked
            self._studies[result["epoch"]].add_trial(optuna.trial.create_trial(
                params=params, distributions=distributions, values=[result["best_val_acc"], result["log_throughput"]]))
            self._observed[result["epoch"]] += 1
        return super().report(result)

    def done(self, result: dict, reached_max: bool) -> None:
        self._ended(result)
        if self._stops and result and not reached_max:  # stopped: PRUNED at every rung above, as ours tells it
            params, distributions = self._asked
            for rung, study in self._studies.items():
                if rung > result["epoch"]:
                    study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions,
                                                              state=optuna.trial.TrialState.PRUNED))


class _GridBoSearch(_Stopping):
    """BoTorch's qLogNEHVI choosing among the recorded configurations (``_peers.DiscreteQNEHVI``),
    never one it asked before; a COMPLETE trial's objectives are what it learns from, as
    optuna-integration's sampler learns from COMPLETE trials only."""

    def __init__(self, method: str, curves: dict, grid: dict, epochs: int, seed: int):
        super().__init__(method, epochs)
        self._bo = _peers.DiscreteQNEHVI(grid, curves, seed)
        self._asked: set = set()

    def ask(self, number: int) -> tuple:
        self._config = self._bo.propose(self._asked)
        self._asked.add(self._config)
        self._started(number)
        return self._config

    def done(self, result: dict, reached_max: bool) -> None:
        self._ended(result)
        if reached_max:
            self._bo.tell(self._config, [result[k] for k, _ in OBJECTIVES])


def _search(method: str, grid: dict, epochs: int, seed: int, budget: int, curves: dict):
    if method in BOTORCH and isinstance(grid, ConditionalGrid):
        raise SystemExit(f"--methods: {method} is a spec's algorithm: botorch, which refuses a conditional space (several "
                         "models); leave it out, botorch-grid scores the recorded configurations of every model")
    if method.startswith("botorch-grid"):
        return _GridBoSearch(method, curves, grid, epochs, seed)
    if method.startswith("syne"):
        return _SyneSearch(grid, epochs, seed, fixed=method.endswith("fixed"))
    if method.startswith("smac"):
        return _peers.SmacSearch(method, grid, epochs, seed, budget)
    if method == "dehb":
        return _peers.DehbSearch(grid, epochs, seed)
    if method.startswith("tpe-rung"):
        return _RungTPESearch(method, grid, epochs, seed)
    return _OptunaSearch(method, grid, epochs, seed)


def replay(method: str, *, curves: dict[tuple, dict], grid: dict, epochs: int, budget: int, seed: int,
           reference: list[float], asks: list[float] | None = None) -> list[tuple[int, float]]:
    """(epochs spent, hypervolume of the COMPLETE trials) after every trial of one search. ``asks``,
    if given, receives the seconds each proposal took.

    On a recording with several seeds a configuration, each trial draws one (from ``seed`` and the
    trial's number, so every method meets the same draws) and the search sees that seed's curve. The
    search's front is then the Pareto set of what it saw, scored at its members' true (mean) values:
    a member that only a lucky seed put there costs what it is worth, and the volume can fall.

    A search either runs each trial to the end unless its scheduler stops it (``report``), or
    names the epoch to stop at (``fidelity``, the multi-fidelity peers); one that ``resumes`` takes
    a configuration asked again from its furthest earlier epoch, paying only the extra epochs."""
    search = _search(method, grid, epochs, seed, budget, curves)
    spent, seen, true, history, number, trained, drawn = 0, [], [], [], 0, {}, {}
    noisy = any("seeds" in c for c in curves.values())
    try:
        while spent < budget and number < budget * 20:  # a searcher that only re-asks what it has: no endless loop
            start = time.perf_counter()
            try:
                key = _peers.snap(grid, curves, search.ask(number))
            except _peers.Exhausted:
                break
            if asks is not None:
                asks.append(time.perf_counter() - start)
            curve = curves[key]
            if "seeds" in curve:  # a resumed configuration goes on with the seed it started with
                if not (getattr(search, "resumes", False) and key in drawn):
                    drawn[key] = int(np.random.default_rng([seed, number]).integers(len(curve["seeds"])))
                curve = {"best": curve["seeds"][drawn[key]], "log_throughput": curve["log_throughput"]}
            number += 1
            stop = getattr(search, "fidelity", None) or epochs
            first = trained.get(key, 0) + 1 if getattr(search, "resumes", False) else 1
            result: dict = {}
            if first > stop:  # already trained that far: the peer gets the recorded result, no epochs
                result = {"epoch": stop, "best_val_acc": _point(curve, stop)[0], "log_throughput": curve["log_throughput"]}
            for epoch in range(first, stop + 1):
                if spent >= budget:
                    break  # the budget ran out mid-trial: cut short, like the time limit
                spent += 1
                trained[key] = max(trained.get(key, 0), epoch)
                acc, speed = _point(curve, epoch)
                result = {"epoch": epoch, "best_val_acc": acc, "log_throughput": speed}
                if epoch == epochs:
                    result["stop_reason"] = "max_epochs"  # the trainer ran it to the end
                if not search.report(result) or epoch == stop:
                    break
            reached = result.get("epoch") == epochs and result.get("stop_reason") == "max_epochs"
            search.done(result, reached)
            if reached:
                seen.append(_point(curve, epochs))
                true.append(_point(curves[key], epochs))
            volume = scored_volume(seen, true, reference)
            if not noisy and history:  # a front that only gains points: the same volume summed in
                volume = max(volume, history[-1][1])  # another order may differ in the last bit
            history.append((spent, volume))
    finally:
        getattr(search, "close", lambda: None)()
    return history


def scored_volume(seen: list[list[float]], true: list[list[float]], reference: list[float]) -> float:
    """The hypervolume of a search's front: the Pareto set of the points it saw, at their true values."""
    if not seen:
        return 0.0
    front = [t for t, on in zip(true, pareto_mask(np.array(seen), modes=MODES)) if on]
    return hypervolume(front, modes=MODES, reference=reference)


def at_epochs(history: list[tuple[int, float]], spent: int) -> float:
    """The hypervolume a search had when it had spent ``spent`` epochs (its last before then: on a
    noisy recording the volume can fall)."""
    return next((v for s, v in reversed(history) if s <= spent), 0.0)


def curve(history: list[tuple[int, float]], steps: np.ndarray) -> np.ndarray:
    """``at_epochs`` at every step at once."""
    spent = np.array([s for s, _ in history] or [0])
    last = np.array([v for _, v in history] or [0.0])
    index = np.searchsorted(spent, steps, side="right") - 1
    return np.where(index >= 0, last[np.clip(index, 0, None)], 0.0)


def epochs_to_reach(history: list[tuple[int, float]], target: float) -> int | None:
    return next((spent for spent, volume in history if volume >= target - 1e-12), None)


def _quartiles(values: list[float]) -> dict:
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return {"median": float(median), "q1": float(q1), "q3": float(q3)}


# --- statistics: across comparisons (Holm) and across benchmarks (ranks, Friedman) ------------------
def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: sorted ascending, the i-th smallest
    (from 0) times (m - i), kept monotone, at most 1. Reject where the adjusted p < alpha."""
    m = len(p_values)
    adjusted, running = [0.0] * m, 0.0
    for i, k in enumerate(sorted(range(m), key=lambda k: p_values[k])):
        running = max(running, min(1.0, (m - i) * p_values[k]))
        adjusted[k] = running
    return adjusted


def ranks(scores: dict[str, float]) -> dict[str, float]:
    """Rank 1 for the highest score, ties sharing the mean of their ranks (Demsar 2006)."""
    from scipy.stats import rankdata

    names = list(scores)
    return dict(zip(names, (float(r) for r in rankdata([-scores[n] for n in names], method="average"))))


def friedman(scores_by_benchmark: dict[str, dict[str, float]]) -> dict:
    """Mean rank per method over benchmarks and the Friedman test of equal ranks, over the methods
    that every benchmark has (Demsar 2006: the rank-based comparison of several methods on several
    data sets). The test needs at least two benchmarks and three methods; p is None otherwise."""
    from scipy.stats import friedmanchisquare

    common = [m for m in next(iter(scores_by_benchmark.values())) if all(m in s for s in scores_by_benchmark.values())]
    per_benchmark = {b: ranks({m: s[m] for m in common}) for b, s in scores_by_benchmark.items()}
    mean_rank = {m: float(np.mean([r[m] for r in per_benchmark.values()])) for m in common}
    statistic = p = None
    if len(scores_by_benchmark) >= 2 and len(common) >= 3:
        result = friedmanchisquare(*[[scores_by_benchmark[b][m] for b in scores_by_benchmark] for m in common])
        statistic, p = float(result.statistic), float(result.pvalue)
        if math.isnan(p):  # every benchmark ranks the methods alike with ties throughout: no evidence
            statistic, p = None, None
    return {"methods": common, "ranks": per_benchmark, "mean_rank": mean_rank, "friedman_statistic": statistic,
            "friedman_p": p, "benchmarks": list(scores_by_benchmark)}


PROPOSERS = ("random", "tpe", "nsga2", "gp", "botorch-qNEHVI", "botorch-grid", "smac-ParEGO", "smac-ParEGO+HB", "dehb", "syne-MOASHA")


def proposal_seconds(method: str, *, curves: dict, grid: dict, epochs: int, at: int, repeats: int,
                     seed: int = 0) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of ``repeats`` proposals once the search holds ``at`` trials (CPU:
    this process's, all its threads: on a shared machine the wall time is also the others'). An Optuna
    sampler reads the study's trials, so the study is given ``at`` recorded configurations run to
    the end (random, COMPLETE) and then asked; every other searcher runs its own asks and tells on
    the recording (no budget) up to ``at`` trials, since what it proposes next depends on its state."""
    keys = list(curves)
    rng = np.random.default_rng(seed)
    times: list[tuple[float, float]] = []
    search = _search(method, grid, epochs, seed, 10 * at * epochs, curves)
    try:
        if isinstance(search, _OptunaSearch):
            for i in rng.integers(len(keys), size=at):
                search._study.add_trial(search.recorded_trial(keys[i], _point(curves[keys[i]], epochs)))
            fed = at
        elif isinstance(search, _GridBoSearch):  # its GP learns from ``at`` recorded results; it may ask any configuration
            for i in rng.integers(len(keys), size=at):
                search._bo.tell(keys[i], _point(curves[keys[i]], epochs))
            fed = at
        else:
            fed = 0
        number, trained = 0, {}
        while len(times) < repeats:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                key = _peers.snap(grid, curves, search.ask(fed + number))
            except _peers.Exhausted:
                break
            if fed + number >= at:
                times.append((time.perf_counter() - start, time.process_time() - cpu))
            number += 1
            stop = getattr(search, "fidelity", None) or epochs
            result = {"epoch": stop, "best_val_acc": _point(curves[key], stop)[0],
                      "log_throughput": curves[key]["log_throughput"]}
            if stop == epochs:
                result["stop_reason"] = "max_epochs"
            search.done(result, stop == epochs)
    finally:
        getattr(search, "close", lambda: None)()
    return times


def proposal_table(methods: list[str], at: list[int], repeats: int, slow_repeats: int, *, write=lambda table: None,
                   **replay_args) -> dict:
    """The proposal seconds of each method at each N; ``write(table)`` after each (a long run stopped
    early keeps what it has)."""
    table = {}
    for method in methods:
        table[method] = {}
        for n in at:
            start = time.perf_counter()
            seconds = proposal_seconds(method, at=n, repeats=slow_repeats if method in SLOW else repeats, **replay_args)
            wall, cpu = [w for w, _ in seconds], [c for _, c in seconds]
            table[method][str(n)] = {"median_wall_s": float(np.median(wall)) if wall else None,
                                     "median_cpu_s": float(np.median(cpu)) if cpu else None,
                                     # SMAC refits every few proposals and pops the rest: the mean is its cost
                                     "mean_wall_s": float(np.mean(wall)) if wall else None,
                                     "mean_cpu_s": float(np.mean(cpu)) if cpu else None,
                                     "max_wall_s": max(wall, default=None), "proposals": len(seconds),
                                     "measuring_s": time.perf_counter() - start,
                                     "load_average_1min": os.getloadavg()[0]}
            row = table[method][str(n)]
            print(f"  {method} at {n} trials: median {row['median_wall_s']} s wall, {row['median_cpu_s']} s CPU over "
                  f"{len(seconds)} proposals (load {row['load_average_1min']:.1f})", flush=True)
            write(table)
    return table


def wilcoxon_holm(methods: list[str], per_seed: dict) -> tuple[dict, int]:
    """Ours against each other method, paired by seed (the seeds both ran), on the final fraction
    and the area: Wilcoxon's signed-rank p, and Holm's over all these comparisons together."""
    from scipy import stats

    tests, flat, pairs = {}, [], set()
    for ours in [m for m in OURS if m in methods]:
        for other in [m for m in methods if m != ours and frozenset((m, ours)) not in pairs]:
            pairs.add(frozenset((ours, other)))  # one test per pair: ours against ours once
            row = {}
            n = min(len(per_seed[ours]["final"]), len(per_seed[other]["final"]))
            for what in ("final", "area"):
                a, b = np.array(per_seed[ours][what][:n]), np.array(per_seed[other][what][:n])
                diffs = a - b
                p = float(stats.wilcoxon(a, b).pvalue) if np.any(diffs != 0) else 1.0
                row[what] = {"seeds": n, "median_difference": float(np.median(diffs)),
                             "ours_higher": int((diffs > 0).sum()), "ours_lower": int((diffs < 0).sum()), "p_value": p}
                flat.append(row[what])
            tests[f"{ours} vs {other}"] = row
    for row, adjusted in zip(flat, holm([r["p_value"] for r in flat])):
        row["p_holm"] = adjusted
    return tests, len(flat)


def _summarise(methods: list[str], runs: dict, budget: int, true_volume: float, seconds: dict, asks: dict) -> dict:
    """Per method: the hypervolume fraction at 25/50/100%, the area, epochs to 90/95%, per seed;
    the paired Wilcoxon tests of ours against each other method, Holm-corrected across them all."""
    marks = {"25%": budget // 4, "50%": budget // 2, "100%": budget}
    steps = np.arange(1, budget + 1)
    summary, per_seed = {}, {}
    for method in methods:
        fractions = {name: [at_epochs(h, spent) / true_volume for h in runs[method]] for name, spent in marks.items()}
        area = [float(np.mean(curve(h, steps))) / true_volume for h in runs[method]]
        per_seed[method] = {"final": fractions["100%"], "area": area}
        reach = {}
        for share in (0.90, 0.95):
            hit = [e for e in (epochs_to_reach(h, share * true_volume) for h in runs[method]) if e is not None]
            reach[f"{share:.0%}"] = {"seeds_reaching": len(hit), "median_epochs": statistics.median(hit) if hit else None}
        summary[method] = {"seeds": len(runs[method]), "hv_fraction": {k: _quartiles(v) for k, v in fractions.items()},
                           "area_fraction": _quartiles(area), "epochs_to": reach,
                           "trials_median": statistics.median(len(h) for h in runs[method]), "seconds": seconds[method],
                           "proposal_seconds_median": float(np.median(asks[method])) if asks[method] else None,
                           "proposal_seconds_mean": float(np.mean(asks[method])) if asks[method] else None}
    tests, holm_family = wilcoxon_holm(methods, per_seed)
    scores = {what: {m: summary[m][key]["median"] if what == "area" else summary[m]["hv_fraction"]["100%"]["median"]
                     for m in methods} for what, key in (("final", None), ("area", "area_fraction"))}
    return {"methods": summary, "per_seed": per_seed, "wilcoxon": tests, "holm_family": holm_family,
            "ranks": {what: ranks(v) for what, v in scores.items()}}


def _print_table(methods: list[str], result: dict) -> None:
    summary, tests = result["methods"], result["wilcoxon"]
    print(f"\n{'method':<22} {'seeds':>5} {'HV at 25%':>19} {'HV at 50%':>19} {'HV at 100%':>19} {'area':>19}  "
          f"to 90% (seeds)  to 95% (seeds)  ask s")
    for method in methods:
        s = summary[method]
        cells = [f"{q['median']:.3f} ({q['q1']:.3f}-{q['q3']:.3f})" for q in
                 (*s["hv_fraction"].values(), s["area_fraction"])]
        reach = [f"{r['median_epochs'] or '-':>6} ({r['seeds_reaching']:>2})" for r in s["epochs_to"].values()]
        ask = s["proposal_seconds_median"]
        print(f"{method:<22} {s['seeds']:>5} " + " ".join(f"{c:>19}" for c in cells) + "  "
              + "  ".join(f"{r:>14}" for r in reach) + f"  {ask if ask is None else f'{ask:.3g}'}")
    print(f"\nWilcoxon signed-rank, paired by seed (final fraction; area under the curve); p and Holm's p over "
          f"{result['holm_family']} comparisons:")
    for name, row in tests.items():
        f, a = row["final"], row["area"]
        print(f"  {name:<40} n {f['seeds']:>2}: final {f['median_difference']:+.3f} ({f['ours_higher']}/{f['ours_lower']}, "
              f"p {f['p_value']:.2g}, Holm {f['p_holm']:.2g}); area {a['median_difference']:+.3f} ({a['ours_higher']}/"
              f"{a['ours_lower']}, p {a['p_value']:.2g}, Holm {a['p_holm']:.2g})")


def summary_over_benchmarks(paths: list[Path], min_seeds: int = 10) -> dict:
    """From replay JSONs: the files of one benchmark (grid and budget) merged, method by method (a
    method in two files: the first; the seeds are the same searches), the Wilcoxon tests and Holm
    redone over the merged methods; then rank per benchmark (median final fraction, median area),
    mean rank and Friedman's test, over the methods with at least ``min_seeds`` seeds there."""
    import json

    benchmarks: dict[str, dict] = {}
    for path in paths:
        r = json.loads(Path(path).read_text())
        name = f"{r['grid']} ({r['configurations']} configurations, budget {r['budget_epochs']} epochs)"
        b = benchmarks.setdefault(name, {"files": [], "methods": {}, "per_seed": {}})
        b["files"].append(Path(path).name)
        for m, s in r["methods"].items():
            if m not in b["methods"]:
                b["methods"][m], b["per_seed"][m] = s, r["per_seed"][m]
    out: dict = {"benchmarks": {}}
    for name, b in benchmarks.items():
        tests, family = wilcoxon_holm(list(b["methods"]), b["per_seed"])
        out["benchmarks"][name] = {"files": b["files"], "seeds": {m: s["seeds"] for m, s in b["methods"].items()},
                                   "wilcoxon": tests, "holm_family": family,
                                   "methods": {m: {k: s[k] for k in ("hv_fraction", "area_fraction", "epochs_to")}
                                               for m, s in b["methods"].items()}}
    out["min_seeds"] = min_seeds
    for what in ("final", "area"):
        out[what] = friedman({name: {m: (s["area_fraction"] if what == "area" else s["hv_fraction"]["100%"])["median"]
                                     for m, s in b["methods"].items() if s["seeds"] >= min_seeds}
                              for name, b in benchmarks.items()})
    return out


def candidate_tests(paths: list[Path], pairs: list[tuple[str, str]]) -> dict:
    """A candidate variant against the method it would replace, on every benchmark of ``paths``
    that holds a pair: per benchmark the first of ``pairs`` (candidate, baseline) whose two methods
    it has, so that a long-budget benchmark can pair a ``-late`` candidate with the late default.
    Wilcoxon's signed-rank test paired by seed on the final fraction and on the area, and Holm's
    correction over all of these tests together: the rule of issue 74 keeps a variant that wins,
    after it, on more benchmarks than it loses."""
    import json

    from scipy import stats

    per_seed: dict[str, dict] = {}
    for path in paths:  # the per-seed values, merged as summary_over_benchmarks merges them (first file wins)
        r = json.loads(Path(path).read_text())
        name = f"{r['grid']} ({r['configurations']} configurations, budget {r['budget_epochs']} epochs)"
        for m, v in r["per_seed"].items():
            per_seed.setdefault(name, {}).setdefault(m, v)
    out, flat = {}, []
    for name in per_seed:
        pair = next(((c, b) for c, b in pairs if c in per_seed[name] and b in per_seed[name]), None)
        if pair is None:
            continue
        candidate, baseline = pair
        row = {"candidate": candidate, "baseline": baseline}
        for what in ("final", "area"):
            n = min(len(per_seed[name][candidate][what]), len(per_seed[name][baseline][what]))
            a, b = np.array(per_seed[name][candidate][what][:n]), np.array(per_seed[name][baseline][what][:n])
            diffs = a - b
            row[what] = {"seeds": n, "candidate_median": float(np.median(a)), "baseline_median": float(np.median(b)),
                         "median_difference": float(np.median(diffs)), "higher": int((diffs > 0).sum()),
                         "lower": int((diffs < 0).sum()),
                         "p_value": float(stats.wilcoxon(a, b).pvalue) if np.any(diffs != 0) else 1.0}
            flat.append(row[what])
        out[name] = row
    for row, adjusted in zip(flat, holm([r["p_value"] for r in flat])):
        row["p_holm"] = adjusted
    wins = sum(any(r[w]["p_holm"] < 0.05 and r[w]["higher"] > r[w]["lower"] for w in ("final", "area"))
               for r in out.values())
    losses = sum(any(r[w]["p_holm"] < 0.05 and r[w]["higher"] < r[w]["lower"] for w in ("final", "area"))
                 for r in out.values())
    return {"pairs": [list(p) for p in pairs], "benchmarks": out, "holm_family": len(flat), "wins": wins,
            "losses": losses}


def rung_correlations(curves: dict, epochs: int) -> dict[int, float]:
    """Per rung (grace 1, reduction factor 2, below the full budget): Spearman's rank correlation of
    the configurations' best val_acc there with their final one, how well a rung foretells the end."""
    from scipy.stats import spearmanr

    final = [c["best"][-1] for c in curves.values()]
    rungs = [2 ** i for i in range(epochs.bit_length()) if 2 ** i < epochs]
    return {r: float(spearmanr([c["best"][r - 1] for c in curves.values()], final).statistic) for r in rungs}


def front_shares(curves: dict, epochs: int) -> list[dict]:
    """The recording's true front, fastest last: each member's final point, the share of the front's
    hypervolume that only it holds (leave-one-out), and its best val_acc at each rung (grace 1,
    reduction factor 2): where successive halving would judge it."""
    finals = {k: _point(c, epochs) for k, c in curves.items()}
    reference = [min(p[0] for p in finals.values()), min(p[1] for p in finals.values())]
    true = hypervolume(list(finals.values()), modes=MODES, reference=reference)
    keys = list(finals)
    mask = pareto_mask(np.array([finals[k] for k in keys]), modes=MODES)
    front = [k for k, on in zip(keys, mask) if on]
    rungs = [2 ** i for i in range(epochs.bit_length()) if 2 ** i < epochs]
    out = []
    for k in sorted(front, key=lambda k: -finals[k][0]):
        rest = [finals[j] for j in front if j != k]
        alone = true - (hypervolume(rest, modes=MODES, reference=reference) if rest else 0.0)
        out.append({"config": k, "best_val_acc": finals[k][0], "log_throughput": finals[k][1], "share": alone / true,
                    "at_rungs": {r: curves[k]["best"][r - 1] for r in rungs}})
    return out


def summary_markdown(summary: dict) -> str:
    """The summary as docs/search_efficiency.md shows it: per benchmark the methods' fractions and
    the paired tests of ours against each; then the ranks over benchmarks with Friedman's p."""
    def q(x: dict) -> str:
        return f"{x['median']:.3f} ({x['q1']:.3f}-{x['q3']:.3f})"

    lines = []
    for name, b in summary["benchmarks"].items():
        lines += [f"#### {name}", "", "| method | seeds | HV at 25% | HV at 50% | HV at 100% | area | epochs to 90% (seeds) |",
                  "|---|---|---|---|---|---|---|"]
        for m, s in b["methods"].items():
            reach = s["epochs_to"]["90%"]
            label = f"**{m}**" if m in OURS else m
            lines.append(f"| {label} | {b['seeds'][m]} | " + " | ".join(q(s["hv_fraction"][k]) for k in ("25%", "50%", "100%"))
                         + f" | {s['area_fraction']['median']:.3f} | {reach['median_epochs'] or '-'} ({reach['seeds_reaching']}) |")
        lines += ["", f"Paired by seed (the seeds both ran), Wilcoxon p and Holm's p over all {b['holm_family']} "
                      "comparisons of this benchmark:", "",
                  "| comparison | seeds | final: median difference (higher/lower) | p | Holm p | area: median difference "
                  "(higher/lower) | p | Holm p |", "|---|---|---|---|---|---|---|---|"]
        for pair, row in b["wilcoxon"].items():
            if pair.startswith("random+"):  # in the JSON; the page shows TPE's, the default's and the variant's
                continue
            f, a = row["final"], row["area"]
            lines.append(f"| {pair} | {f['seeds']} | {f['median_difference']:+.3f} ({f['ours_higher']}/{f['ours_lower']}) | "
                         f"{f['p_value']:.2g} | {f['p_holm']:.2g} | {a['median_difference']:+.3f} ({a['ours_higher']}/"
                         f"{a['ours_lower']}) | {a['p_value']:.2g} | {a['p_holm']:.2g} |")
        lines.append("")
    for what, label in (("final", "median final fraction"), ("area", "median area")):
        f = summary[what]
        p = "n/a" if f["friedman_p"] is None else f"{f['friedman_p']:.3g} (statistic {f['friedman_statistic']:.2f})"
        short = [b.split(" (")[0] for b in f["benchmarks"]]
        lines += [f"**{what}** ({label}): Friedman p = {p}, {len(f['methods'])} methods on {len(short)} benchmarks", "",
                  "| method | mean rank | " + " | ".join(short) + " |", "|---|---|" + "---|" * len(short)]
        for m in sorted(f["mean_rank"], key=f["mean_rank"].get):
            lines.append(f"| {m} | {f['mean_rank'][m]:.2f} | " + " | ".join(f"{r[m]:g}" for r in f["ranks"].values()) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default=GRID_NAME)
    parser.add_argument("--curves", type=Path, help="default: benchmarks/data/curves-GRID.parquet")
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--slow-seeds", type=int, default=5,
                        help="seeds for the slow methods (--slow-methods; GP peers by default: seconds to minutes a proposal)")
    parser.add_argument("--slow-methods", default=",".join(SLOW), help="the methods that get --slow-seeds")
    parser.add_argument("--budget", type=int, help="epochs per search (default: a sixth of the grid's epochs)")
    parser.add_argument("--peers", choices=("default", "strong", "all"), default="default",
                        help="default: the methods that run in minutes; strong: with the strong peers "
                             f"({', '.join(_peers.STRONG)}; pip install -e '.[bench]'); all: both")
    parser.add_argument("--methods", help=f"comma-separated (overrides --peers), of {', '.join(ALL_METHODS)}")
    parser.add_argument("--resume", action="store_true", help="go on from the seeds this replay's JSON already holds "
                        "(the same recording and budget); a slow method's JSON is written after every seed")
    parser.add_argument("--result-name", help="default: replay_search, or replay_search_GRID for another grid")
    parser.add_argument("--summary", type=Path, nargs="+", metavar="JSON",
                        help="no replay: rank the methods over these benchmarks' replay_search JSONs (Friedman)")
    parser.add_argument("--min-seeds", type=int, default=10, help="--summary ranks the methods with this many seeds")
    parser.add_argument("--markdown", action="store_true", help="--summary also prints its tables as markdown")
    parser.add_argument("--candidate", metavar="CAND=BASE,...", help="with --summary: instead of ranks, test a candidate "
                        "variant against its baseline on each benchmark (the first pair it holds), Holm over all")
    parser.add_argument("--front", action="store_true", help="no replay: the grid's true front, each member's share of "
                        "its hypervolume and its best val_acc at each rung")
    parser.add_argument("--proposal-times", metavar="N,N", help="no replay: the seconds each method spends proposing "
                        f"once a search holds N trials (e.g. 50,400), for {', '.join(PROPOSERS)} or --methods")
    parser.add_argument("--proposal-repeats", type=int, default=5, help="proposals timed per method and N (slow: 2)")
    args = parser.parse_args()
    if args.summary and args.candidate:
        pairs = [tuple(p.split("=", 1)) for p in args.candidate.split(",") if "=" in p]
        result = candidate_tests(args.summary, pairs)
        for name, row in result["benchmarks"].items():
            cells = [f"{w} {r['candidate_median']:.3f} vs {r['baseline_median']:.3f}, {r['median_difference']:+.3f} "
                     f"({r['higher']}/{r['lower']}), p {r['p_value']:.2g}, Holm {r['p_holm']:.2g}"
                     for w, r in ((w, row[w]) for w in ("final", "area"))]
            print(f"{name}: {row['candidate']} vs {row['baseline']}: " + "; ".join(cells))
        print(f"wins {result['wins']}, losses {result['losses']} (Holm over {result['holm_family']} tests)")
        if args.result_name:
            print(f"wrote {write_result(args.result_name, result)}")
        return
    if args.summary:
        result = summary_over_benchmarks(args.summary, args.min_seeds)
        for what in ("final", "area"):
            f = result[what]
            print(f"{what}: mean rank over {len(f['benchmarks'])} benchmarks (Friedman p {f['friedman_p']}):")
            for m in sorted(f["mean_rank"], key=f["mean_rank"].get):
                print(f"  {m:<22} {f['mean_rank'][m]:.2f}  " + "  ".join(f"{r[m]:g}" for r in f["ranks"].values()))
        print(f"wrote {write_result(args.result_name or 'replay_search_summary', result)}")
        if args.markdown:
            print(summary_markdown(result))
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.methods:
        methods = [m for m in args.methods.split(",") if m]
    else:
        methods = {"default": list(METHODS), "strong": [*_peers.STRONG, *OURS], "all": list(ALL_METHODS)}[args.peers]
    slow = [m for m in args.slow_methods.split(",") if m]
    unknown = [m for m in methods + slow if m not in ALL_METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown[0]!r}; use some of {', '.join(ALL_METHODS)}")
    check = None
    if any(m.startswith("syne") for m in methods):
        check = syne_tune_ranking_check()  # Syne Tune missing: one line naming the install, before any replay
        print(f"Syne Tune's rung ranking on a trial that dominates its rung: {check}")
    chosen = GRIDS[args.grid]
    curves_file = args.curves or DATA_DIR / f"curves-{args.grid}.parquet"
    curves, epochs = load_curves(curves_file, knob_values(chosen) if "models" in chosen else chosen["grid"])
    # the searchers draw from the recorded values; a proposal that was not recorded (a recording
    # may be a random subset of the grid) is mapped to the nearest recorded configuration (_peers.snap)
    grid = recorded_grid(chosen, curves)
    points = len(grid_configs(chosen)) if "models" in chosen else math.prod(len(v) for v in chosen["grid"].values())
    unrecorded = points - len(curves)
    finals = [_point(c, epochs) for c in curves.values()]
    reference = [min(p[0] for p in finals), min(p[1] for p in finals)]
    true_volume = hypervolume(finals, modes=MODES, reference=reference)
    best_single = max(hypervolume([p], modes=MODES, reference=reference) for p in finals)
    budget = args.budget or len(curves) * epochs // 6
    print(f"{len(curves)} configurations x {epochs} epochs ({curves_file.name}; {unrecorded} grid points not recorded, "
          f"proposals of those go to the nearest recorded one); reference point val_acc {reference[0]:.4f}, throughput "
          f"{10 ** reference[1]:,.4g}; the best single configuration holds {best_single / true_volume:.3f} of the "
          f"true front's hypervolume; budget {budget} epochs ({budget / epochs:.0f} full trials) per search; "
          f"{args.seeds} seeds ({args.slow_seeds} for {', '.join(m for m in methods if m in slow) or 'no slow peer'})",
          flush=True)
    name = args.result_name or ("replay_search" if args.grid == GRID_NAME else f"replay_search_{args.grid}")
    if args.front:
        print(f"the true front ({', '.join(grid)}): val_acc, log10 throughput, the share only it holds, best val_acc at rungs")
        for m in front_shares(curves, epochs):
            rungs = ", ".join(f"{r}: {v:.3f}" for r, v in m["at_rungs"].items())
            print(f"  {m['config']}  {m['best_val_acc']:.4f}  {m['log_throughput']:.3f}  {m['share']:.4f}  ({rungs})")
        print("Spearman's rank correlation of best val_acc at each rung with the final one, over the configurations: "
              + ", ".join(f"{r}: {rho:.2f}" for r, rho in rung_correlations(curves, epochs).items()))
        return
    if args.proposal_times:
        at = [int(n) for n in args.proposal_times.split(",")]
        chosen = methods if args.methods else list(PROPOSERS)
        import torch

        versions = {d: _peers.version(d) for d in ("optuna", "optuna-integration", "botorch", "gpytorch", "smac",
                                                   "DEHB", "syne-tune", "torch")}

        def write(table: dict) -> Path:
            return write_result(f"{name}_proposals", {
                "curves_file": curves_file.name, "at_trials": at, "seconds": table, "versions": versions,
                "torch_threads": torch.get_num_threads(), "complete": list(table) == chosen and all(
                    len(v) == len(at) for v in table.values())})

        table = proposal_table(chosen, at, args.proposal_repeats, min(2, args.proposal_repeats), write=write,
                               curves=curves, grid=grid, epochs=epochs)
        print(f"wrote {write(table)}")
        return
    peers = {m: _peers.settings(budget // epochs, budget, epochs).get(m.split("+MO-ASHA")[0]) for m in methods
             if m.split("+MO-ASHA")[0] in _peers.settings(budget // epochs, budget, epochs)}

    payload = {
        "curves_file": curves_file.name, "grid": args.grid, "configurations": len(curves),
        "unrecorded_grid_points": unrecorded, "epochs": epochs, "budget_epochs": budget, "seeds": args.seeds,
        "trial_seeds_per_configuration": max(len(c.get("seeds", [None])) for c in curves.values()),
        "noise": "each trial draws one of its configuration's recorded seeds; a front is the Pareto set of what the "
                 "search saw, scored at its members' mean over seeds" if any("seeds" in c for c in curves.values())
                 else None,
        "slow_seeds": args.slow_seeds, "slow_methods": [m for m in methods if m in slow],
        "reference_point": {"val_acc": reference[0], "log10_throughput": reference[1]},
        "true_front_hypervolume": true_volume, "best_single_config_share": best_single / true_volume,
        "mapping": "every method's proposal goes to the nearest recorded configuration (benchmarks._peers.snap)",
        "peer_settings": peers, "syne_tune": SYNE_TUNE, "syne_tune_ranking_check": check}
    write = _writer(name, payload, budget, true_volume)
    seeds = {m: args.slow_seeds if m in slow else args.seeds for m in methods}
    prior = _resumed(result_path(name), payload, methods) if args.resume else {}

    def one(method: str, seed: int, asks: list[float]) -> list:
        return replay(method, curves=curves, grid=grid, epochs=epochs, budget=budget, seed=seed,
                      reference=reference, asks=asks)

    result, path = replay_methods(methods, seeds, one, write, slow=slow, prior=prior)
    _print_table(methods, result)
    print(f"wrote {path}")


def replay_methods(methods: list[str], seeds: dict[str, int], one, write, *, slow: list[str],
                   prior: dict | None = None) -> tuple[dict, Path]:
    """Run ``one(method, seed, asks)`` for each method's seeds, after those ``prior`` already holds
    (``_resumed``: histories, proposal seconds and wall seconds per method); a slow method's JSON is
    written after every seed, so a long run stopped early keeps what it has."""
    prior = prior or {}
    runs = {m: list(prior.get("histories", {}).get(m, [])) for m in methods}
    asks = {m: list(prior.get("asks", {}).get(m, [])) for m in methods}
    seconds = {m: float(prior.get("seconds", {}).get(m, 0.0)) for m in methods}
    result, path = {}, None
    for method in methods:
        start = time.perf_counter() - seconds[method]
        first = len(runs[method])
        for seed in range(first, seeds[method]):
            runs[method].append(one(method, seed, asks[method]))
            seconds[method] = time.perf_counter() - start
            if method in slow or seed == seeds[method] - 1:
                path, result = write(methods, runs, seconds, asks)
        if first >= seeds[method] and path is None and method == methods[-1]:
            path, result = write(methods, runs, seconds, asks)  # nothing left to run: the summary of what is held
        print(f"  {method}: {len(runs[method])} searches ({first} resumed) in {seconds[method]:.0f} s", flush=True)
    if path is None:
        path, result = write(methods, runs, seconds, asks)
    return result, path


def _resumed(path: Path, payload: dict, methods: list[str]) -> dict:
    """What an earlier run of the same replay left in ``path``: its histories, proposal seconds and
    wall seconds per method. The run must have replayed the same recording with the same budget."""
    import json

    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    same = ("curves_file", "grid", "budget_epochs", "reference_point", "true_front_hypervolume")
    differs = [k for k in same if old.get(k) != payload.get(k)]
    if differs:
        raise SystemExit(f"--resume: {path.name} replayed another setting ({differs[0]}: {old.get(differs[0])!r}, "
                         f"now {payload.get(differs[0])!r}); give another --result-name or drop --resume")
    if "histories" not in old:
        raise SystemExit(f"--resume: {path.name} holds no histories (written before --resume existed); "
                         "drop --resume to replay from seed 0")
    return {"histories": {m: [[tuple(p) for p in h] for h in hs] for m, hs in old["histories"].items() if m in methods},
            "asks": {m: a for m, a in old.get("ask_seconds", {}).items() if m in methods},
            "seconds": {m: old["methods"][m]["seconds"] for m in old.get("histories", {}) if m in methods}}


def _writer(name: str, payload: dict, budget: int, true_volume: float):
    """write(methods, runs, seconds, asks): the JSON so far, from the methods that have run."""
    def write(methods: list[str], runs: dict, seconds: dict, asks: dict) -> tuple[Path, dict]:
        done = [m for m in methods if runs.get(m)]
        result = _summarise(done, runs, budget, true_volume, seconds, asks)
        return write_result(name, {**payload, **result, "complete": done == methods and all(
            len(runs[m]) == (payload["slow_seeds"] if m in payload["slow_methods"] else payload["seeds"])
            for m in methods), "histories": {m: runs[m] for m in done},
            "ask_seconds": {m: asks[m] for m in done}}), result
    return write


if __name__ == "__main__":
    main()

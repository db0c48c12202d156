"""Multi-objective ASHA: asynchronous successive halving that judges trials by Pareto rank.

Ray Tune's schedulers stop trials on one metric. ASHA on accuracy alone stops the
fast-but-less-accurate models early, though they sit on the accuracy/throughput Pareto front
the search is after. ``MOASHAScheduler`` keeps ASHA's rungs and its asynchronous rule (each
trial is judged once per rung, on arrival, against the trials recorded there before it) but
replaces "value above the rung's quantile" by a position in an NSGA-II ordering of the rung.

The rule, at a rung milestone ``grace_period * reduction_factor**k < max_t`` that a trial
reaches for the first time:

1. Its objective vector is recorded at the rung ('min' objectives negated, so larger is better
   everywhere). A missing, non-numeric or NaN objective makes the whole vector NaN.
2. A NaN vector STOPs: nothing is known about the trial, so it is treated as the worst (ASHA
   would let it through, since ``NaN < cutoff`` is false; we do not).
3. The rung's valid vectors (``n`` of them, this trial included) are sorted into fronts by
   non-dominated sorting (rank 0 is the rung's Pareto front; rank r+1 is the front of what is
   left after removing ranks 0..r), and within each front by crowding distance (NSGA-II;
   the extreme points of each objective get infinity).
4. A trial of rank 0 CONTINUEs. This is the point of the scheduler: nothing recorded at the rung
   beats it on every objective, so stopping it could lose a point of the final front. In
   particular the first trial at a rung always continues, like ASHA's (whose cutoff is None for
   an empty rung).
5. Otherwise the rung is ordered by (rank ascending, crowding descending, this trial first
   among exact ties, then arrival), and the trial CONTINUEs iff its position (0-based) is
   ``< max(1, ceil(n / reduction_factor))``, else it STOPs.

Why 5 mirrors ASHA: ASHA continues a trial whose value is at least the ``(1 - 1/rf)`` quantile
of the values recorded before it, i.e. (up to the quantile's interpolation) one that is in the
top ``1/rf`` of the rung counting itself. Ties favour the judged trial because ASHA's test is
``>=``. With fewer than ``rf`` valid trials at a rung the quota is 1, as it is in ASHA (one
recorded value ``v``: the quantile is ``v`` and the trial needs ``>= v``), so an early trial
passes when it is not dominated (rule 4) and stops when an earlier trial dominates it -- the
multi-objective reading of ASHA's "at least as good as the one before". Because rule 4
overrides the quota, a rung with a wide front lets more than ``n / rf`` trials through: for
two independent objectives the front of ``n`` points has about ``ln n`` members, so the rate
stays near ASHA's, but for strongly anti-correlated ones (accuracy against throughput can be)
most of a rung may be on its front and MO-ASHA then prunes little. That is the intended trade:
it never stops a trial that nothing at its rung beats.

Like ASHA (``stop_last_trials=True``), a result with ``time_attr >= max_t`` STOPs the trial,
results without ``time_attr`` are ignored, and trials are run in FIFO order.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any

import numpy as np
from ray.tune.experiment import Trial
from ray.tune.schedulers.trial_scheduler import FIFOScheduler, TrialScheduler

from search.results.hypervolume import hypervolume
from search.results.pareto import pareto_mask
from search.spec import RANKINGS

if TYPE_CHECKING:
    from ray.tune.execution.tune_controller import TuneController

__all__ = ["MOASHAScheduler", "RANKINGS"]

CONTINUE = TrialScheduler.CONTINUE
STOP = TrialScheduler.STOP


def _objective_vector(result: Mapping[str, Any], objectives: Sequence[tuple[str, str]]) -> np.ndarray:
    """The result's objectives, negated where the mode is 'min'; all NaN if any is unusable.

    "Unusable" is missing, not a real number (None, a string, a bool) or NaN. One bad objective
    poisons the vector because a partial vector cannot be compared for dominance.
    """
    out = np.empty(len(objectives), dtype=float)
    for i, (key, mode) in enumerate(objectives):
        value = result.get(key)
        if isinstance(value, bool) or not isinstance(value, (Real, np.integer, np.floating)):
            return np.full(len(objectives), np.nan)
        value = float(value)
        if math.isnan(value):
            return np.full(len(objectives), np.nan)
        out[i] = value if mode == "max" else -value
    return out


def _nondominated_ranks(points: np.ndarray) -> np.ndarray:
    """Front index of each row of ``points`` (n, k), all objectives maximised; -1 for NaN rows.

    Fronts are peeled: rank 0 is ``pareto_mask`` of everything, rank 1 that of the rest, ...
    O(n^2) per front is fine at the tens to hundreds of trials a rung holds.
    """
    points = np.asarray(points, dtype=float)
    n, k = points.shape
    ranks = np.full(n, -1, dtype=int)
    remaining = np.flatnonzero(~np.isnan(points).any(axis=1))
    modes = ["max"] * k
    rank = 0
    while remaining.size:
        front = pareto_mask(points[remaining], modes=modes)
        ranks[remaining[front]] = rank
        remaining = remaining[~front]
        rank += 1
    return ranks


def _crowding_distance(points: np.ndarray) -> np.ndarray:
    """NSGA-II crowding distance of each row of one front ``points`` (n, k), no NaN rows.

    Per objective, sort the front; the two extremes get infinity, an interior point adds the
    gap between its neighbours over the objective's range. An objective on which the front is
    flat adds nothing (no range to normalise by); a gap involving +/-inf is counted as 0 so
    that an infinite objective value cannot turn distances into NaN.
    """
    points = np.asarray(points, dtype=float)
    n, k = points.shape
    distance = np.zeros(n, dtype=float)
    if n <= 2:
        return np.full(n, np.inf)
    for j in range(k):
        order = np.argsort(points[:, j], kind="stable")
        column = points[order, j]
        span = column[-1] - column[0]
        distance[order[0]] = distance[order[-1]] = np.inf
        if not np.isfinite(span) or span <= 0:
            continue
        with np.errstate(invalid="ignore"):
            gaps = (column[2:] - column[:-2]) / span
        distance[order[1:-1]] += np.nan_to_num(gaps, nan=0.0, posinf=0.0, neginf=0.0)
    return distance


def _hv_contribution(points: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Each row's exclusive hypervolume contribution to one front ``points`` (n, k), maximised,
    up to ``reference`` (the rung's worst value per objective); the front's extremes get infinity,
    as in crowding, so that its ends are kept first."""
    n, k = points.shape
    if n <= 2:
        return np.full(n, np.inf)
    modes = ["max"] * k
    whole = hypervolume(points, modes=modes, reference=reference)
    contribution = np.array([whole - hypervolume(np.delete(points, i, axis=0), modes=modes, reference=reference)
                             for i in range(n)])
    for j in range(k):
        contribution[np.argmax(points[:, j])] = contribution[np.argmin(points[:, j])] = np.inf
    return contribution


def _rung_order(points: np.ndarray, favoured: int | None = None,
                ranking: str = "crowding") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ranks, spread, order)`` of a rung's rows ``points`` (n, k), maximised, in arrival
    order. ``spread`` is the crowding distance or hypervolume contribution within each row's
    front (``ranking``). ``order`` lists the valid rows best first: rank ascending, spread
    descending, then ``favoured`` (the trial being judged) before exact ties, then arrival. NaN
    rows have rank -1 and spread NaN and are left out of ``order``."""
    points = np.asarray(points, dtype=float)
    ranks = _nondominated_ranks(points)
    crowding = np.full(len(points), np.nan)
    valid_points = points[ranks >= 0]
    reference = valid_points.min(axis=0) if len(valid_points) else None
    for rank in range(ranks.max(initial=-1) + 1):
        members = np.flatnonzero(ranks == rank)
        crowding[members] = (_hv_contribution(points[members], reference) if ranking == "hv_contribution"
                             else _crowding_distance(points[members]))
    valid = np.flatnonzero(ranks >= 0)
    order = sorted(valid, key=lambda i: (ranks[i], -crowding[i], i != favoured, i))
    return ranks, crowding, np.array(order, dtype=int)


def _decide(recorded: Mapping[str, np.ndarray], trial_id: str, reduction_factor: float,
            ranking: str = "crowding", keep_front: bool = True) -> str:
    """CONTINUE or STOP for ``trial_id``, already in ``recorded`` (trial id -> maximised
    objective vector, in arrival order, for one rung); the rule is in the module docstring."""
    ids = list(recorded)
    me = ids.index(trial_id)
    points = np.array([recorded[t] for t in ids], dtype=float)
    if np.isnan(points[me]).any():
        return STOP  # nothing known: the worst
    ranks, _, order = _rung_order(points, favoured=me, ranking=ranking)
    if ranks[me] == 0 and keep_front:
        return CONTINUE  # on the rung's Pareto front: nothing recorded here beats it
    quota = max(1, math.ceil(len(order) / reduction_factor))
    position = int(np.flatnonzero(order == me)[0])
    return CONTINUE if position < quota else STOP


class _Rung:
    """One milestone and the objective vectors recorded there, in arrival order."""

    def __init__(self, milestone: float) -> None:
        self.milestone = milestone
        self.recorded: dict[str, np.ndarray] = {}
        self.stopped = 0  # how many trials this rung stopped

    def debug_str(self) -> str:
        if not self.recorded:
            return f"Iter {self.milestone:g}: 0 recorded"
        points = np.array(list(self.recorded.values()), dtype=float)
        ranks = _nondominated_ranks(points)
        return (
            f"Iter {self.milestone:g}: {len(self.recorded)} recorded, {int((ranks == 0).sum())} on the front, "
            f"{self.stopped} stopped"
        )


class MOASHAScheduler(FIFOScheduler):
    """Asynchronous successive halving on several objectives (see the module docstring).

    Args:
        objectives: ``(result key, "max" | "min")`` pairs, e.g.
            ``[("best_val_acc", "max"), ("throughput", "max")]``.
        time_attr: The result key that measures progress; it must increase monotonically
            (``"training_iteration"`` or, for this project's trainable, ``"epoch"``).
        max_t: Trials are stopped when ``time_attr`` reaches this.
        grace_period: The first rung; no trial is stopped before it.
        reduction_factor: About ``1 / reduction_factor`` of a rung's trials go on (more when its
            Pareto front is larger).
        ranking: How a front is ordered at the quota's edge (``RANKINGS``, the spec's
            ``scheduler.ranking``): "crowding" (NSGA-II) or "hv_contribution".
        keep_front: Rule 4: a trial on its rung's front always goes on (the spec's
            ``scheduler.keep_front``). False: the quota alone decides (the published MO-ASHA's
            rule, Schmucker et al. 2021).

    A FIFOScheduler subclass, like Ray's AsyncHyperBandScheduler: trials start in submission
    order and only ``on_trial_result`` makes decisions.
    """

    def __init__(
        self,
        *,
        objectives: Sequence[tuple[str, str]],
        time_attr: str = "training_iteration",
        max_t: float,
        grace_period: float = 1,
        reduction_factor: float = 2,
        ranking: str = "crowding",
        keep_front: bool = True,
    ) -> None:
        objectives = [(str(key), str(mode)) for key, mode in objectives]
        if not objectives:
            raise ValueError("objectives must name at least one (result key, mode) pair")
        for key, mode in objectives:
            if mode not in ("max", "min"):
                raise ValueError(f"objective {key!r}: mode must be 'max' or 'min', got {mode!r}")
        if len({key for key, _ in objectives}) != len(objectives):
            raise ValueError(f"objectives name a result key twice: {objectives}")
        if not max_t > 0:
            raise ValueError(f"max_t must be positive, got {max_t}")
        if not 0 < grace_period <= max_t:
            raise ValueError(f"grace_period must be in (0, max_t={max_t}], got {grace_period}")
        if not reduction_factor > 1:
            raise ValueError(f"reduction_factor must be > 1, got {reduction_factor}")
        if ranking not in RANKINGS:
            raise ValueError(f"ranking must be one of {', '.join(RANKINGS)}, got {ranking!r}")

        super().__init__()
        self._objectives = objectives
        self._time_attr = time_attr
        self._max_t = max_t
        self._grace_period = grace_period
        self._reduction_factor = reduction_factor
        self._ranking = ranking
        self._keep_front = keep_front
        # Milestones below max_t only: at max_t the trial is stopped anyway (ASHA builds a rung
        # at max_t when it is a power of rf, but with stop_last_trials it is never consulted).
        milestones = []
        milestone = grace_period
        while milestone < max_t:
            milestones.append(milestone)
            milestone *= reduction_factor
        self._rungs = [_Rung(m) for m in milestones]  # ascending
        self._num_stopped = 0  # stopped at a rung (not counting those that reached max_t)

    @property
    def objectives(self) -> list[tuple[str, str]]:
        return list(self._objectives)

    @property
    def milestones(self) -> list[float]:
        return [r.milestone for r in self._rungs]

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        # The objectives come from the constructor; a single Tune metric/mode has no place in
        # them and is ignored rather than refused (returning False makes Tune raise). _metric
        # stays None on purpose: Tune's strict metric check would otherwise demand it in every
        # result.
        return True

    def on_trial_result(self, tune_controller: "TuneController", trial: Trial, result: dict) -> str:
        t = _progress(result, self._time_attr)
        if t is None:
            return CONTINUE  # like ASHA: no progress value, no decision
        if t >= self._max_t:
            return STOP  # the budget is spent (ASHA with stop_last_trials=True)
        action = self._on_result(trial.trial_id, t, result)
        if action == STOP:
            self._num_stopped += 1
        return action

    def on_trial_complete(self, tune_controller: "TuneController", trial: Trial, result: dict) -> None:
        # Like ASHA: a trial that ends on its own (patience, error-free return) right at a
        # milestone is still recorded there, so that later trials are compared with it.
        t = _progress(result or {}, self._time_attr)
        if t is not None:
            self._on_result(trial.trial_id, t, result)

    def _on_result(self, trial_id: str, t: float, result: Mapping[str, Any]) -> str:
        """Record and judge at the highest milestone reached, once per trial and rung.

        ASHA walks the milestones downwards and judges at the highest one not yet recorded, so a
        trial whose time_attr jumps past several milestones is judged at the lower ones on later
        results, with later (better) values. We judge only at the highest milestone reached and
        leave skipped lower rungs alone; with integer epochs reported one by one the two agree.
        """
        rung = next((r for r in reversed(self._rungs) if t >= r.milestone), None)
        if rung is None or trial_id in rung.recorded:
            return CONTINUE
        rung.recorded[trial_id] = _objective_vector(result, self._objectives)
        action = _decide(rung.recorded, trial_id, self._reduction_factor, self._ranking, self._keep_front)
        if action == STOP:
            rung.stopped += 1
        return action

    def debug_string(self) -> str:
        objectives = ", ".join(f"{key} ({mode})" for key, mode in self._objectives)
        out = f"Using MO-ASHA on {objectives}: num_stopped={self._num_stopped}"
        return out + "\nRungs: " + " | ".join(r.debug_str() for r in self._rungs)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


def _progress(result: Mapping[str, Any], time_attr: str) -> float | None:
    """``result[time_attr]`` as a float, or None where it is missing or not a number."""
    value = result.get(time_attr)
    if isinstance(value, bool) or not isinstance(value, (Real, np.integer, np.floating)):
        return None
    value = float(value)
    return None if math.isnan(value) else value

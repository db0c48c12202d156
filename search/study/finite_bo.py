"""``algorithm: botorch``: BoTorch's qLogNEHVI over every point of a finite space, as an Optuna sampler.

Daulton, Balandat & Bakshy (2021), "Parallel Bayesian optimization of multiple noisy objectives
with expected hypervolume improvement" (NeurIPS), in the log form of Ament et al. (2023),
"Unexpected improvements to expected improvement" (NeurIPS). The model and the acquisition are set
up as optuna-integration's ``qnehvi_candidates_func`` sets them up: a SingleTaskGP with
standardised outcomes, 256 Sobol quasi-MC samples, a pruned baseline, the reference point just
below the observed minimum. What differs:

- **the optimiser**: every point of the space not yet asked is scored and the best is taken
  (BoTorch's ``optimize_acqf_discrete`` rule), instead of gradient restarts in a box and rounding.
  A proposal is a point of the space, and no point is proposed twice: one that MO-ASHA stopped or
  a constraint rejected is not asked again, so the model moves on to its neighbours;
- **what it learns from**: COMPLETE trials only (the rule of search.study.searcher), and the GP is
  fitted once per COMPLETE trial. Between two, the fit (seeded by their number) is the same;
- **parallel trials**: the trials still running are pending points (``X_pending``), so two trials
  proposed side by side are not the same guess twice.

The knobs are encoded in [0, 1]: an integer (an ``ordered`` choice's position, an int range) by its
position among its values, an unordered choice one-hot. A continuous knob reaches it as an ordered
choice of the spec's ``algorithm.levels`` values (``SearchSpec.sampled_param``). Until ``n_startup_trials`` trials are
COMPLETE it proposes points drawn at random among those not asked.

benchmarks/replay_search.py measures it as ``botorch+MO-ASHA`` (this sampler) and as the peer
``botorch-grid+MO-ASHA`` (the same rule, written against the recording); docs/search_efficiency.md
has the figures and why it is not the default.
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.study import StudyDirection
from optuna.trial import TrialState

__all__ = ["FiniteQNEHVISampler", "finite_values", "STARTUP_TRIALS", "MC_SAMPLES"]

STARTUP_TRIALS = 10  # optuna-integration's BoTorchSampler default
MC_SAMPLES = 256  # qnehvi_candidates_func's
_BATCH = 2048  # points scored at once (memory: batch x MC samples x objectives)


def finite_values(distribution: BaseDistribution) -> tuple[Any, ...]:
    """Every value ``distribution`` takes, in order: an int range's steps, a categorical's choices."""
    if isinstance(distribution, IntDistribution):
        return tuple(range(distribution.low, distribution.high + 1, distribution.step))
    if isinstance(distribution, CategoricalDistribution):
        return tuple(distribution.choices)
    raise ValueError(f"{distribution!r} is continuous: algorithm botorch scores every point of a finite space")


class FiniteQNEHVISampler(BaseSampler):
    """Optuna sampler: qLogNEHVI, maximised over the points of ``space`` not yet asked (see the
    module doc). ``space`` maps each knob to its Optuna distribution, as the study suggests it."""

    def __init__(self, space: Mapping[str, BaseDistribution], *, seed: int = 0,
                 n_startup_trials: int = STARTUP_TRIALS) -> None:
        self._space = dict(space)
        self._values = [finite_values(d) for d in self._space.values()]
        self._points = list(itertools.product(*self._values))
        self._seed, self._startup = seed, n_startup_trials
        self._rng = random.Random(seed)
        self._independent = RandomSampler(seed=seed)  # a knob outside ``space``: none in a study's own space
        self._fitted: tuple[int, Any] | None = None  # (COMPLETE trials, the GP fitted to them); not pickled
        self._scores: tuple[tuple, dict[tuple, float]] | None = None  # ((COMPLETE, pending), score per point)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fitted"] = None  # Tune pickles the searcher; the GP is refitted from the trials
        return state

    def exhausted(self, study) -> bool:
        """Every point of the space asked (the spec keeps budget.trials within the points; a replay
        counting epochs may ask more)."""
        return {self._point(t.params) for t in study.get_trials(deepcopy=False)} >= set(self._points)

    # -- Optuna's sampler interface ----------------------------------------------------------
    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        return dict(self._space)

    def sample_relative(self, study, trial, search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if search_space != self._space:
            return {}
        trials = [t for t in study.get_trials(deepcopy=False) if t.number != trial.number]
        asked = {self._point(t.params) for t in trials} - {None}
        free = [p for p in self._points if p not in asked]
        if not free:
            return {}  # every point asked (a resumed study's orphans): the independent sampler repeats one
        complete = [t for t in trials if t.state == TrialState.COMPLETE and self._point(t.params) is not None]
        if len(complete) < self._startup:
            return dict(zip(self._space, self._rng.choice(free)))
        pending = tuple(p for p in (self._point(t.params) for t in trials if t.state == TrialState.RUNNING)
                        if p is not None)
        scores = self.scores(complete, pending, study.directions)
        return dict(zip(self._space, max(free, key=scores.__getitem__)))  # the first of equal scores, as torch.argmax

    def sample_independent(self, study, trial, param_name: str, param_distribution: BaseDistribution) -> Any:
        return self._independent.sample_independent(study, trial, param_name, param_distribution)

    # -- the model -----------------------------------------------------------------------------
    def scores(self, complete: Sequence, pending: tuple, directions: Sequence[StudyDirection]) -> dict[tuple, float]:
        """qLogNEHVI of every point, given the COMPLETE trials (the GP, fitted once per their number)
        and the pending points."""
        key = (len(complete), pending)
        if self._scores is not None and self._scores[0] == key:
            return self._scores[1]
        import torch

        # torch's generator, seeded by the number of COMPLETE trials and left as it was: the fit's
        # restarts and the baseline's pruning (prune_inferior_points samples the posterior) draw from it
        with warnings.catch_warnings(), torch.random.fork_rng():
            warnings.filterwarnings("ignore", module="botorch|linear_operator|gpytorch")  # input-scaling advice, per fit
            torch.manual_seed(self._seed + len(complete))
            self._scores = (key, self._score(complete, pending, directions))
        return self._scores[1]

    def _score(self, complete: Sequence, pending: tuple, directions: Sequence[StudyDirection]) -> dict[tuple, float]:
        torch, parts = _botorch()
        signs = [1.0 if d == StudyDirection.MAXIMIZE else -1.0 for d in directions]
        x = torch.tensor([self._encode(self._point(t.params)) for t in complete], dtype=torch.float64)
        y = torch.tensor([[s * v for s, v in zip(signs, t.values)] for t in complete], dtype=torch.float64)
        if self._fitted is None or self._fitted[0] != len(complete):
            model = parts.gp(x, y, outcome_transform=parts.standardize(m=y.shape[-1]))
            parts.fit(parts.mll(model.likelihood, model))
            self._fitted = (len(complete), model)
        model = self._fitted[1]
        acqf = parts.acq(model=model, ref_point=(y.min(dim=0).values - 1e-8).tolist(), X_baseline=x,
                         prune_baseline=True, sampler=parts.sampler(sample_shape=torch.Size([MC_SAMPLES]),
                                                                    seed=self._seed + len(complete)),
                         X_pending=torch.tensor([self._encode(p) for p in pending], dtype=torch.float64)
                         if pending else None)
        choices = torch.tensor([self._encode(p) for p in self._points], dtype=torch.float64).unsqueeze(-2)  # (n, q=1, d)
        with torch.no_grad():  # as optimize_acqf_discrete evaluates its choices
            values = torch.cat([acqf(batch) for batch in choices.split(_BATCH)]).tolist()
        return dict(zip(self._points, values))

    def _point(self, params: Mapping[str, Any]) -> tuple | None:
        """A trial's point of the space (None: a trial that holds not every knob, or another value)."""
        try:
            point = tuple(params[k] for k in self._space)
        except KeyError:
            return None
        return point if all(v in values for v, values in zip(point, self._values)) else None

    def _encode(self, point: tuple) -> list[float]:
        """[0, 1] per knob: an integer's position among its values; a categorical one-hot."""
        out: list[float] = []
        for value, values, distribution in zip(point, self._values, self._space.values()):
            if isinstance(distribution, IntDistribution):
                out.append(values.index(value) / max(len(values) - 1, 1))
            else:
                out.extend(1.0 if value == v else 0.0 for v in values)
        return out


def _botorch():
    """torch and BoTorch's parts, imported when the model first fits (the driver starts without them)."""
    from types import SimpleNamespace

    import torch
    from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import SingleTaskGP
    from botorch.models.transforms.outcome import Standardize
    from botorch.sampling import SobolQMCNormalSampler
    from gpytorch.mlls import ExactMarginalLogLikelihood

    return torch, SimpleNamespace(acq=qLogNoisyExpectedHypervolumeImprovement, fit=fit_gpytorch_mll, gp=SingleTaskGP,
                                  standardize=Standardize, sampler=SobolQMCNormalSampler,
                                  mll=ExactMarginalLogLikelihood)

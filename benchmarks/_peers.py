"""The strong peers of ``benchmarks.replay_search`` (``--peers strong``): model-based and multi-fidelity
optimisers from other libraries, each driven through its own ask/tell interface as its authors
document it, on the recording's discrete points.

  botorch-qNEHVI, botorch-qNEHVI+MO-ASHA
      Optuna's BoTorchSampler (optuna-integration) with ``candidates_func=qnehvi_candidates_func``
      (BoTorch's qLogNEHVI: a SingleTaskGP, 256 quasi-MC samples, 20 restarts, 1024 raw samples,
      the sampler's settings), 10 start-up trials (its default); without stopping, and with this
      project's MO-ASHA stopping the trials it proposes.
  botorch-grid, botorch-grid+MO-ASHA
      BoTorch's qLogNEHVI set up as ``qnehvi_candidates_func`` sets it up (SingleTaskGP on the
      knobs' positions in [0, 1], outcomes standardised, 256 Sobol QMC samples, pruned baseline,
      the reference point just below the observed minimum), maximised over the recording's own
      configurations not yet asked by ``optimize_acqf_discrete``'s rule (BoTorch's optimiser for a
      finite candidate set: each scored, the best taken; scored once per COMPLETE trial) instead
      of gradient restarts in the box and rounding; 10 random
      start-up configurations, as the sampler's default. The same two ways.
  gp, gp+MO-ASHA
      Optuna's own GPSampler (LogEHVI for two objectives; Optuna's maintained GP path), the same two ways.
  smac-ParEGO
      SMAC3's HyperparameterOptimizationFacade (random forest, log EI) with ParEGO for the two
      objectives and ``max_config_calls=1``, as SMAC's multi-objective example sets it.
  smac-ParEGO+HB
      SMAC3's MultiFidelityFacade (Hyperband, eta 2 from 1 to the full epochs: the same rungs as
      the ASHA methods) with ParEGO.
  dehb
      DEHB (Awad et al. 2021) with eta 2 from 1 to the full epochs. DEHB is single-objective: it
      minimises 1 - best val_acc (as Ray's ASHA peer ranks by val_acc); its full-budget trials
      make its front like every other method's.

The recording's knobs are discrete and ordered. GP-based peers (BoTorch, Optuna's GP) propose one
integer per knob, the index into that knob's recorded values (Optuna rounds the continuous
candidate to the nearest index); SMAC and DEHB see ConfigSpace ordinal hyperparameters; the
others choose among each knob's values. Every method's proposal then passes through ``snap``: the
nearest *recorded* configuration (each knob by its position among its values). On a recording of
the full grid every proposal is recorded and it changes nothing; on a partial recording (a
random subset of the grid) it is the one mapping, the same for every method.

Multi-fidelity peers (SMAC with Hyperband, DEHB) ask for a configuration *at a fidelity*. A
configuration asked again at a higher fidelity resumes from its furthest earlier epoch (a
checkpoint), so only the extra epochs are paid: the same cost model as ASHA's promotions.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import warnings
from importlib import metadata
from types import SimpleNamespace

from benchmarks._conditional import ConditionalGrid, active_knobs

INSTALL = ("pip install -e '.[bench]' and pip install --no-deps dehb==0.1.2 syne-tune==0.16.0 (see pyproject.toml)")
STRONG = ("botorch-qNEHVI", "botorch-qNEHVI+MO-ASHA", "botorch-grid", "botorch-grid+MO-ASHA", "gp", "gp+MO-ASHA",
          "smac-ParEGO", "smac-ParEGO+HB", "dehb")
_IMPORTS = {"botorch-qNEHVI": ("botorch", "optuna_integration"), "botorch": ("botorch",), "gp": (), "smac": ("smac",),
            "dehb": ("dehb",), "syne": ("syne_tune",)}  # by the method's name's start; the first match


def imports(method: str) -> tuple[str, ...]:
    """The modules ``method`` imports beyond the project's own dependencies (the ``bench`` extra's)."""
    return next((modules for start, modules in _IMPORTS.items() if method.startswith(start)), ())


class Exhausted(Exception):
    """The peer has nothing left to propose (SMAC on a small grid): the search ends there."""


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def settings(budget_full_trials: int, budget_epochs: int, epochs: int) -> dict[str, dict]:
    """Each strong peer's library, version and settings, for the JSON."""
    return {
        "botorch-qNEHVI": {"library": f"optuna-integration {version('optuna-integration')}, botorch "
                                      f"{version('botorch')}, gpytorch {version('gpytorch')}",
                           "sampler": "optuna_integration.BoTorchSampler(candidates_func=qnehvi_candidates_func, "
                                      "n_startup_trials=10, seed=seed)",
                           "encoding": "one integer per knob: the index into its recorded values"},
        "botorch-grid": {"library": f"botorch {version('botorch')}, gpytorch {version('gpytorch')}",
                         "acquisition": "qLogNoisyExpectedHypervolumeImprovement(SingleTaskGP(outcome_transform="
                                        "Standardize), SobolQMCNormalSampler(256), prune_baseline=True, ref_point="
                                        "observed minimum - 1e-8): qnehvi_candidates_func's",
                         "optimiser": "optimize_acqf_discrete(q=1)'s rule over the recorded configurations not yet "
                                      "asked: each scored, the best taken; scored once per COMPLETE trial told "
                                      "(between two, the fit and so the scores are the same)",
                         "start_up": "10 random recorded configurations (until 10 COMPLETE trials)",
                         "encoding": "each knob's position among its recorded values, in [0, 1]"},
        "gp": {"library": f"optuna {version('optuna')}", "sampler": "optuna.samplers.GPSampler(seed=seed) "
               "(n_startup_trials=10, LogEHVI for 2 objectives)",
               "encoding": "one integer per knob: the index into its recorded values"},
        "smac-ParEGO": {"library": f"smac {version('smac')}, ConfigSpace {version('ConfigSpace')}",
                        "facade": "HyperparameterOptimizationFacade", "multi_objective": "ParEGO (default rho)",
                        "intensifier": "max_config_calls=1", "scenario": f"deterministic, n_trials="
                        f"{budget_full_trials} (the full trials the budget buys)",
                        "objectives": ["1 - best val_acc", "-log10 throughput"], "encoding": "ordinal"},
        "smac-ParEGO+HB": {"library": f"smac {version('smac')}", "facade": "MultiFidelityFacade",
                           "multi_objective": "ParEGO", "intensifier": "Hyperband(eta=2)",
                           "scenario": f"deterministic, min_budget 1, max_budget {epochs}, n_trials "
                                       f"{budget_epochs} (each trial costs at least one epoch)",
                           "encoding": "ordinal", "resumes": "from the furthest earlier epoch of that configuration"},
        "dehb": {"library": f"DEHB {version('DEHB')} (installed --no-deps: it pins numpy<2)",
                 "settings": f"eta=2, min_fidelity=1, max_fidelity={epochs}, n_workers=1, mutation_factor 0.5, "
                             "crossover_prob 0.5, strategy rand1_bin (defaults)",
                 "objective": "1 - best val_acc (single-objective)", "encoding": "ordinal",
                 "resumes": "from the furthest earlier epoch of that configuration"},
    }


def positions(grid: dict) -> list[dict]:
    """Per knob, each value's position among its values, 0 to 1 (every knob weighs the same)."""
    return [{v: i / max(len(values) - 1, 1) for i, v in enumerate(values)} for values in grid.values()]


def encode(grid: dict, config: tuple) -> list[float]:
    """A configuration as a GP's input: each knob's position among its values; in a conditional grid
    the model one-hot and a knob the model lacks at 0 (the one-hot tells it apart from a lowest value)."""
    if not isinstance(grid, ConditionalGrid):
        return [index[v] for index, v in zip(positions(grid), config)]
    active = active_knobs(grid, config)
    out = [float(config[0] == m) for m in grid["model"]]
    for (k, _), index, v in list(zip(grid.items(), positions(grid), config))[1:]:
        out.append(index[v] if k in active else 0.0)
    return out


def snap(grid: dict, recorded, proposal: tuple) -> tuple:
    """The recorded configuration nearest to a proposal: each knob as its position among its
    values (0 to 1, so every knob weighs the same), Euclidean distance, ties to the first in the
    recording's order. A recorded proposal is itself. In a conditional grid the knobs the proposed
    model lacks are dropped (None), and the nearest is one of that model's configurations."""
    if isinstance(grid, ConditionalGrid):
        active = active_knobs(grid, proposal)
        proposal = tuple(v if k in active else None for k, v in zip(grid, proposal))
        if proposal not in recorded:
            recorded = [c for c in recorded if c[0] == proposal[0]]
    if proposal in recorded:
        return proposal
    position = positions(grid)

    def where(config: tuple) -> list[float]:
        out = []
        for index, values, v in zip(position, grid.values(), config):
            if v is None or isinstance(v, str):  # a knob the model lacks, or the model: equal in every candidate
                continue
            if v not in index:  # between recorded values: its place on the line through them
                v = min(values, key=lambda x: abs(x - v))
            out.append(index[v])
        return out

    target = where(proposal)
    return min(recorded, key=lambda c: sum((a - b) ** 2 for a, b in zip(where(c), target)))


def _missing(what: str) -> SystemExit:
    return SystemExit(f"the strong peers need {what}: {INSTALL}; or leave them out with --methods")


def gp_sampler(name: str, seed: int):
    import optuna

    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    try:
        from optuna_integration import BoTorchSampler
        from optuna_integration.botorch import qnehvi_candidates_func
    except ImportError:
        raise _missing("optuna-integration and botorch") from None
    warnings.filterwarnings("ignore", module="botorch|linear_operator|gpytorch|optuna_integration")
    return BoTorchSampler(candidates_func=qnehvi_candidates_func, seed=seed)


class DiscreteQNEHVI:
    """BoTorch's qLogNEHVI over a finite set of configurations: ``propose(asked)`` the next one,
    ``tell(config, values)`` a COMPLETE trial's two objectives (both maximised). The model and
    acquisition are optuna-integration's ``qnehvi_candidates_func``'s; only the optimiser differs
    (every candidate scored, the best taken), so a proposal is a recorded configuration itself."""

    startup = 10

    def __init__(self, grid: dict, configs, seed: int):
        try:
            import torch
            from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
            from botorch.fit import fit_gpytorch_mll
            from botorch.models import SingleTaskGP
            from botorch.models.transforms.outcome import Standardize
            from botorch.sampling import SobolQMCNormalSampler
            from gpytorch.mlls import ExactMarginalLogLikelihood
        except ImportError:
            raise _missing("botorch") from None
        warnings.filterwarnings("ignore", module="botorch|linear_operator|gpytorch")
        self._torch = torch
        self._parts = SimpleNamespace(acq=qLogNoisyExpectedHypervolumeImprovement, fit=fit_gpytorch_mll,
                                      gp=SingleTaskGP, standardize=Standardize,
                                      sampler=SobolQMCNormalSampler, mll=ExactMarginalLogLikelihood)
        self._configs = list(configs)
        self._x = {c: encode(grid, c) for c in self._configs}
        self._rng = random.Random(seed)
        self._seed = seed
        self._told: list[tuple[tuple, list[float]]] = []
        # the acquisition's value of each configuration free when it was last computed, and how
        # many trials had been told then (see propose)
        self._scores: dict[tuple, float] = {}
        self._scored_at = -1

    def propose(self, asked) -> tuple:
        free = [c for c in self._configs if c not in asked]
        if not free:
            raise Exhausted
        if len(self._told) < self.startup:
            return self._rng.choice(free)
        if self._scored_at != len(self._told):
            acqf = self.acquisition_function()
            choices = self._torch.tensor([self._x[c] for c in free], dtype=self._torch.float64).unsqueeze(-2)  # (n, q=1, d)
            with self._torch.no_grad():  # as optimize_acqf_discrete evaluates its choices
                scores = self._torch.cat([acqf(batch) for batch in choices.split(2048)]).tolist()
            self._scores = dict(zip(free, scores))
            self._scored_at = len(self._told)
        # Nothing told since the scores were computed (a trial MO-ASHA stopped tells nothing): the
        # fit, seeded by the number told, and so the acquisition are the same as then, and the best
        # free configuration is what optimize_acqf_discrete would pick again (torch.argmax and max
        # both take the first of equal values). Fitting once per COMPLETE trial, not once per
        # proposal, is what lets a search with stopping finish on LCBench (hundreds of asks).
        return max(free, key=self._scores.__getitem__)

    def acquisition_function(self):
        """qLogNEHVI given the trials told, on a GP fitted to them (seeded by their number)."""
        torch, p = self._torch, self._parts
        torch.manual_seed(self._seed + len(self._told))  # the fit's restarts draw from torch's generator
        x = torch.tensor([self._x[c] for c, _ in self._told], dtype=torch.float64)
        y = torch.tensor([v for _, v in self._told], dtype=torch.float64)
        model = p.gp(x, y, outcome_transform=p.standardize(m=y.shape[-1]))
        p.fit(p.mll(model.likelihood, model))
        return p.acq(model=model, ref_point=(y.min(dim=0).values - 1e-8).tolist(), X_baseline=x, prune_baseline=True,
                     sampler=p.sampler(sample_shape=torch.Size([256]), seed=self._seed + len(self._told)))

    def tell(self, config: tuple, values: list[float]) -> None:
        self._told.append((config, list(values)))


def _config_space(grid: dict, seed: int):
    """Every knob an ordinal hyperparameter; in a conditional grid ``model`` categorical and each
    knob active only under the models that have it (ConfigSpace's InCondition)."""
    try:
        from ConfigSpace import CategoricalHyperparameter, ConfigurationSpace, InCondition, OrdinalHyperparameter
    except ImportError:
        raise _missing("ConfigSpace (with smac or DEHB)") from None
    space = ConfigurationSpace(seed=seed)
    if not isinstance(grid, ConditionalGrid):
        space.add([OrdinalHyperparameter(k, list(v)) for k, v in grid.items()])
        return space
    model = CategoricalHyperparameter("model", list(grid["model"]))
    # a knob of none of the recorded models (a recording under way) has no values: no hyperparameter
    knobs = {k: OrdinalHyperparameter(k, list(v)) for k, v in grid.items() if k != "model" and v}
    conditions = []
    for k, knob in knobs.items():
        owners = [m for m in grid["model"] if k in grid.models[m]]
        if len(owners) < len(grid["model"]):
            conditions.append(InCondition(knob, model, owners))
    space.add([model, *knobs.values(), *conditions])
    return space


class _Fidelity:
    """What the replay asks of a peer that picks a trial's epochs: ``fidelity`` (the epoch it stops
    at) and ``resumes`` (a configuration asked again continues from its checkpoint)."""

    resumes = True
    fidelity: int | None = None

    def report(self, result: dict) -> bool:
        return True  # the peer decided the epochs up front


class SmacSearch(_Fidelity):
    def __init__(self, method: str, grid: dict, epochs: int, seed: int, budget: int):
        try:
            from smac import HyperparameterOptimizationFacade as HPO, MultiFidelityFacade as MF, Scenario
            from smac.runhistory.dataclasses import TrialValue
        except ImportError:
            raise _missing("SMAC3") from None
        self._value, self._grid, self._epochs = TrialValue, grid, epochs
        self._dir = tempfile.mkdtemp(prefix="smac-replay-")
        hyperband = method.endswith("+HB")
        self.resumes = hyperband
        common = dict(objectives=["error", "neg_log_throughput"], deterministic=True, seed=seed,
                      output_directory=f"{self._dir}/run")
        if hyperband:
            scenario = Scenario(_config_space(grid, seed), n_trials=budget, min_budget=1, max_budget=epochs, **common)
            facade = MF
            intensifier = MF.get_intensifier(scenario, eta=2, incumbent_selection="highest_budget")
        else:
            scenario = Scenario(_config_space(grid, seed), n_trials=budget // epochs, **common)
            facade = HPO
            intensifier = HPO.get_intensifier(scenario, max_config_calls=1)
        self._smac = facade(scenario, self._never_called, multi_objective_algorithm=facade.get_multi_objective_algorithm(
            scenario), intensifier=intensifier, overwrite=True, logging_level=40)
        self._info = None

    @staticmethod
    def _never_called(config, seed: int = 0, budget: float = 0.0):  # ask/tell: SMAC never runs it
        raise AssertionError("the replay evaluates SMAC's trials")

    def ask(self, number: int) -> tuple:
        from smac.main.exceptions import ConfigurationSpaceExhaustedException

        try:
            self._info = self._smac.ask()
        except ConfigurationSpaceExhaustedException:
            raise Exhausted from None
        self.fidelity = int(round(self._info.budget)) if self._info.budget is not None else self._epochs
        return tuple(self._info.config.get(k) for k in self._grid)  # a knob the model lacks: None

    def done(self, result: dict, reached_max: bool) -> None:
        if result:
            self._smac.tell(self._info, self._value(cost=[1.0 - result["best_val_acc"], -result["log_throughput"]]))

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


class DehbSearch(_Fidelity):
    def __init__(self, grid: dict, epochs: int, seed: int):
        try:
            from dehb import DEHB
        except ImportError:
            raise _missing("DEHB") from None
        self._dir = tempfile.mkdtemp(prefix="dehb-replay-")
        self._grid = grid
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            space = _config_space(grid, seed)
            self._dehb = DEHB(cs=space, dimensions=len(space), min_fidelity=1, max_fidelity=epochs,
                              eta=2, n_workers=1, seed=seed, output_path=self._dir, log_level="ERROR")
        self._job = None

    def ask(self, number: int) -> tuple:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._job = self._dehb.ask()
            config = self._job["config"]  # a ConfigSpace configuration (DEHB converts its vector)
        self.fidelity = int(round(self._job["fidelity"]))
        return tuple(config.get(k) for k in self._grid)  # a knob the model lacks: None

    def done(self, result: dict, reached_max: bool) -> None:
        if result:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._dehb.tell(self._job, {"fitness": 1.0 - result["best_val_acc"], "cost": float(result["epoch"])})

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

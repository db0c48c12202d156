"""algorithm: botorch (search.study.finite_bo): the spec's checks, and the sampler on real Optuna
studies and BoTorch: random start-up among the points not asked, no point asked twice (a PRUNED
one included), a fit per COMPLETE trial, the pick of BoTorch's optimize_acqf_discrete, running
trials as pending points, and a study that runs it in Ray."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from search.spec import load_spec
from search.study.finite_bo import FiniteQNEHVISampler
from search.study.searcher import OptunaSpace, make_sampler, optuna_space
from search.views.cli import main
from tests.search.study.test_grid import _grid_spec, _write
from trainers.errors import ConfigError

SPACE = {"depth": IntDistribution(0, 4), "width": IntDistribution(8, 32, step=8),
         "pool": CategoricalDistribution(["mean", "token"])}  # 5 x 4 x 2 = 40 points


def _objectives(params: dict) -> list[float]:
    """Two maximised objectives in conflict: accuracy grows with depth and width, speed falls."""
    acc = 0.5 + 0.08 * params["depth"] - 0.01 * (params["depth"] - 3) ** 2 + 0.002 * params["width"] \
        + (0.03 if params["pool"] == "token" else 0.0)
    return [acc, 3.0 - 0.2 * params["depth"] - 0.02 * params["width"]]


def _study(sampler) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(directions=["maximize", "maximize"], sampler=sampler)


def _ask(study) -> optuna.trial.Trial:
    trial = study.ask()
    for name, distribution in SPACE.items():  # define-by-run, as OptunaSpace suggests
        trial._suggest(name, distribution)
    return trial


def _key(params: dict) -> tuple:
    return tuple(params[k] for k in SPACE)


def test_the_start_up_draws_points_not_asked_and_no_point_is_asked_twice_pruned_ones_included():
    space = {"depth": IntDistribution(1, 3), "width": IntDistribution(8, 16, step=8), "pool": SPACE["pool"]}  # 12 points
    sampler = FiniteQNEHVISampler(space, seed=1, n_startup_trials=4)
    study = _study(sampler)
    asked = []
    for number in range(12):
        assert not sampler.exhausted(study)
        trial = study.ask()
        for name, distribution in space.items():
            trial._suggest(name, distribution)
        asked.append(tuple(trial.params[k] for k in space))
        if number < 4 or number % 4 == 0:
            study.tell(trial, _objectives(trial.params))
        else:  # "stopped by MO-ASHA": PRUNED, no values
            study.tell(trial, state=TrialState.PRUNED)
    assert len(set(asked)) == 12 and sampler.exhausted(study)  # every point once, then the space is exhausted
    again = FiniteQNEHVISampler(space, seed=1, n_startup_trials=4)
    study = _study(again)
    for _ in range(4):
        trial = study.ask()
        for name, distribution in space.items():
            trial._suggest(name, distribution)
    assert [tuple(t.params[k] for k in space) for t in study.trials] == asked[:4]  # seeded: the same start-up


def test_a_fit_per_complete_trial_and_the_pick_is_optimize_acqf_discretes():
    import torch
    from botorch.optim import optimize_acqf_discrete

    sampler = FiniteQNEHVISampler(SPACE, seed=3, n_startup_trials=4)
    study = _study(sampler)
    fits = []
    fit = sampler.scores

    def counted(complete, pending, directions):
        before = sampler._fitted[0] if sampler._fitted else None
        out = fit(complete, pending, directions)
        if sampler._fitted[0] != before:
            fits.append(len(complete))
        return out

    sampler.scores = counted
    for number in range(10):
        trial = _ask(study)
        if number >= 4:  # after the start-up: BoTorch's optimiser on the same acquisition picks the same point
            complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            acqf = _acquisition(sampler, complete)
            asked = {_key(t.params) for t in study.trials if t.number != trial.number}
            free = [p for p in sampler._points if p not in asked]
            choices = torch.tensor([sampler._encode(p) for p in free], dtype=torch.float64)
            best, _ = optimize_acqf_discrete(acqf, q=1, choices=choices)
            assert _key(trial.params) == free[int(torch.cdist(best, choices).argmin())]
        if number < 5 or number % 3 == 0:
            study.tell(trial, _objectives(trial.params))
        else:
            study.tell(trial, state=TrialState.PRUNED)  # tells the model nothing
    # proposals 5-10 came after 4, 5, 5, 6, 6, 6 COMPLETE trials: one fit for each number
    assert fits == [4, 5, 6]


def _acquisition(sampler, complete):
    """qLogNEHVI on a GP fitted to ``complete``, built here from BoTorch's parts as the module doc
    says (seeded by the number of COMPLETE trials)."""
    import torch
    from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import SingleTaskGP
    from botorch.models.transforms.outcome import Standardize
    from botorch.sampling import SobolQMCNormalSampler
    from gpytorch.mlls import ExactMarginalLogLikelihood

    x = torch.tensor([sampler._encode(_key(t.params)) for t in complete], dtype=torch.float64)
    y = torch.tensor([t.values for t in complete], dtype=torch.float64)
    torch.manual_seed(3 + len(complete))
    model = SingleTaskGP(x, y, outcome_transform=Standardize(m=2))
    fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
    return qLogNoisyExpectedHypervolumeImprovement(
        model=model, ref_point=(y.min(dim=0).values - 1e-8).tolist(), X_baseline=x, prune_baseline=True,
        sampler=SobolQMCNormalSampler(sample_shape=torch.Size([256]), seed=3 + len(complete)))


def test_running_trials_are_pending_points_and_a_minimised_objective_is_turned_round():
    def run(pending: bool, minimise: bool) -> tuple:
        sampler = FiniteQNEHVISampler(SPACE, seed=2, n_startup_trials=6)
        study = optuna.create_study(directions=["maximize", "minimize" if minimise else "maximize"], sampler=sampler)
        for _ in range(6):
            trial = _ask(study)
            acc, speed = _objectives(trial.params)
            study.tell(trial, [acc, -speed if minimise else speed])
        first = _ask(study)  # left RUNNING
        if not pending:
            study.tell(first, state=TrialState.FAIL)
        return _key(first.params), _key(_ask(study).params), sampler

    first, second, sampler = run(pending=True, minimise=False)
    _, alone, _ = run(pending=False, minimise=False)
    assert second != first and second != alone  # the running point's improvement is counted as pending
    assert run(pending=True, minimise=True)[:2] == (first, second)  # min of -speed is max of speed
    clone = pickle.loads(pickle.dumps(sampler))  # Tune pickles the searcher: the GP is left out, refitted
    assert clone._fitted is None and clone._points == sampler._points


def test_the_spaces_distributions_are_what_the_study_suggests():
    space = OptunaSpace({"lr": _param("choice", values=[0.001, 0.002, 0.004], ordered=True)},
                        {"m": {"depth": _param("int", low=1, high=7, step=2), "pool": _param("choice", values=["a", "b"])}})
    study = _study(optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    space(trial)
    assert trial.distributions == space.distributions() == {
        "depth": IntDistribution(1, 7, step=2), "pool": CategoricalDistribution(["a", "b"]), "lr": IntDistribution(0, 2)}


def _param(kind: str, **kwargs):
    from search.spec import ParamSpec

    return ParamSpec(type=kind, **kwargs)


def _botorch_spec(tmp_path: Path, **changes) -> dict:
    """spaces/synthetic_smoke.yaml with a finite space (3 x 2 = 6 points) searched by botorch."""
    spec = _grid_spec(tmp_path, name="bo", space={"local_up_to_layer": {"type": "int", "low": 0, "high": 2},
                                                  "lr": {"type": "choice", "values": [2.0e-3, 5.0e-3], "ordered": True}},
                      algorithm={"name": "botorch", "seed": 0, "n_startup_trials": 2})
    del spec["train"]["lr"]
    spec["budget"].update(trials=4, max_epochs=2)
    spec.update(changes)
    return spec


@pytest.mark.parametrize("change,message", [
    ({"space": {"lr": {"type": "loguniform", "low": 1e-3, "high": 1e-2}}},
     "space.lr: botorch: knob lr is continuous; list its values with type: choice, or search it at N evenly "
     "spaced values with algorithm.levels: N (e.g. 5), or use tpe or gp"),
    ({"algorithm": {"name": "tpe", "levels": 5}},
     "algorithm.levels: only botorch searches continuous knobs at levels; remove it for tpe"),
    ({"space": {"lr": {"type": "loguniform", "low": 1e-3, "high": 1e-2}, "gate": {"type": "uniform", "low": 0, "high": 1}},
      "algorithm": {"name": "botorch", "levels": 150}},
     "algorithm.levels"),
    ({"space": {"lr": {"type": "loguniform", "low": 1e-3, "high": 1e-2}, "gate": {"type": "uniform", "low": 0, "high": 1},
                "depth": {"type": "int", "low": 1, "high": 3}}, "algorithm": {"name": "botorch", "levels": 100}},
     "space: botorch of 30000 points (100 x 100 x 3 values), more than 20000; list fewer values (type: choice) or "
     "give int ranges a larger step or continuous knobs fewer algorithm.levels"),
    ({"model": None, "models": [{"name": "ls_convit_nano"}, {"name": "ls_gmm_nano"}]},
     "models: botorch scores the points of one model's space; conditional spaces (several models:) are not supported"),
    ({"objectives": [{"metric": "val_acc", "mode": "max"}]},
     "algorithm.name: botorch maximises the expected hypervolume improvement of two or more objectives; with one "
     "objective use gp"),
    ({"budget": {"trials": 7, "max_epochs": 2}},
     "budget.trials: is 7, but botorch proposes each of the space's 6 points once; lower it to at most 6"),
    ({"space": {"depth": {"type": "int", "low": 1, "high": 30000}}},
     "space: botorch of 30000 points (30000 values), more than 20000"),
])
def test_botorch_specs_are_checked_in_one_line(tmp_path, capsys, change, message):
    spec = _botorch_spec(tmp_path)
    spec.update(change)
    spec = {k: v for k, v in spec.items() if v is not None}
    path = _write(tmp_path, spec, "bo.yaml")
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_botorch_spec_makes_the_sampler_of_its_points(tmp_path):
    spec = load_spec(_write(tmp_path, _botorch_spec(tmp_path), "bo.yaml"))
    sampler = make_sampler(spec)
    assert isinstance(sampler, FiniteQNEHVISampler) and sampler._startup == 2
    assert sampler._space == {"local_up_to_layer": IntDistribution(0, 2), "lr": IntDistribution(0, 1)}
    assert len(sampler._points) == 6


def test_the_levels_of_a_continuous_knob_by_hand():
    assert _param("uniform", low=0.1, high=3.0).levels(5) == (0.1, 0.825, 1.55, 2.275, 3.0)  # steps of 2.9 / 4
    # 10 ** (-1 + k / 2): 0.1, 0.31623, 1, 3.1623, 10, interior values to 4 significant digits
    assert _param("loguniform", low=0.1, high=10.0).levels(5) == (0.1, 0.3162, 1.0, 3.162, 10.0)
    assert _param("loguniform", low=1e-3, high=5e-3).levels(2) == (1e-3, 5e-3)
    assert _param("uniform", low=0.0, high=1.0, step=0.25).levels(3) == (0.0, 0.25, 0.5, 0.75, 1.0)  # its steps
    close = _param("uniform", low=1.0, high=1.0002).levels(5)  # 4 digits would make them one value: kept whole
    assert len(set(close)) == 5 and close[1] == pytest.approx(1.00005, abs=1e-12)


def test_botorch_searches_continuous_knobs_at_their_levels_as_ordered_choices(tmp_path):
    spec = _botorch_spec(tmp_path, algorithm={"name": "botorch", "seed": 0, "n_startup_trials": 2, "levels": 3})
    spec["space"]["gate_init"] = {"type": "uniform", "low": -1.0, "high": 3.0}
    spec = load_spec(_write(tmp_path, spec, "bo.yaml"))
    assert spec.sampled_param(spec.space["gate_init"]).values == (-1.0, 1.0, 3.0)
    assert spec.sampled_param(spec.space["local_up_to_layer"]) == spec.space["local_up_to_layer"]
    sampler = make_sampler(spec)
    assert sampler._space["gate_init"] == IntDistribution(0, 2) and len(sampler._points) == 3 * 2 * 3
    study = _study(sampler)
    for _ in range(4):  # start-up, then the GP
        trial = study.ask()
        ordered = optuna_space(spec)(trial) or {}  # suggests every knob; the ordered ones' values
        config = {**trial.params, **ordered}
        assert config["gate_init"] in (-1.0, 1.0, 3.0) and config["lr"] in (2.0e-3, 5.0e-3)
        study.tell(trial, [0.5 + 0.1 * config["local_up_to_layer"] - 0.01 * config["gate_init"] ** 2,
                           1.0 - 0.2 * config["local_up_to_layer"]])
    # other levels search other points: another study (a spec without levels keeps the hash it had
    # before the key existed: the shipped specs' hashes, tests/search/spec/test_spec_hash.py)
    four = spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update={"levels": 4})})
    assert four.spec_hash != spec.spec_hash


@pytest.mark.ray(seconds=70)
def test_a_botorch_study_runs_in_ray_and_trains_each_point_once(tmp_path, recwarn):
    from search.results.store import read_table

    # lr a continuous range searched at 2 levels: its ends, the values the finite spec lists
    spec = _botorch_spec(tmp_path, algorithm={"name": "botorch", "seed": 0, "n_startup_trials": 2, "levels": 2})
    spec["space"]["lr"] = {"type": "loguniform", "low": 2.0e-3, "high": 5.0e-3}
    path = _write(tmp_path, spec, "bo.yaml")
    assert main(["run", str(path)]) == 0
    trials = read_table(tmp_path / "results" / "bo" / "trials.parquet").to_pylist()
    points = [(t["local_up_to_layer"], t["lr"]) for t in trials]
    assert len(trials) == 4 and len(set(points)) == 4 and all(t["state"] == "COMPLETE" for t in trials), trials
    assert {t["lr"] for t in trials} <= {2.0e-3, 5.0e-3}
    journal = optuna.load_study(study_name="bo", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "results" / "bo" / "optuna.journal"))))
    assert [t.state for t in journal.trials] == [TrialState.COMPLETE] * 4  # the GP proposed the last two
    recorded = json.loads((tmp_path / "results" / "bo" / "experiment.json").read_text())["spec"]["algorithm"]
    assert recorded["name"] == "botorch" and recorded["n_startup_trials"] == 2
    # the fit runs inside Ray's define-by-run space, whose advice to move training out is not for it
    assert not [w for w in recwarn if "Define-by-run function" in str(w.message)]

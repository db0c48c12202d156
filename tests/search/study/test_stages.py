"""The runner's stages without Ray running: the scheduler each stage gets from the spec, and the
names Tune's snapshots of earlier studies pickled, found where those snapshots look for them."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml

from search.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]


def _spec(tmp_path: Path, **changes):
    data = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    data.update(changes)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path, check_model=False)


@pytest.mark.parametrize("scheduler,kind", [({"name": "asha"}, "AsyncHyperBandScheduler"),  # Ray's ASHAScheduler
                                            ({"name": "none"}, "FIFOScheduler"),
                                            ({"name": "mo_asha"}, "MOASHAScheduler"), ({}, "MOASHAScheduler")])
def test_the_search_gets_the_specs_scheduler_and_the_confirmation_none(tmp_path, scheduler, kind):
    from search.study.schedulers import scheduler_for

    spec = _spec(tmp_path, scheduler=scheduler)  # two objectives: left out, mo_asha
    assert type(scheduler_for(spec)).__name__ == kind
    assert type(scheduler_for(spec, confirmation=True)).__name__ == "FIFOScheduler"


def test_mo_ashas_options_reach_the_scheduler(tmp_path):
    from search.study.mo_asha import MOASHAScheduler
    from search.study.schedulers import scheduler_for

    spec = _spec(tmp_path, scheduler={"name": "mo_asha", "reduction_factor": 3, "ranking": "hv_contribution",
                                      "keep_front": False})
    scheduler = scheduler_for(spec)
    assert scheduler.objectives == [("best_val_acc", "max"), ("throughput", "max")]
    assert scheduler.milestones == MOASHAScheduler(objectives=scheduler.objectives, max_t=spec.budget.max_epochs,
                                                   grace_period=spec.grace_epochs, reduction_factor=3).milestones
    assert (scheduler._ranking, scheduler._keep_front) == ("hv_contribution", False)
    unset = scheduler_for(_spec(tmp_path, scheduler={"name": "mo_asha"}))
    assert (unset._ranking, unset._keep_front) == ("crowding", True)  # MOASHAScheduler's defaults


def test_names_pickled_by_earlier_studies_still_resolve():
    """Tune pickles the searcher's space, the trial-naming functions and the replicates' searcher
    into its snapshot by module and name; a study started before they moved still resumes."""
    from search.study.searcher import OptunaSpace, ReplicateSearcher, make_sampler
    from search.study.tuning import trial_dirname, trial_label

    for module, name, found in [("search.study.runner", "OptunaSpace", OptunaSpace),
                                ("search.study.runner", "make_sampler", make_sampler),
                                ("search.study.runner", "trial_label", trial_label),
                                ("search.study.runner", "trial_dirname", trial_dirname),
                                ("search.study.confirm", "ReplicateSearcher", ReplicateSearcher)]:
        assert pickle.loads(f"c{module}\n{name}\n.".encode()) is found
    with pytest.raises(AttributeError):
        import search.study.runner as runner

        runner.no_such_name  # noqa: B018

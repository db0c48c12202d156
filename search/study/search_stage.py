"""The search stage: the study's trials sampled by its searcher (Optuna, or a grid's points) and
trained under its scheduler, until ``budget.trials`` are done or the time limit ends it.

Ray and the Tune plug-ins are imported inside: `search.study.runner` imports this module, and
`import search` imports the runner.
"""

from __future__ import annotations

from search.study.schedulers import scheduler_for
from search.study.tuning import SEARCH_TUNE_DIR, StudyRun
from search.text import count

__all__ = ["run_search"]


def run_search(run: StudyRun) -> None:
    """The search of a new study, into an empty store, to the end."""
    from search.study.searcher import study_searcher

    spec, location = run.spec, run.location
    store = run.store()
    store.flush()  # empty files with the full schema: readers can open them from the start
    searcher, scheduler = study_searcher(spec, location), scheduler_for(spec)
    tuner = run.new_tuner(run.store_callback(store), name=SEARCH_TUNE_DIR, search_alg=searcher, scheduler=scheduler,
                          num_samples=spec.planned_trials, time_budget_s=spec.budget.time_limit_s)
    trials = spec.grid_plan() or count(spec.budget.trials, "trial")
    run.say(f"study {spec.name}: {trials} x up to {count(spec.budget.max_epochs, 'epoch')} of "
            f"{' / '.join(m.name for m in spec.candidates)}, objectives "
            f"{', '.join(f'{o.metric} ({o.mode})' for o in spec.objectives)}; results in {location}")
    if location.uri:
        run.say(f"staging the study's files in {location.local} (each uploaded after every write; "
                f"`python -m search dashboard {location.local}` shows it live)")
    run.fit(tuner)
    store.flush()

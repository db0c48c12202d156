"""Run a study: spec -> dataset prepared once -> Ray Tune + Optuna -> results store."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from search.hosts import check_bind_host, is_loopback_host
from search.results.location import STUDY_FILES, StudyLocation, default_cache_dir, resuming_at, study_location
from search.results.query import read_experiment_json
from search.results.replicates import REPLICATE_COLUMN
from search.results.store import TRIAL_VALUE_OF, ResultsStore, write_json_atomic
from search.spec.spec import ParamSpec, SearchSpec, to_plain
from search.study.driver import driving
from search.text import count
from trainers import PROJECT_ROOT, folder_problem, git_commit
from trainers.data import DatasetRequest, prepare_dataset
from trainers.errors import ConfigError, DiskFullError

# Ray, Optuna, torch and the Tune plug-ins (searcher, callbacks, scheduler) are imported inside the
# functions that use them: `search pareto` and the other readers import this module's package
# without paying for them.
__all__ = ["run_study", "resume_study", "check_dashboard_host", "OptunaSpace", "make_sampler"]


class OptunaSpace:
    """Define-by-run space for Optuna: one ``suggest_*`` per knob, bounds inclusive.

    With several candidate models, ``model`` is suggested first and only the chosen model's own
    knobs are suggested after it (the others stay unset: null in the store). A class rather than
    a closure: Tune pickles the searcher with the experiment state."""

    def __init__(self, shared: dict[str, ParamSpec], per_model: dict[str, dict[str, ParamSpec]]) -> None:
        self.shared = dict(shared)
        self.per_model = {name: dict(space) for name, space in per_model.items()}

    def __call__(self, trial) -> None:
        names = list(self.per_model)
        model = trial.suggest_categorical("model", names) if len(names) > 1 else names[0]
        for key, p in {**self.per_model[model], **self.shared}.items():
            if p.type == "choice":
                trial.suggest_categorical(key, list(p.values))
            elif p.type == "int":
                trial.suggest_int(key, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
            else:
                trial.suggest_float(key, p.low, p.high, log=p.type == "loguniform", step=p.step)
        return None


def make_sampler(spec: SearchSpec):
    import optuna

    from search.study.searcher import constraint_violation

    algorithm = spec.algorithm
    # With constraints, rejected trials count as infeasible, so the model learns to avoid them.
    constraints = {"constraints_func": constraint_violation} if spec.constraints else {}
    if algorithm.name == "tpe":
        kwargs: dict[str, Any] = {"seed": algorithm.seed, "multivariate": True, **constraints}
        if algorithm.n_startup_trials is not None:
            kwargs["n_startup_trials"] = algorithm.n_startup_trials
        return optuna.samplers.TPESampler(**kwargs)
    if algorithm.name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=algorithm.seed, **constraints)
    return optuna.samplers.RandomSampler(seed=algorithm.seed)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def trial_label(trial: Any) -> str:
    """'<id>_locality_strength=1.2,local_up_to_layer=3' — what the trial tries, at a glance."""
    config = ",".join(f"{k}={_short(v)}" for k, v in sorted(trial.config.items()))
    return f"{trial.trial_id}_{config}"


def trial_dirname(trial: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,-]", "_", trial_label(trial))[:120]


def check_ray_address(address: str, *, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` nobody listens on: Ray itself retries for minutes."""
    import socket

    if address == "auto" or "://" in address:
        return  # "auto" reads the local node's address file; ray:// is Ray Client's own protocol
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--address {address!r}: expected HOST:PORT of a Ray head node (e.g. 10.0.0.5:6379), 'auto' or ray://HOST:10001")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConfigError(
            f"--address {address}: no Ray head node answers there ({exc.strerror or exc}); check the address "
            "(`ray status` on the head node prints it) or leave --address out to start a local cluster"
        ) from None


def _check_experiment_dir(location: StudyLocation) -> None:
    if location.uri is None:
        problem = folder_problem(location.local)
        if problem:
            raise ConfigError(f"{location}: {problem}; pass --storage DIR, a folder you can write to")
    if location.exists("trials.parquet") or location.exists("experiment.json"):
        raise ConfigError(
            f"{location} already holds a study; pass --name NEW_NAME (or --storage DIR) for a new one, "
            "or delete that folder to start over"
        )


def _tune_environment() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # The store keeps the results; of Tune's own loggers only the JSON one is kept (its
    # ResultGrid reads result.json), not TensorBoard's and the CSV one.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # Every epoch checkpoints (so trials can be restored), which makes Tune warn about frequent
    # experiment snapshots; at one epoch per tens of seconds that cost is negligible.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Snapshot the experiment (trials, searcher) at least every second, so a killed driver
    # loses at most a second of bookkeeping (the default waits up to 10 s).
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")


def _dataset_request(spec: SearchSpec) -> DatasetRequest:
    return DatasetRequest(
        name=spec.dataset.name,
        data_dir=spec.dataset.data_dir,
        train_fraction=spec.dataset.train_fraction,
        val_fraction=spec.dataset.val_fraction,
        image_size=spec.dataset.image_size,
        seed=spec.algorithm.seed,
    )


def _prepare_data(spec: SearchSpec, cache_dir: str | os.PathLike | None, out: TextIO):
    # Converted here first: a missing or damaged dataset stops the run before Ray starts. Trials
    # prepare it again on their own node, which on this one finds these files (see search.study.trainable).
    data = prepare_dataset(_dataset_request(spec), cache_dir=cache_dir or default_cache_dir())
    print(
        f"dataset {data.name}: {data.counts['train']} train / {data.counts['val']} val images "
        f"({data.image_size}x{data.image_size}x{data.channels}, {data.num_classes} classes)",
        file=out, flush=True,
    )
    return data


def _prepare_cpu_kernel() -> None:
    """Trials on a CPU run the attention core's fused kernels: float32 everywhere, bf16 on a CPU with
    bf16 hardware; built here (once per machine and source; a build is slow) before any trial waits
    for them; where one cannot be built, one warning says why and trials run the core on torch ops."""
    import torch

    from trainers import prebuild_cpu_kernels

    if torch.cuda.is_available():
        return  # trials train on the GPU
    prebuild_cpu_kernels()


@contextlib.contextmanager
def _cpu_kernels_built_meanwhile():
    """`_prepare_cpu_kernel` in a thread while the body runs (the dataset's conversion, Ray's
    start: a first run's compiler and Ray's start-up overlap), joined before the body's result is
    used, so no trial starts before the kernels are there. Joined on errors too: a build killed
    halfway would leave its lock behind."""
    import threading

    failure: list[BaseException] = []

    def build() -> None:
        try:
            _prepare_cpu_kernel()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            failure.append(exc)

    thread = threading.Thread(target=build, name="cpu-kernels", daemon=False)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if failure:
        raise failure[0]


DASHBOARD_FLAG = "--allow-remote-dashboard"


def check_dashboard_host(dashboard_host: str, *, allow_remote: bool, address: str | None) -> None:
    """Before anything starts: a non-loopback dashboard needs ``allow_remote`` (the flag), and
    with ``address`` the cluster's head node has bound its dashboard already."""
    if address and not is_loopback_host(dashboard_host):
        raise ConfigError(
            f"--dashboard-host {dashboard_host}: applies only to the local cluster a run starts; with --address the "
            "head node's dashboard is already bound (`ray start --head --dashboard-host HOST` sets it)"
        )
    check_bind_host(dashboard_host, allow_remote=allow_remote, flag=DASHBOARD_FLAG, option="--dashboard-host",
                    what="Ray's dashboard, whose job API runs code on this machine")


def ray_token_auth_enabled() -> bool:
    """Whether this process's Ray uses token authentication (Ray >= 2.5x: on by default for a
    local cluster that ``ray.init()`` starts, unless ``RAY_AUTH_MODE=disabled``)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # an older Ray without token authentication
        return False
    try:
        return bool(is_token_auth_enabled())
    except Exception:
        return False


def _dashboard_notes(dashboard_host: str, url: str, out: TextIO) -> None:
    """After the URL line: how to log in when token auth is on; a warning when it is off on a
    non-loopback address."""
    if ray_token_auth_enabled():
        print("  (Ray token authentication is on: the dashboard asks for the token that `ray get-auth-token` prints)",
              file=out, flush=True)
    elif not is_loopback_host(dashboard_host):
        print(
            f"warning: the Ray dashboard listens on {dashboard_host} WITHOUT authentication (RAY_AUTH_MODE="
            f"{os.environ.get('RAY_AUTH_MODE', 'unset')}): anyone who reaches http://{url} can submit jobs that run code "
            "on this machine. Leave RAY_AUTH_MODE unset (Ray then requires a token) or bind 127.0.0.1",
            file=out, flush=True,
        )


# Not shipped to a cluster's nodes with the code (on top of what .gitignore leaves out).
# gitignore patterns: the leading "/" anchors a folder at the project root ("results/" alone would
# also leave out the package search/results/)
def _in_checkout() -> bool:
    """Whether this code runs from a checkout (its pyproject.toml beside the packages), not an install."""
    return (PROJECT_ROOT / "pyproject.toml").is_file()


def _shipped_code() -> dict[str, Any]:
    """Ray's runtime_env for a cluster's nodes: the checkout as the working_dir (a zip of it,
    .gitignore'd files and results left out); installed (site-packages is no project to ship
    whole), the two packages through py_modules."""
    if _in_checkout():
        return {"working_dir": str(PROJECT_ROOT), "excludes": SHIP_EXCLUDES}
    import search
    import trainers

    return {"py_modules": [str(Path(search.__file__).parent), str(Path(trainers.__file__).parent)],
            "excludes": ["__pycache__/", "*.pyc"]}


SHIP_EXCLUDES = ["/.git/", "/results/", "/tests/", "/benchmarks/", "/dashboards/", "*.beton", "*.parquet", "*.journal"]


def _init_ray(address: str | None, dashboard_host: str, out: TextIO) -> None:
    import ray

    if ray.is_initialized():
        return
    init_args: dict[str, Any] = {
        "log_to_driver": False,  # trial output goes to the trial folders; errors go to the store
        "configure_logging": True,
        "logging_level": "WARNING",
    }
    if address:
        check_ray_address(address)
        # Ray ships this project to every node, so the nodes need only the Python packages, not
        # a checkout at the same path (docs/cluster.md)
        init_args.update(address=address, runtime_env=_shipped_code())
    else:
        # "local": a cluster of our own, even when `ray start` left one running on this machine
        # (ray.init() would join that one, ignoring the dashboard settings); --address auto joins it.
        checkout = str(PROJECT_ROOT) if _in_checkout() else None  # installed: importable as it is
        pythonpath = os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))
        init_args.update(address="local", include_dashboard=True, dashboard_host=dashboard_host,
                         runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        context = ray.init(**init_args)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if not address:
            raise
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        auth = ""
        if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
            auth = ("; if the cluster uses token authentication (`ray start --head` turns it on by default), "
                    "run with RAY_AUTH_MODE=token and its token in ~/.ray/auth_token or RAY_AUTH_TOKEN")
        raise ConfigError(
            f"--address {address}: could not join that Ray cluster ({reason}); check the address "
            f"(ray status on the head node prints it) or leave --address out to start a local cluster{auth}"
        ) from None
    url = getattr(context, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}", file=out, flush=True)
        _dashboard_notes(dashboard_host if not address else "127.0.0.1", url, out)


def _store_for(spec: SearchSpec, location: StudyLocation) -> ResultsStore:
    objectives = [(o.metric, o.mode) for o in spec.objectives]
    return ResultsStore(location.local, space={k: p.to_json() for k, p in spec.all_params().items()},
                        objectives=objectives, reference=spec.reference_point,
                        location=location)


def _trainable_for(spec: SearchSpec, data, cache_dir: str | os.PathLike | None):
    from ray import tune

    from search.study.trainable import TrialTemplate, run_tune_trial

    template = TrialTemplate(
        models={m.name: dict(m.args) for m in spec.candidates},
        data=data,
        epochs=spec.budget.max_epochs,
        train=spec.train,
        throughput=spec.throughput,
        patience=spec.budget.patience,
        seed=spec.algorithm.seed,
        constraints=spec.parsed_constraints,
        # Each node converts the data (once, under a lock) and keeps its throughput measurements
        # in --cache-dir when given (a path valid on every node), else in its own default cache.
        dataset=_dataset_request(spec),
        cache_dir=str(Path(cache_dir).expanduser().resolve()) if cache_dir else None,
    )
    return tune.with_resources(tune.with_parameters(run_tune_trial, template=template), spec.resources.ray_resources())


def run_study(
    spec: SearchSpec,
    *,
    address: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    dashboard_host: str = "127.0.0.1",
    allow_remote_dashboard: bool = False,
    out: TextIO | None = None,  # None: sys.stdout when called (not when imported)
) -> Path:
    """Run ``spec`` to the end; returns the experiment folder holding the Parquet files.

    Ray's dashboard binds ``dashboard_host``; an address other than loopback needs
    ``allow_remote_dashboard`` (``--allow-remote-dashboard``)."""
    out = out or sys.stdout
    check_dashboard_host(dashboard_host, allow_remote=allow_remote_dashboard, address=address)
    for note in spec.notes():
        print(f"note: {note}", file=out, flush=True)
    if spec.budget.trials != spec.planned_trials:  # a grid: what it runs is what the study records (experiment.json)
        spec = spec.with_overrides(trials=spec.planned_trials)
    _tune_environment()
    location = study_location(spec.storage, spec.name)
    _check_experiment_dir(location)
    exp_dir = location.local  # with a URI: the staging folder, uploaded after every write
    with _cpu_kernels_built_meanwhile():
        data = _prepare_data(spec, cache_dir, out)
        _init_ray(address, dashboard_host, out)

    exp_dir.mkdir(parents=True, exist_ok=True)
    with driving(exp_dir):
        _check_experiment_dir(location)  # again: another driver may have started it meanwhile
        return _run(spec, location, data, cache_dir=cache_dir, out=out)


def _run(spec: SearchSpec, location: StudyLocation, data, *, cache_dir: str | os.PathLike | None,
         out: TextIO) -> Path:
    """The study's files, searcher, scheduler and callbacks, then Tune's run to the end (the
    caller drives the study: see search.study.driver)."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from search.study.mo_asha import MOASHAScheduler
    from search.study.searcher import HonestOptunaSearch, StudySearchGenerator

    exp_dir = location.local
    if location.uri:  # a staging folder left by an earlier study at this URI, since deleted there
        for name in STUDY_FILES:
            (exp_dir / name).unlink(missing_ok=True)
    commit = git_commit()
    write_json_atomic(
        {
            "name": spec.name,
            "spec": to_plain(spec),
            "spec_hash": spec.spec_hash,
            "objectives": [[o.metric, o.mode] for o in spec.objectives],
            "reference_point": spec.reference_point,
            "git_commit": commit,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "dataset": {"content_hash": data.content_hash, "counts": data.counts},
        },
        exp_dir / "experiment.json",
    )
    location.push(["experiment.json"])

    objectives = [(o.metric, o.mode) for o in spec.objectives]
    store = _store_for(spec, location)
    store.flush()  # empty files with the full schema: readers can open them from the start

    if spec.is_grid:
        searcher = _grid_searcher(spec)
    else:
        # The Optuna study lives in a journal next to the results: it survives a killed driver,
        # and optuna-dashboard opens it (optuna-dashboard <dir>/optuna.journal).
        searcher = HonestOptunaSearch(
            space=OptunaSpace(spec.space, {m.name: m.space for m in spec.candidates}),
            metric=[TRIAL_VALUE_OF[m] for m, _ in objectives],
            mode=[mode for _, mode in objectives],
            sampler=make_sampler(spec),
            study_name=spec.name,
            journal=location,
        )
    if spec.scheduler.name == "asha":
        scheduler = ASHAScheduler(
            time_attr="training_iteration",
            metric=TRIAL_VALUE_OF["val_acc"],
            mode="max",
            max_t=spec.budget.max_epochs,
            grace_period=spec.budget.grace_epochs,
            reduction_factor=spec.scheduler.reduction_factor,
        )
    elif spec.scheduler.name == "mo_asha":
        scheduler = MOASHAScheduler(
            objectives=[(TRIAL_VALUE_OF[m], mode) for m, mode in objectives],
            time_attr="training_iteration",
            max_t=spec.budget.max_epochs,
            grace_period=spec.budget.grace_epochs,
            reduction_factor=spec.scheduler.reduction_factor,
        )
    else:
        scheduler = FIFOScheduler()

    callback = _store_callback(spec, store, commit, out=out)
    tuner = _tuner(spec, location, _trainable_for(spec, data, cache_dir), callback, name="ray",
                   search_alg=StudySearchGenerator(searcher), scheduler=scheduler, num_samples=spec.planned_trials,
                   time_budget_s=spec.budget.time_limit_s, out=out)
    trials = spec.grid_plan() or count(spec.budget.trials, "trial")
    print(
        f"study {spec.name}: {trials} x up to {count(spec.budget.max_epochs, 'epoch')} of "
        f"{' / '.join(m.name for m in spec.candidates)}, objectives {', '.join(f'{m} ({mode})' for m, mode in objectives)}; "
        f"results in {location}",
        file=out, flush=True,
    )
    if location.uri:
        print(f"staging the study's files in {exp_dir} (each uploaded after every write; "
              f"`python -m search dashboard {exp_dir}` shows it live)", file=out, flush=True)
    with _no_results_preview_warning(), _disk_full_in_one_line(location):
        tuner.fit()
    store.flush()
    _confirm(spec, location, data, cache_dir=cache_dir, commit=commit, out=out)
    return exp_dir


def _grid_searcher(spec: SearchSpec):
    """Tune's searcher of a grid study: every point of the grid once per seed, seed by seed (all
    points at the first seed, then at the second: a study the time limit cuts short has whole
    replicates of the grid). No Optuna study: nothing is sampled. The searcher's position is saved
    with Tune's snapshot (see ReplicateSearcher), so a resumed grid repeats and skips no point."""
    from search.study.confirm import ReplicateSearcher
    from search.study.trainable import SEED_KEY

    points = spec.grid_points()
    return ReplicateSearcher([{**point, SEED_KEY: seed} for seed in spec.algorithm.grid_seeds for point in points])


def _store_callback(spec: SearchSpec, store: ResultsStore, commit: str | None, *, replicates: bool = False,
                    total_trials: int | None = None, out: TextIO):
    from search.study.callbacks import StoreCallback

    return StoreCallback(
        store,
        experiment=spec.name,
        model=spec.candidates[0].name,
        spec_hash=spec.spec_hash,
        git_commit=commit,
        seed=spec.algorithm.seed,
        total_trials=spec.planned_trials if total_trials is None else total_trials,
        time_limit_s=spec.budget.time_limit_s,
        max_epochs=spec.budget.max_epochs,
        objective_keys=[TRIAL_VALUE_OF[o.metric] for o in spec.objectives],
        replicates=replicates,
        out=out,
    )


def _tuner(spec: SearchSpec, location: StudyLocation, trainable, callback, *, name: str, search_alg, scheduler,
           num_samples: int, time_budget_s: float | None, out: TextIO):
    """Tune's run of one stage of the study: the search (``ray/``) or its confirmation (``ray-confirm/``)."""
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    from search.study.metrics import MetricsCallback
    from search.study.progress import ProgressBar
    from search.study.recovery import CheckpointRecovery
    from search.study.snapshot import SnapshotKeeper

    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=search_alg,
            scheduler=scheduler,
            num_samples=num_samples,
            reuse_actors=True,
            time_budget_s=time_budget_s,
            trial_name_creator=trial_label,
            trial_dirname_creator=trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=name,
            # Checkpoints and Tune's own state: written from every node, so a URI or shared path
            storage_path=location.tune_storage()[0],
            storage_filesystem=location.tune_storage()[1],
            # Order matters: checkpoints are recovered before a resumed trial restores, the bar is
            # erased before the store prints a trial's line, and the metrics read the store after
            # it has the trial's row.
            callbacks=[CheckpointRecovery(out=out), ProgressBar(callback, stream=out), callback,
                       MetricsCallback(callback.store, experiment=spec.name, total_trials=callback.total_trials),
                       SnapshotKeeper(), JsonLoggerCallback()],
            verbose=0,
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
            failure_config=tune.FailureConfig(max_failures=spec.budget.max_failures),
        ),
    )


def _confirm(spec: SearchSpec, location: StudyLocation, data, *, cache_dir: str | os.PathLike | None,
             commit: str | None, out: TextIO) -> None:
    """The confirmation stage (``budget.confirm``, see search.study.confirm): started once the
    search's trials are done, or taken up where a killed driver left it."""
    if spec.budget.confirm is None:
        return
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    from search.study.confirm import CONFIRM_FILE, CONFIRM_TUNE_DIR, ReplicateSearcher, confirmation_plan
    from search.study.searcher import StudySearchGenerator

    store = _store_for(spec, location)
    store.load_existing()
    tune_dir, filesystem = location.tune_dir(CONFIRM_TUNE_DIR), location.tune_storage()[1]
    if tune.Tuner.can_restore(tune_dir, storage_filesystem=filesystem):
        print(f"resuming the confirmation of study {spec.name}", file=out, flush=True)
        _mend_snapshot(location, CONFIRM_TUNE_DIR, out)
        with _no_results_preview_warning():
            tuner = tune.Tuner.restore(tune_dir, trainable=_trainable_for(spec, data, cache_dir),
                                       storage_filesystem=filesystem, resume_unfinished=True,
                                       resume_errored=False, restart_errored=False)
    else:
        limit = spec.budget.time_limit_s
        left = None if limit is None else limit - store.elapsed_s
        if left is not None and left <= 0:
            print(f"confirmation: none (the search used the time limit, budget.time_limit_s: {limit:g})", file=out, flush=True)
            return
        plan = confirmation_plan(spec, store, location.local)
        location.push([CONFIRM_FILE])
        configs = plan["configs"]
        if not configs:
            print("confirmation: none (no trial completed)", file=out, flush=True)
            return
        # Replicate rows a driver killed before Tune's first snapshot recorded: trained again.
        if store.forget_trials(set(), replicates=True):
            store.flush()
        print(f"confirmation: {count(len(plan['trials']), 'config')} (the front, then those tied with it; "
              f"budget.confirm.top: {plan['top']}) x {count(plan['seeds'], 'further seed')} = "
              f"{count(len(configs), 'trial')} at the full budget", file=out, flush=True)
        callback = _store_callback(spec, store, commit, replicates=True, total_trials=len(configs), out=out)
        tuner = _tuner(spec, location, _trainable_for(spec, data, cache_dir), callback, name=CONFIRM_TUNE_DIR,
                       search_alg=StudySearchGenerator(ReplicateSearcher(configs)), scheduler=FIFOScheduler(),
                       num_samples=len(configs), time_budget_s=left, out=out)
    with _no_results_preview_warning(), _disk_full_in_one_line(location):
        tuner.fit()


def _mend_snapshot(location: StudyLocation, name: str, out: TextIO) -> None:
    """Tune's snapshot cut short by a full disk: the last complete one put back (search.study.snapshot).
    A study at a URI is read as it is: Tune uploads only snapshots it finished writing."""
    from search.study.snapshot import restore_last_good

    if location.uri is None:
        said = restore_last_good(location.local / name)
        if said:
            print(said, file=out, flush=True)


@contextlib.contextmanager
def _disk_full_in_one_line(location: StudyLocation):
    """A full disk anywhere under Tune (the store's files, the Optuna journal, Tune's snapshot) as
    one line naming the fix, however Tune wrapped the error it met."""
    from trainers.errors import is_disk_full

    try:
        yield
    except Exception as exc:
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, DiskFullError):
                raise seen.with_traceback(None) from None
            if is_disk_full(seen):
                raise DiskFullError(f"{seen.filename or location}: the disk is full; free space on the study's file "
                                    f"system, then python -m search resume {location}", path=seen.filename) from None
            seen = seen.__cause__ or seen.__context__
        raise


@contextlib.contextmanager
def _no_results_preview_warning():
    """``Tuner.restore`` and the end of ``Tuner.fit`` read every trial's ``result.json`` into
    Tune's results (for ``tuner.get_results()``, which is never called here: the store has the
    results) and warn "Failed to fetch metrics" for each trial that has none -- one the snapshot
    has as not started, one the killed driver had not synced, one sampled but not started when
    the time limit ended the study. Only that warning, only there."""
    logger = logging.getLogger("ray.tune.analysis.experiment_analysis")

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to fetch metrics")

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def resume_study(
    exp_dir: str | os.PathLike,
    *,
    address: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    dashboard_host: str = "127.0.0.1",
    allow_remote_dashboard: bool = False,
    out: TextIO | None = None,  # None: sys.stdout when called (not when imported)
) -> Path:
    """Finish a study whose driver stopped (killed, crashed, interrupted): finished trials stay,
    running ones continue from their last epoch checkpoint, the rest are sampled as before."""
    out = out or sys.stdout
    check_dashboard_host(dashboard_host, allow_remote=allow_remote_dashboard, address=address)
    _tune_environment()
    location = StudyLocation(exp_dir)
    if not location.exists("experiment.json"):
        raise _no_study(location)
    location.local.mkdir(parents=True, exist_ok=True)  # a URI's staging folder, filled by pull()
    with driving(location.local):
        return _resume(location, address=address, cache_dir=cache_dir, dashboard_host=dashboard_host, out=out)


def _finished(spec: SearchSpec, store: ResultsStore, folder: Path) -> str:
    """What a finished study ran ('24 of 24 trials', with its replicates), or '' while any planned
    trial or replicate has not finished."""
    from search.study.confirm import CONFIRM_FILE

    search = [t for t in store.trials if t.get(REPLICATE_COLUMN) is None]
    if len(search) < spec.planned_trials:
        return ""
    done = f"{len(search)} of {spec.planned_trials} trials"
    if spec.budget.confirm is None:
        return done
    plan_file = folder / CONFIRM_FILE
    if not plan_file.is_file():
        return ""
    planned = len(read_experiment_json(plan_file).get("configs") or [])
    replicates = len(store.trials) - len(search)
    return f"{done}, {replicates} of {planned} replicates" if replicates >= planned else ""


def _no_study(location: StudyLocation) -> ConfigError:
    return ConfigError(f"{location}: no experiment.json; pass the folder of a study started by `python -m search run`")


def _resume(location: StudyLocation, *, address: str | None, cache_dir: str | os.PathLike | None, dashboard_host: str,
            out: TextIO) -> Path:
    """The study's files here (pulled from its URI), its data and Ray, then Tune's restore and run
    to the end (the caller drives the study: see search.study.driver)."""
    from ray import tune

    from search.spec.validation import SpecLocation, from_plain

    location.pull()  # with a URI: the study's files into this machine's staging folder
    exp_dir = location.local
    meta_path = exp_dir / "experiment.json"
    tune_dir, filesystem = location.tune_dir(), location.tune_storage()[1]
    if not meta_path.is_file():
        raise _no_study(location)
    meta = read_experiment_json(meta_path)  # (trials.parquet may not be there yet)
    if not isinstance(meta.get("spec"), dict):
        raise ConfigError(f"{meta_path}: no 'spec' object; the study's files are damaged")
    plain = dict(meta["spec"])
    plain.pop("source", None)
    spec = from_plain(SearchSpec, plain, SpecLocation(str(meta_path)))
    limit = spec.budget.time_limit_s
    store = _store_for(spec, location)
    store.load_existing()
    if limit is not None and store.elapsed_s >= limit:  # Tune would restore and stop at once: say so, without Ray
        print(f"study {spec.name} ran its time limit ({store.elapsed_s:.0f} s of budget.time_limit_s: {limit:g}); "
              f"nothing left to resume in {location}", file=out, flush=True)
        return exp_dir
    finished = _finished(spec, store, exp_dir)
    if finished:  # every trial (and replicate) planned has finished: nothing for Ray to do
        print(f"study {spec.name} is finished ({finished}); nothing left to resume in {location}", file=out, flush=True)
        return exp_dir
    if not tune.Tuner.can_restore(tune_dir, storage_filesystem=filesystem):
        raise ConfigError(f"{location}: Ray Tune saved no state there (the study stopped before its first trial, or "
                          "its ray/ folder is gone), so it cannot be resumed; run the spec again with --name NEW_NAME "
                          "(what this study has stays readable)")
    with _cpu_kernels_built_meanwhile():
        data = _prepare_data(spec, cache_dir, out)
        _init_ray(address, dashboard_host, out)
    print(f"resuming study {spec.name} in {location}", file=out, flush=True)
    _mend_snapshot(location, "ray", out)
    # The searcher, the scheduler and the store callback come back from Tune's own snapshot; the
    # callback reloads the rows already in the Parquet files (StoreCallback.setup). Their study
    # location is this one, wherever the snapshot was taken (a folder moved since, another machine).
    with resuming_at(location) as elsewhere:
        with _no_results_preview_warning():
            tuner = tune.Tuner.restore(
                tune_dir,
                trainable=_trainable_for(spec, data, cache_dir),
                storage_filesystem=filesystem,
                resume_unfinished=True,
                resume_errored=False,  # trials that raised stay FAILED; the ones the dying driver cut off are "unfinished"
                restart_errored=False,
            )
        if elsewhere:
            print(f"the study was in {', '.join(elsewhere)} when it stopped; it carries on in {location}",
                  file=out, flush=True)
        with _no_results_preview_warning(), _disk_full_in_one_line(location):
            tuner.fit()
        _confirm(spec, location, data, cache_dir=cache_dir, commit=git_commit(), out=out)
    return exp_dir

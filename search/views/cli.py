"""``python -m search``: run a study, print its Pareto front, pick and retrain one of its trials, watch it.

User errors (a bad spec, a missing dataset, a folder that is not a study) print one line and
exit with code 2; nothing is half-written. Output cut short by its reader (``| head``) ends the
command quietly with code 141, as a Unix tool killed by SIGPIPE does.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from search.text import count
from trainers.errors import ConfigError

__all__ = ["main"]

# Each command imports its modules when it runs (the _cmd_* functions): start-up stays quick, and
# the readers (`pareto`, `select`, `compare`, `dashboard`) never import Ray or torch.

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away
EXIT_CODES = f"""exit codes:
  0    done
  1    the command ran but failed: every trial of a run failed, a suite's study failed
  {EXIT_USER_ERROR}    a user error, named in one line on stderr: a bad spec, option or path; nothing was written
  130  interrupted (Ctrl-C); a run's finished trials are in the study folder
  {EXIT_BROKEN_PIPE}  the output's reader went away (e.g. | head), as for a Unix tool killed by SIGPIPE"""


def _prog() -> str:
    """How the user called us: the console script's name, or ``python -m search``."""
    return "locality-search" if Path(sys.argv[0]).name == "locality-search" else "python -m search"


def version() -> str:
    """The installed distribution's version, or the checkout's pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("locality-search")
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def _one_line(message: str) -> str:
    """``message`` on one line: a line break or other control character in what the user typed
    (a path, a profile name) is shown escaped, as repr shows it."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 too; keep one line
        print(_one_line(f"error: {self.prog}: {message}; see {self.prog} --help"), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def _port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535; 0 picks a free one)")
    return port


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--where", action="append", default=[], metavar="EXPR",
                        help="keep the trials where EXPR holds before taking the front: COLUMN OP VALUE with OP "
                        "one of >= <= > < == !=, e.g. 'throughput>=5000' (repeat: all must hold)")
    parser.add_argument("--family", action="append", default=[], metavar="NAME",
                        help="keep the trials of these model families (repeat, or a comma list: convit,gmm)")


def _add_dashboard_host(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dashboard-host", default="127.0.0.1", metavar="HOST",
                        help="address Ray's dashboard binds (default 127.0.0.1: this machine only; "
                        "another address also needs --allow-remote-dashboard)")
    parser.add_argument("--allow-remote-dashboard", action="store_true",
                        help="let --dashboard-host be a non-loopback address such as 0.0.0.0: Ray's dashboard and "
                        "its job API (which runs code) become reachable from other machines")


def _add_profile(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", metavar="NAME",
                        help="apply this profile of the spec's 'profiles:' block (default: its default_profile), "
                        "e.g. --profile gpu for the full-size study")


def _profile_line(spec, why: str) -> str:
    """Which profile a run or check uses, and why ('' where the file has none)."""
    return f"profile {spec.profile} ({why})" if spec.profile else ""


def _plan(spec) -> str:
    """What a run of ``spec`` would do and ask for: trials, epochs, data, resources per trial."""
    res = spec.resources
    asks = [f"{res.cpus:g} CPU" + ("" if res.cpus == 1 else "s")]
    if res.gpus:
        shared = f" ({int(1 / res.gpus)} trials share a GPU)" if res.gpus < 1 and int(1 / res.gpus) > 1 else ""
        asks.append(f"{res.gpus:g} GPU" + ("" if res.gpus <= 1 else "s") + shared)
    asks += [f"{amount:g} {name}" for name, amount in res.custom.items()]
    data = spec.dataset
    limit = f", time limit {spec.budget.time_limit_s:g} s" if spec.budget.time_limit_s else ""
    trials = spec.grid_plan() or count(spec.budget.trials, "trial")
    scaled = f" ({spec.budget.full_data_epochs:g} of the whole split)" if spec.budget.full_data_epochs else ""
    drawn = " (each trial's seed draws its split)" if data.split_per_trial else ""
    return (f"{trials} x up to {count(spec.budget.max_epochs, 'epoch')}{scaled} "
            f"(scheduler {spec.scheduler.name}, grace {spec.grace_epochs}{limit}) of "
            f"{' / '.join(m.name for m in spec.candidates)} on {data.train_fraction:.0%} of {data.name}'s training "
            f"images{drawn}, batch {spec.train.batch_size}; each trial asks for {', '.join(asks)}"
            + (f"; then up to {count(spec.budget.confirm.top, 'config')} of the front x "
               f"{count(spec.budget.confirm.seeds, 'further seed')} (budget.confirm)" if spec.budget.confirm else ""))


def _build_parser() -> argparse.ArgumentParser:
    prog = _prog()
    parser = _Parser(prog=prog, description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"{prog} {version()} (locality-search)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run the search described by a spec file")
    run.add_argument("spec", help="a YAML search spec, e.g. spaces/convit_locality.yaml")
    run.add_argument("--trials", type=int, help="number of trials (overrides budget.trials)")
    run.add_argument("--max-epochs", type=int, help="epochs per trial (overrides budget.max_epochs)")
    run.add_argument("--storage", help="results directory, or a URI every node can reach: s3://bucket/prefix, gs://..., file:///shared/... (overrides storage)")
    run.add_argument("--name", help="study name, the folder under storage (overrides name)")
    run.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                     help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    run.add_argument("--data-dir", help="where the dataset's files are (overrides the catalog's path)")
    run.add_argument("--cache-dir", help="where converted .beton files are kept "
                     "(default: $LOCALITY_SEARCH_CACHE or ~/.cache/locality-search/datasets)")
    _add_profile(run)
    _add_dashboard_host(run)

    resume = commands.add_parser("resume", help="finish a study whose driver stopped (killed, crashed, interrupted)")
    resume.add_argument("study", help="the study folder or URI, e.g. results/convit_locality or s3://bucket/studies/convit_locality")
    resume.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    resume.add_argument("--cache-dir", help="where converted .beton files are kept (as for run)")
    _add_dashboard_host(resume)

    pareto = commands.add_parser(
        "pareto", help="print the Pareto front of a study, or one trial of it (--select), or export it (--export)"
    )
    pareto.add_argument("study", help="a study folder or URI, e.g. results/convit_locality or s3://bucket/studies/convit_locality")
    pareto.add_argument("--format", choices=("table", "json", "csv"), default="table")
    pareto.add_argument("--device", metavar="NAME",
                        help="only trials whose throughput was measured on this device (throughput_device)")
    pareto.add_argument("--mix-devices", action="store_true",
                        help="one front over trials measured on different devices (by default each device gets its own)")
    _add_filters(pareto)
    pareto.add_argument("--select", metavar="RULE",
                        help="print the one trial of the front that RULE picks: knee, max-acc, max-throughput, "
                        "max:COLUMN or min:COLUMN")
    pareto.add_argument("--export", metavar="PATH.yaml",
                        help="write the selected trial (--select, default knee) as a config that "
                        "`python -m search train PATH.yaml` retrains")

    train = commands.add_parser("train", help="retrain an exported trial from scratch and test it once")
    train.add_argument("config", help="a config written by `pareto --export`, e.g. best.yaml")
    train.add_argument("--out", help="folder for model.pt and result.parquet (default: <config stem>-train/ next to it)")
    train.add_argument("--epochs", type=int, help="epochs to train (overrides the config's)")
    train.add_argument("--data-dir", help="where the dataset's files are (overrides the config's)")
    train.add_argument("--cache-dir", help="where converted .beton files are kept "
                       "(default: $LOCALITY_SEARCH_CACHE or ~/.cache/locality-search/datasets)")
    train.add_argument("--force", action="store_true", help="write into a non-empty --out folder")

    compare = commands.add_parser("compare", help="print the fronts of several studies side by side")
    compare.add_argument("studies", nargs="+", metavar="STUDY", help="two or more study folders")
    compare.add_argument("--format", choices=("table", "json", "csv"), default="table")
    _add_filters(compare)

    check = commands.add_parser("check", help="validate spec files without running them; say what a run would ask for")
    check.add_argument("specs", nargs="+")
    _add_profile(check)

    dashboard = commands.add_parser(
        "dashboard", help="serve a live Pareto page for one or more study folders (refreshes while they run)"
    )
    dashboard.add_argument("studies", nargs="+", metavar="STUDY",
                           help="study folders, e.g. results/convit_locality (several: their fronts side by side)")
    dashboard.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (default 127.0.0.1; another needs --allow-remote)")
    dashboard.add_argument("--port", type=_port, default=8050, help="port (default 8050; 0 picks a free one)")
    dashboard.add_argument("--allow-remote", action="store_true",
                           help="let --host be a non-loopback address: the page has no login, and anyone who reaches "
                           "it sees every trial, config and path of the studies")

    importance = commands.add_parser(
        "importance", help="rank the searched knobs by their importance for each objective (Optuna's fANOVA on the study's journal)"
    )
    importance.add_argument("study", help="a study folder or URI, e.g. results/convit_locality")
    importance.add_argument("--format", choices=("table", "json", "csv"), default="table")
    importance.add_argument("--evaluator", choices=("fanova", "ped-anova"), default="fanova",
                            help="Optuna's importance evaluator: fanova (default, seeded) or ped-anova")
    importance.add_argument("--seed", type=int, default=0, help="fANOVA's random forest seed (default 0: the same "
                            "journal gives the same numbers)")

    effects = commands.add_parser(
        "effects", help="each knob's effect in a grid study: per value, each objective's mean and its difference to a "
        "baseline value (paired t test on trials matched by seed and the other knobs)")
    effects.add_argument("study", help="a grid study's folder or URI (algorithm: {name: grid, seeds: N})")
    effects.add_argument("--baseline", action="append", default=[], metavar="KNOB=VALUE",
                         help="compare KNOB's values with this one (default: its first value in the spec; repeat for "
                         "other knobs)")
    effects.add_argument("--objective", action="append", default=[], metavar="NAME",
                         help="only this objective of the study (repeat for more; default: all of them)")
    effects.add_argument("--format", choices=("table", "json", "csv"), default="table")

    claims = commands.add_parser("claims", help="run the papers' claims suite (studies/claims.yaml) and write "
                                 "docs/claims.md: each claim's number, ours with its interval, and the verdict")
    claims.add_argument("claims_file", nargs="?", default="studies/claims.yaml", metavar="CLAIMS.yaml",
                        help="the claims and their studies' specs next to it (default studies/claims.yaml)")
    _add_profile(claims)
    claims.add_argument("--storage", metavar="DIR",
                        help="where the studies go (default results/claims/PROFILE)")
    claims.add_argument("--out", default="docs/claims.md", metavar="PATH.md", help="the page (default docs/claims.md)")
    claims.add_argument("--no-run", action="store_true",
                        help="run nothing: test the claims on the studies there are (the others: 'not run')")
    claims.add_argument("--only", action="append", default=[], metavar="ID",
                        help="only this claim (and its studies); repeatable")

    report = commands.add_parser("report", help="write one self-contained HTML report (and a PNG of the front) of a study")
    report.add_argument("study", help="a study folder or URI, e.g. results/convit_locality")
    report.add_argument("--out", metavar="PATH.html",
                        help="where to write it (default: STUDY/report.html); the PNG goes beside it as <name>-front.png")
    for command in commands.choices.values():  # for `main`'s message on arguments the command does not take
        command.set_defaults(command_parser=command)
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from search.spec import load_spec, pick_profile
    from search.study.runner import check_dashboard_host, run_study

    # before the spec and the dataset: a refused address costs nothing
    check_dashboard_host(args.dashboard_host, allow_remote=args.allow_remote_dashboard, address=args.address)

    spec = load_spec(args.spec, profile=args.profile).with_overrides(
        trials=args.trials, max_epochs=args.max_epochs, storage=args.storage, name=args.name,
        data_dir=args.data_dir,
    )
    _, why, _ = pick_profile(args.spec, profile=args.profile)
    if spec.profile:
        print(_profile_line(spec, why), flush=True)
    return _report(run_study(spec, address=args.address, cache_dir=args.cache_dir, dashboard_host=args.dashboard_host,
                             allow_remote_dashboard=args.allow_remote_dashboard))


def _cmd_resume(args: argparse.Namespace) -> int:
    from search.study.runner import resume_study

    return _report(resume_study(args.study, address=args.address, cache_dir=args.cache_dir,
                                dashboard_host=args.dashboard_host, allow_remote_dashboard=args.allow_remote_dashboard))


def _report(exp_dir) -> int:
    """The end of a run: its front, where the files are, and exit 1 if every trial failed."""
    from search.results.query import front_of, load_trials
    from search.views.output import front_heading, front_view

    front, objectives = front_of(exp_dir, dominated=True)
    print(f"\n{front_heading(front, objectives)}:")
    print(front_view(front, objectives, fmt="table"))
    print(f"\nresults: {exp_dir}/trials.parquet, epochs.parquet, pareto.parquet, progress.parquet")
    trials = load_trials(exp_dir)
    if len(trials) and (trials["state"] == "FAILED").all():
        failed = "the only trial" if len(trials) == 1 else f"all {len(trials)} trials"
        print(f"error: {failed} failed; first error: {trials['error'].iloc[0]}", file=sys.stderr)
        return 1
    return 0


def _filters_text(args: argparse.Namespace) -> str:
    parts = [f"--where {w!r}" for w in args.where] + [f"--family {f}" for f in args.family]
    return " ".join(parts)


def _empty_front_reason(args: argparse.Namespace) -> str:
    """Why the study's front is empty: the filters, or its trials' states."""
    from search.results.query import load_trials

    if args.where or args.family or args.device:
        device = [f"--device {args.device}"] if args.device else []
        return f"no COMPLETE trial passes {' '.join([_filters_text(args)] + device).strip()}"
    states = load_trials(args.study)["state"].value_counts()
    if states.empty:
        return "no trial has finished yet"
    counts = ", ".join(f"{n} {state}" for state, n in states.items())
    return f"none of its finished trials completed ({counts})"


def _cmd_pareto(args: argparse.Namespace) -> int:
    from search.results.filter import split_families
    from search.results.query import fixed_settings, front_devices, front_of, load_experiment
    from search.results.select import check_rule, select
    from search.results.front import DOMINATED_COLUMN
    from search.views.output import front_heading, front_view, trial_view

    families = split_families(args.family)
    rule = args.select or ("knee" if args.export is not None else None)
    if rule is not None:
        check_rule(rule)
    if args.export is not None:
        from search.study.export import check_export_path

        check_export_path(args.export)
    shown, objectives = front_of(args.study, where=args.where, families=families, device=args.device,
                                 mix_devices=args.mix_devices, dominated=True)
    front = shown[shown[DOMINATED_COLUMN].isna()]
    devices = front_devices(front, objectives)
    if devices and (rule is not None):
        raise ConfigError(f"{args.study}: throughput was measured on {len(devices)} devices ({', '.join(map(repr, devices))}), "
                          "one front each; pass --device NAME to select from one (or --mix-devices)")
    if rule is None:
        if devices and args.format == "table":
            print(f"{len(devices)} fronts, one per device that measured throughput ({', '.join(devices)}); "
                  "--device NAME shows one, --mix-devices compares them anyway")
        empty = _empty_front_reason(args) if front.empty and args.format == "table" else ""
        if args.format == "table" and not front.empty:
            print(f"{front_heading(shown, objectives)}:")
        print(front_view(shown, objectives, fmt=args.format, empty=empty))
        return 0
    check_rule(rule, table=front)
    if front.empty:
        narrowed = f" that passes {_filters_text(args)}" if args.where or args.family else ""
        raise ConfigError(f"{args.study}: the front is empty: no COMPLETE trial{narrowed}; nothing to select")
    row = select(front, objectives=objectives, rule=rule)
    if args.format == "table":
        default = " (the default of --export; pass --select to choose)" if args.select is None else ""
        narrowed = f", after {_filters_text(args)}" if args.where or args.family else ""
        print(f"selected by {rule}{default} from a front of {count(len(front), 'trial')}{narrowed}:")
    print(trial_view(row, objectives, fmt=args.format, fixed=fixed_settings(load_experiment(args.study), row)))
    if args.export is not None:
        from search.study.export import export_trial, write_export

        config = export_trial(args.study, row, selected_by=rule, where=args.where, families=families)
        path = write_export(config, args.export)
        print(f"\nexported trial {row['trial_id']} to {path}; retrain and test it: python -m search train {path}",
              file=sys.stdout if args.format == "table" else sys.stderr)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from search.study.retrain import retrain

    retrain(args.config, out=args.out, epochs=args.epochs, data_dir=args.data_dir, cache_dir=args.cache_dir,
            force=args.force)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from search.results.compare import compare_studies
    from search.results.filter import split_families
    from search.views.output import comparison_view

    comparison = compare_studies(args.studies, where=args.where, families=split_families(args.family))
    print(comparison_view(comparison, fmt=args.format))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    """Every file given is checked and reported, each error as its one line; exit 2 when any failed."""
    failed = 0
    for path in args.specs:
        try:
            _check_one(path, args.profile)
        except ConfigError as exc:
            failed += 1
            print(_one_line(f"error: {exc}"), file=sys.stderr)
    return EXIT_USER_ERROR if failed else 0


def _check_one(path: str, profile: str | None) -> None:
    from search.spec import load_spec, pick_profile
    from trainers.data import load_catalog

    spec = load_spec(path, profile=profile)  # every profile of the file validated
    try:
        load_catalog(spec.dataset.name)  # as `run` does before its data: an unknown dataset
    except ConfigError as exc:
        raise ConfigError(f"{path}: dataset: {exc}") from None
    _, why, profiles = pick_profile(path, profile=profile)
    models = f"{count(len(spec.candidates), 'model')}, " if spec.conditional else ""
    listed = f", profiles {', '.join(profiles)}" if profiles else ""
    print(f"{path}: ok ({spec.name}: {models}{count(len(spec.all_params()), 'knob')}, "
          f"{count(spec.planned_trials, 'trial')}{listed})")
    if spec.profile:
        print(f"  {_profile_line(spec, why)}")
    print(f"  would run {_plan(spec)}")
    for note in spec.notes():
        print(f"  note: {note}")


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from search.views.dashboard.server import serve_dashboard

    serve_dashboard(args.studies, host=args.host, port=args.port, allow_remote=args.allow_remote)
    return 0


def _cmd_importance(args: argparse.Namespace) -> int:
    from search.results.importance import importance_warnings, knob_importance
    from search.views.output import importance_view

    table = knob_importance(args.study, evaluator=args.evaluator, seed=args.seed)
    print(importance_view(table, fmt=args.format))
    if args.format != "table":  # the table has them inline; JSON and CSV stay machine-readable on stdout
        for line in importance_warnings(table):
            print(line, file=sys.stderr)
    return 0


def _cmd_effects(args: argparse.Namespace) -> int:
    from search.results.effects import study_effects
    from search.views.output import effects_view

    table = study_effects(args.study, objectives=args.objective, baselines=args.baseline)
    print(effects_view(table, fmt=args.format))
    return 0


def _cmd_claims(args: argparse.Namespace) -> int:
    from pathlib import Path

    from search.results.claims import evaluate_claims, load_claims
    from search.results.query import load
    from search.spec import pick_profile
    from search.study.suite import SuiteFailed, run_suite, study_state, suite_studies
    from search.views.claims_page import claims_page, difference_text, write_claims_page

    path = Path(args.claims_file)
    manifest = load_claims(path)
    claims = manifest.claims
    if args.only:
        unknown = [i for i in args.only if i not in {c.id for c in claims}]
        if unknown:
            raise ConfigError(f"--only {unknown[0]}: no such claim; use one of {', '.join(c.id for c in claims)}")
        claims = tuple(c for c in claims if c.id in args.only)
    names = list(dict.fromkeys(s for c in claims for s in c.test.studies))
    profile = args.profile or pick_profile(path.parent / f"{names[0]}.yaml")[0]
    storage = args.storage or f"results/claims/{profile or 'default'}"
    studies = suite_studies([path.parent / f"{n}.yaml" for n in names], profile=args.profile, storage=storage)
    if not args.no_run:
        try:
            run_suite(studies, profile=args.profile)
        except SuiteFailed as exc:
            print(_one_line(f"error: {exc}"), file=sys.stderr)
            return 1
    states = {s.name: study_state(s)[0] for s in studies}
    loaded = {s.name: load(s.folder) for s in studies if states[s.name] != "missing"}
    # a claim reads finished studies of its spec only: a study under way or stale (--no-run) is
    # listed as it stands, and its claims are "not run"
    results = evaluate_claims(claims, {name: exp for name, exp in loaded.items() if states[name] == "done"})
    command = ["python", "-m", "search", "claims", *([str(path)] if str(path) != "studies/claims.yaml" else []),
               *(["--profile", args.profile] if args.profile else [])]
    out = write_claims_page(args.out, claims_page(results, studies, loaded, command=command, profile=profile,
                                                     storage=storage))
    for r in results:
        print(f"{r.claim.id}: {r.verdict} ({r.n}; {difference_text(r)})")
    print(f"wrote {out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from search.views.report import write_report

    report = write_report(args.study, out=args.out)
    print(f"wrote {report.html} ({count(report.trials, 'trial')}, {report.front} on the front; self-contained, opens offline) "
          f"and {report.png} in {report.seconds:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = _build_parser().parse_known_args(argv)
    if unknown:  # named by the command's parser, whose --help lists what it takes (parse_args names the top level)
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    handler = {
        "run": _cmd_run, "resume": _cmd_resume, "pareto": _cmd_pareto, "train": _cmd_train, "compare": _cmd_compare, "check": _cmd_check,
        "dashboard": _cmd_dashboard, "report": _cmd_report, "importance": _cmd_importance, "effects": _cmd_effects,
        "claims": _cmd_claims,
    }[args.command]
    try:
        code = handler(args)
        sys.stdout.flush()  # a reader gone away is found here, not at interpreter exit
        return code
    except BrokenPipeError:
        # Python's advice (the signal module's docs): point stdout at devnull so the flush at exit
        # cannot raise again, and end as a Unix tool the pipe's reader left does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ConfigError as exc:
        print(_one_line(f"error: {exc}"), file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        kept = "; finished trials are in the study folder" if args.command in ("run", "resume") else ""
        print(f"interrupted{kept}", file=sys.stderr)
        return 130

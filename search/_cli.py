"""``python -m search``: run a study, print its Pareto front.

User errors (a bad spec, a missing dataset, a folder that is not a study) print one line and
exit with code 2; nothing is half-written.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from trainers.errors import ConfigError

__all__ = ["main"]

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 too; keep one line
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m search", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run the search described by a spec file")
    run.add_argument("spec", help="a YAML search spec, e.g. spaces/convit_locality.yaml")
    run.add_argument("--trials", type=int, help="number of trials (overrides budget.trials)")
    run.add_argument("--max-epochs", type=int, help="epochs per trial (overrides budget.max_epochs)")
    run.add_argument("--storage", help="results directory (overrides storage)")
    run.add_argument("--name", help="study name, the folder under storage (overrides name)")
    run.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                     help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    run.add_argument("--data-dir", help="where the dataset's files are (overrides the catalog's path)")
    run.add_argument("--cache-dir", help="where converted .beton files are kept "
                     "(default: $LOCALITY_SEARCH_CACHE or ~/.cache/locality-search/datasets)")

    pareto = commands.add_parser("pareto", help="print the Pareto front of a study")
    pareto.add_argument("study", help="a study folder, e.g. results/convit_locality")
    pareto.add_argument("--format", choices=("table", "json", "csv"), default="table")

    check = commands.add_parser("check", help="validate spec files without running them")
    check.add_argument("specs", nargs="+")
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from search._query import format_front, front_of
    from search._runner import run_study
    from search._spec import load_spec

    spec = load_spec(args.spec).with_overrides(
        trials=args.trials, max_epochs=args.max_epochs, storage=args.storage, name=args.name,
        data_dir=args.data_dir,
    )
    exp_dir = run_study(spec, address=args.address, cache_dir=args.cache_dir)
    front, objectives = front_of(exp_dir)
    print(f"\nPareto front ({', '.join(f'{m} {mode}' for m, mode in objectives)}), {len(front)} trials:")
    print(format_front(front, objectives, fmt="table"))
    print(f"\nresults: {exp_dir}/trials.parquet, epochs.parquet, pareto.parquet")
    from search._query import load_trials

    trials = load_trials(exp_dir)
    if len(trials) and (trials["state"] == "FAILED").all():
        print(f"error: all {len(trials)} trials failed; first error: {trials['error'].iloc[0]}", file=sys.stderr)
        return 1
    return 0


def _cmd_pareto(args: argparse.Namespace) -> int:
    from search._query import format_front, front_of

    front, objectives = front_of(args.study)
    print(format_front(front, objectives, fmt=args.format))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from search._spec import load_spec

    for path in args.specs:
        spec = load_spec(path)
        print(f"{path}: ok ({spec.name}: {len(spec.space)} knobs, {spec.budget.trials} trials)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    handler = {"run": _cmd_run, "pareto": _cmd_pareto, "check": _cmd_check}[args.command]
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted; finished trials are in the study folder", file=sys.stderr)
        return 130

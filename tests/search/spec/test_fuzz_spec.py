"""Specs and command lines nobody thought of: property-based inputs to the spec loader (through
`python -m search check`) and to the CLI's argument parsing. Every case is accepted (exit 0) or
refused with exit code 2 and one line ``error: ...`` on stderr; never a traceback, never a hang.

CI runs a modest number of examples per test; LOCALITY_SEARCH_FUZZ_EXAMPLES=10000 runs more:

    LOCALITY_SEARCH_FUZZ_EXAMPLES=10000 python -m pytest tests/search/spec/test_fuzz_spec.py
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from search.views.cli import _build_parser, main

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "spaces" / "convit_locality.yaml"
BASE = yaml.safe_load(SPEC.read_text())
EXAMPLES = int(os.environ.get("LOCALITY_SEARCH_FUZZ_EXAMPLES", "150"))
# a case slower than this is a hang (a valid spec's check builds its models on the meta device: ~2 s
# of CPU the first time)
CASE_CPU_S, CASE_WALL_S = 60, 900

FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _key_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of the spec's tree (mapping keys and list indexes), the root left out."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    paths = []
    for key, child in items:
        paths.append(prefix + (key,))
        paths += _key_paths(child, prefix + (key,))
    return paths


PATHS = _key_paths(BASE)

# values nobody thought of: negative, huge and non-finite numbers (also as strings), empty and
# odd strings, the wrong container, null, flags
scalars = st.one_of(
    st.integers(min_value=-10**6, max_value=-1),
    st.integers(min_value=2**31, max_value=2**80),
    st.sampled_from([0, 1, -1, 2, 2**63 - 1, 2**63, 2**64, 10**30, -10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, -1e300, 0.5, 1.5]),
    st.sampled_from(["nan", "NaN", ".nan", "inf", "-inf", ".inf", "-.inf", "1e309", "-1e-400", "1e-3", "10",
                     "", " ", "null", "~", "true", "yes", "\n", "x" * 300, "cpu", "gpu", "tpe", "max"]),
    st.text(max_size=20),
    st.none(),
    st.booleans(),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.text(max_size=8), scalars, max_size=3),
    st.dictionaries(st.sampled_from(["type", "low", "high", "values", "step", "log", "name", "metric", "mode"]),
                    scalars, max_size=4),
)
mutations = st.lists(
    st.tuples(st.sampled_from(PATHS), st.sampled_from(["replace", "delete", "add"]), values,
              st.one_of(st.text(max_size=12), st.sampled_from(["profile", "source", "low", "high", "step"]))),
    min_size=1, max_size=4,
)
profiles = st.one_of(st.none(), st.sampled_from(["cpu", "gpu", "", "CPU", "gpu ", "profiles"]), st.text(max_size=12))


def _mutate(doc: dict, changes: list) -> dict:
    """``doc`` with each change applied where its key path still exists (an earlier change may
    have removed it): the value replaced, the key deleted, or a new key added beside it."""
    doc = copy.deepcopy(doc)
    for path, how, value, new_key in changes:
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            target = parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, (dict, list)):  # an earlier change made it a string: path[-1] indexed a character
            continue
        if how == "replace":
            parent[path[-1]] = value
        elif how == "delete":
            del parent[path[-1]]
        elif isinstance(target, dict):
            target[new_key] = value
        elif isinstance(target, list):
            target.append(value)
        else:
            parent[path[-1]] = value
    return doc


@contextlib.contextmanager
def _time_limit(cpu_seconds: int, wall_seconds: int):
    """AssertionError in a case that spends ``cpu_seconds`` of CPU (a busy hang; counted in CPU
    time, as the machine may be shared and slow) or ``wall_seconds`` in all (a blocked one)."""
    def hang(signum, frame):
        raise AssertionError(f"a case ran past {cpu_seconds} s of CPU or {wall_seconds} s: a hang")

    previous = {sig: signal.signal(sig, hang) for sig in (signal.SIGPROF, signal.SIGALRM)}
    signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
    signal.alarm(wall_seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.alarm(0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) as the console runs it: (exit code, stdout, stderr). argparse's exits (--help:
    0, a usage error: 2) count as exit codes; any other exception escapes, and fails the case."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _time_limit(CASE_CPU_S, CASE_WALL_S):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
    return code, out.getvalue(), err.getvalue()


def assert_accepted_or_one_line(argv: list[str]) -> int:
    code, out, err = run_cli(argv)
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    if code == 2:
        lines = err.splitlines()
        # `check` reports every file it is given: one error line for each that failed
        most = max(1, len(argv) - 1) if argv and argv[0] == "check" else 1
        assert 1 <= len(lines) <= most and all(line.startswith("error: ") for line in lines), (argv, err)
    return code


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    # whatever a case writes by a relative path lands here, not in the checkout
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache" / "datasets"))
    # `dashboard` serves until Ctrl-C, also a folder with no study yet (one about to start): a
    # command line it accepts returns once the server is up, as exit code 0
    from search.views.dashboard import server

    monkeypatch.setattr(server._DashboardServer, "serve_forever", lambda self, poll_interval=0.5: None)
    # a gs:// study with no network gives up after this bound (30 s by default, seconds here)
    from search.results import location

    monkeypatch.setattr(location, "GCS_RETRY_LIMIT_S", 1)
    return tmp_path


def test_the_unmutated_spec_is_accepted(workdir):
    path = workdir / "spec.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False))
    assert run_cli(["check", str(path)])[0] == 0
    assert run_cli(["check", str(path), "--profile", "gpu"])[0] == 0
    code, _, err = run_cli(["check", str(path), "--profile", "nope"])
    assert code == 2 and "nope" in err


@FUZZ
@given(changes=mutations, profile=profiles)
def test_mutated_specs_are_accepted_or_refused_in_one_line(workdir, changes, profile):
    path = workdir / "spec.yaml"
    path.write_text(yaml.safe_dump(_mutate(BASE, changes), sort_keys=False, allow_unicode=True))
    argv = ["check", str(path)] + ([] if profile is None else [f"--profile={profile}"])
    assert_accepted_or_one_line(argv)


@FUZZ
@given(cut=st.integers(min_value=0, max_value=len(SPEC.read_bytes())), junk=st.binary(max_size=16),
       keep_tail=st.booleans())
def test_damaged_spec_text_is_refused_in_one_line(workdir, cut, junk, keep_tail):
    # a file cut short (a full disk, a killed editor) or with bytes spliced in
    data = SPEC.read_bytes()
    path = workdir / "spec.yaml"
    path.write_bytes(data[:cut] + junk + (data[cut:] if keep_tail else b""))
    assert_accepted_or_one_line(["check", str(path)])


def _option_strings() -> list[str]:
    parser = _build_parser()
    options = {s for a in parser._actions for s in a.option_strings}
    for sub in parser._subparsers._group_actions[0].choices.values():
        options |= {s for a in sub._actions for s in a.option_strings}
    return sorted(options)


COMMANDS = ["run", "resume", "pareto", "train", "compare", "check", "dashboard", "report"]
# words of the command line; no path a real study or spec is at, so nothing starts a search
words = st.one_of(
    st.sampled_from(COMMANDS),
    st.sampled_from(_option_strings()),
    st.sampled_from(["-h", "--help", "--", "-", "", " ", "=", "--trials=-1", "--max-epochs=0", "--port=99999",
                     "--port=-1", "--format=xml", "--select=knee", "--select=max:", "--where=a>>1", "--host=0.0.0.0",
                     "--dashboard-host=0.0.0.0", "--storage=s3://", "--storage=file://", "--name=../x", "nope.yaml",
                     "missing/study", ".", "/", "/dev/null", "s3://", "gs://bucket", "knee", "table", "json", "nan"]),
    st.text(max_size=12),
)


@FUZZ
@given(argv=st.lists(words, max_size=6))
def test_random_command_lines_exit_0_or_2(workdir, argv):
    assert_accepted_or_one_line(argv)


def test_help_exits_0_for_every_command(workdir):
    for argv in [["--help"]] + [[command, "--help"] for command in COMMANDS]:
        code, out, _ = run_cli(argv)
        assert code == 0 and "usage:" in out, argv


def test_the_fuzzer_reaches_valid_and_invalid_specs(workdir):
    # the mutations are not all refused by the first check: some keep a spec the loader accepts
    path = workdir / "spec.yaml"
    accepted = refused = 0
    for changes in ([(("description",), "replace", "x", "")], [(("train", "batch_size"), "replace", -1, "")],
                    [(("space", "depth", "high"), "replace", math.nan, "")]):
        path.write_text(yaml.safe_dump(_mutate(BASE, changes), sort_keys=False))
        code = assert_accepted_or_one_line(["check", str(path)])
        accepted += code == 0
        refused += code == 2
    assert (accepted, refused) == (1, 2)

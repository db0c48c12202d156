"""Studies stored at a URI through pyarrow's filesystems (search.results.location): the driver stages
its files locally and uploads each whole; Tune writes checkpoints there itself; readers and
``resume`` download them again, on any machine."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import search
from search.results.location import STUDY_FILES, StudyLocation, is_uri, resumed_location, resuming_at, study_location
from trainers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]

SPEC = """
name: at_uri
dataset: {name: synthetic, val_fraction: 0.2}
model: {name: ls_convit_nano}
space:
  lr: {type: loguniform, low: 1.0e-3, high: 5.0e-3}
objectives:
  - {metric: val_acc, mode: max}
  - {metric: throughput, mode: max}
budget: {trials: 2, max_epochs: 2}
algorithm: {name: random, seed: 0}
scheduler: {name: none}
resources: {cpus: 1}
train: {batch_size: 64, num_workers: 1, warmup_epochs: 0.2}
throughput: {batch_size: 64, warmup: 1, repeats: 3}
"""


def test_uris_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache" / "datasets"))
    assert is_uri("s3://bucket/x") and is_uri("file:///tmp/x") and not is_uri("results") and not is_uri("/abs/path")
    local = study_location(tmp_path / "results", "s1")
    assert local.uri is None and local.local == (tmp_path / "results" / "s1").resolve()
    assert local.tune_storage() == (str(local.local), None) and local.tune_dir() == str(local.local / "ray")
    remote = study_location(f"file://{tmp_path}/remote", "s1")
    assert remote.uri == f"file://{tmp_path}/remote/s1" and remote.path == f"{tmp_path}/remote/s1"
    assert remote.local.parent == tmp_path / "cache" / "studies" and remote.local.name.startswith("s1-")
    query = study_location("s3://bucket/studies?endpoint_override=http://127.0.0.1:9&scheme=http", "s2")
    assert query.uri == "s3://bucket/studies/s2?endpoint_override=http://127.0.0.1:9&scheme=http"
    assert query.path == "bucket/studies/s2"
    with pytest.raises(ConfigError, match="pyarrow cannot open it"):
        StudyLocation("nosuchscheme://x/y")


def test_push_pull_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache" / "datasets"))
    location = StudyLocation(f"file://{tmp_path}/remote/study")
    location.local.mkdir(parents=True)
    (location.local / "experiment.json").write_text('{"name": "study"}')
    (location.local / "optuna.journal").write_bytes(b"x" * 3_000_000)  # bigger than one copy chunk
    location.push()
    remote = tmp_path / "remote" / "study"
    assert sorted(p.name for p in remote.iterdir()) == ["experiment.json", "optuna.journal"]  # no temporary left
    assert location.exists("experiment.json") and not location.exists("trials.parquet")
    # Another machine: the staging folder is rebuilt from the URI and filled by pull().
    shutil.rmtree(location.local)
    elsewhere = pickle.loads(pickle.dumps(location))
    assert elsewhere.local == location.local and elsewhere.uri == location.uri
    assert elsewhere.pull() == ["experiment.json", "optuna.journal"]
    assert (elsewhere.local / "optuna.journal").read_bytes() == b"x" * 3_000_000
    assert not [p for p in elsewhere.local.iterdir() if p.name.startswith(".")]


class _UploadsDuringReads:
    """`location.fs` as it is, except that each file opened for reading is replaced at the URI
    (by another client) after pyarrow looked up its size and before the bytes are fetched: the
    race a reader runs against a driver uploading the study every few seconds."""

    def __init__(self, location: StudyLocation, versions):
        self._fs, self._versions = location.fs, iter(versions)
        self._other = StudyLocation(location.uri).fs

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def open_input_file(self, path):
        handle = self._fs.open_input_file(path)  # the size is looked up here
        for data in self._versions:
            with self._other.open_output_stream(path) as out:
                out.write(data)
            break
        return handle


def test_a_read_never_mixes_two_uploads_of_a_file(s3_storage, tmp_path, monkeypatch):
    """An upload landing between pyarrow's size lookup and its byte fetch gives a copy of neither
    version (a Parquet file without its footer, seen in test_cluster); StudyLocation.read (and
    pull, which uses it) reads such a file again."""
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache" / "datasets"))
    location = study_location(s3_storage, "racy")
    with location.fs.open_output_stream(f"{location.path}/epochs.parquet") as out:
        out.write(b"old" * 10)
    location.fs = _UploadsDuringReads(location, [b"new" * 1000])
    assert location.read("epochs.parquet") == b"new" * 1000  # not b"new" * 10: the first 30 bytes
    assert location.read("trials.parquet") is None
    location.fs = _UploadsDuringReads(location, [b"v%d" % i * (10 + i) for i in range(100)])  # never settles
    with pytest.raises(ConfigError, match=r"^storage s3://\S+: epochs.parquet changed during each of 5 reads; try again"):
        location.read("epochs.parquet")


def test_a_resume_puts_what_the_snapshot_pickled_in_the_study_folder_as_it_is_now(tmp_path):
    """`search resume` of a moved study folder: the store, the journal's location and the trials
    Tune samples after the resume all follow the folder (tests/search/study/test_resume.py runs it whole)."""
    from ray.train._internal.storage import StorageContext
    from ray.tune.experiment import Experiment
    from ray.tune.search import Searcher

    from search.results.store import ResultsStore
    from search.study.searcher import StudySearchGenerator

    old, new = StudyLocation(tmp_path / "old" / "s"), StudyLocation(tmp_path / "new" / "s")
    store = ResultsStore(old.local, space={}, objectives=[("val_acc", "max")], location=old)
    experiment = Experiment("ray", lambda config: None, storage_path=str(old.local))
    generator = StudySearchGenerator(Searcher())
    generator._experiment = experiment
    pickled = pickle.dumps((old, store)), pickle.dumps(generator.get_state())

    assert resumed_location() is None
    location, restored = pickle.loads(pickled[0])  # outside a resume: as pickled
    assert location.local == old.local and restored.directory == old.local
    with resuming_at(new) as elsewhere:
        assert resumed_location() is new
        location, restored = pickle.loads(pickled[0])
        assert location is new and restored.directory == new.local and restored.location is new
        generator.set_state(pickle.loads(pickled[1]))
        storage = generator._experiment.spec["storage"]
        assert isinstance(storage, StorageContext) and generator._experiment.storage is storage
        assert storage.storage_fs_path == str(new.local) and storage.experiment_fs_path == str(new.local / "ray")
        assert elsewhere == [str(old.local)]
    assert resumed_location() is None
    assert experiment.spec["storage"].storage_fs_path == str(old.local)  # the original is not touched


def test_each_trial_sampled_reaches_the_uri_journal_before_tune_can_snapshot_it(tmp_path, monkeypatch):
    """A resume on another machine replays the journal at the URI. Had it missed a trial that Tune's
    snapshot holds, the next trial sampled there would take its Optuna id, and the first trial's
    end would be told to it (seen in tests/search/study/test_resume.py [uri]): so each ask is uploaded at once."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from search.results.location import JOURNAL_FILE
    from search.spec.spec import ParamSpec
    from search.study.searcher import HonestOptunaSearch, OptunaSpace

    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache" / "datasets"))
    location = StudyLocation(f"file://{tmp_path}/remote/study")
    location.local.mkdir(parents=True)
    space = {"lr": ParamSpec(type="loguniform", low=1e-3, high=5e-3)}
    searcher = HonestOptunaSearch(space=OptunaSpace(space, {"m": {}}), metric=["best_val_acc", "throughput"],
                                  mode=["max", "max"], sampler=optuna.samplers.RandomSampler(seed=0),
                                  study_name="asked", journal=location)
    configs = [searcher.suggest(f"trial_{i}") for i in range(2)]
    remote = JournalStorage(JournalFileBackend(str(tmp_path / "remote" / "study" / JOURNAL_FILE)))
    trials = optuna.load_study(study_name="asked", storage=remote).trials
    assert [t.state.name for t in trials] == ["RUNNING", "RUNNING"]
    assert [t.params["lr"] for t in trials] == [c["lr"] for c in configs]


def _run(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "search", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)


@pytest.mark.ray(seconds=110)
def test_a_study_at_a_uri_killed_then_resumed_on_another_machine_and_read_back(tmp_path, monkeypatch, s3_storage):
    """A study on S3 (moto's server) whose driver is SIGKILLed mid-trial, resumed "on another
    machine" (another cache and staging folder, the first driver's staging folder gone), so every
    local path in Tune's snapshot is wrong there; then read back from the URI alone. file:// takes
    the same path through pyarrow's filesystems (tests/search/study/test_resume.py moves a killed
    study's folder instead)."""
    import optuna
    import pyarrow.fs
    import yaml

    from tests.search.study.test_resume import _run_and_sigkill

    trials_asked = 3
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "cache" / "datasets"))
    spec = tmp_path / "at_uri.yaml"
    raw = yaml.safe_load(SPEC)
    raw["budget"].update(trials=trials_asked, max_epochs=4)
    spec.write_text(yaml.safe_dump({**raw, "storage": s3_storage}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    location = study_location(s3_storage, "at_uri")
    uri, fs, base = location.uri, location.fs, location.path

    def rows(name: str) -> list[dict]:
        # straight from the store, as the product reads it: one request, checked against an upload
        # landing mid-read (pyarrow's ranged reads mixed two objects here: "Couldn't deserialize thrift")
        data = location.read(name)
        return [] if data is None else pq.read_table(pa.BufferReader(data)).to_pylist()

    def a_trial_done_another_mid_way() -> bool:
        done = rows("trials.parquet")
        return len(done) >= 1 and len(rows("epochs.parquet")) >= 4 * len(done) + 1

    # polled from the S3 server every 0.25 s, not every 0.05: each poll is two requests that this
    # process's server answers, on the cores the study runs on (a trial's 4 epochs take longer)
    _run_and_sigkill(spec, env, until=a_trial_done_another_mid_way, what="a trial done and another begun", poll=0.25)
    before = rows("trials.parquet")
    assert 1 <= len(before) < trials_asked

    shutil.rmtree(tmp_path / "cache" / "studies")  # the first machine's staging folder (beside its cache)
    elsewhere = {**env, "LOCALITY_SEARCH_CACHE": str(tmp_path / "other-machine" / "datasets")}
    resumed = _run("resume", uri, env=elsewhere)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming study at_uri" in resumed.stdout, resumed.stdout[-3000:]

    trials = rows("trials.parquet")
    ids = [t["trial_id"] for t in trials]
    assert len(set(ids)) == len(ids) == trials_asked and len({t["lr"] for t in trials}) == trials_asked
    assert all(t["state"] == "COMPLETE" and t["epochs_run"] == 4 for t in trials), [(t["state"], t["error"]) for t in trials]
    assert {t["trial_id"]: t["val_acc"] for t in trials} | {t["trial_id"]: t["val_acc"] for t in before} == \
        {t["trial_id"]: t["val_acc"] for t in trials}  # the trials finished before the kill are kept as they were
    pairs = [(e["trial_id"], e["epoch"]) for e in rows("epochs.parquet")]
    assert len(pairs) == len(set(pairs)) == 4 * trials_asked  # every epoch once, the resumed trial's too
    assert [p["finished"] for p in rows("progress.parquet")] == list(range(1, trials_asked + 1))
    names = {Path(i.path).name for i in fs.get_file_info(pyarrow.fs.FileSelector(base))}
    assert names >= set(STUDY_FILES) - {"confirm.json"} | {"ray"}  # confirm.json: only with budget.confirm
    assert not [n for n in names if n.endswith(".tmp")]
    # Tune's checkpoints went there too, one folder per trial
    ray_files = [i.path for i in fs.get_file_info(pyarrow.fs.FileSelector(f"{base}/ray", recursive=True))]
    assert len({p.split("/ray/")[1].split("/")[0] for p in ray_files if "/checkpoint_" in p}) == trials_asked

    # Read back from the URI (the staging folders removed, as on a third machine).
    for staging in (tmp_path / "cache" / "studies", tmp_path / "other-machine" / "studies"):
        shutil.rmtree(staging, ignore_errors=True)
    exp = search.load(uri)
    assert sorted(exp.trials["trial_id"]) == sorted(ids)
    assert exp.trials["test_acc"].notna().any()  # the held-out test ran after the resume
    pareto = _run("pareto", uri, "--format", "json", env=env)
    assert pareto.returncode == 0, pareto.stderr
    assert any(i in pareto.stdout for i in ids)
    again = _run("resume", uri, env=elsewhere)  # pulled from the URI there: finished, so nothing to restore
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"study at_uri is finished ({trials_asked} of {trials_asked} trials); nothing left to resume in {uri}" in again.stdout
    assert "other-machine" in again.stdout  # its front read from that machine's own staging folder

    # the Optuna study (its journal, as optuna-dashboard would open it) agrees with the store
    other = StudyLocation(uri)  # this process's staging: pulled fresh from the URI
    other.pull()
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(other.local / "optuna.journal")))
    states = [t.state.name for t in optuna.load_study(study_name="at_uri", storage=journal).trials]
    assert "RUNNING" not in states and states.count("COMPLETE") >= trials_asked, states

    taken = _run("run", str(spec), "--storage", s3_storage, env=env)
    assert taken.returncode == 2 and "already holds a study" in taken.stderr and "Traceback" not in taken.stderr


def test_unreachable_storage_is_a_one_line_error_and_loses_nothing(tmp_path, monkeypatch, capsys):
    from search import ResultsStore
    from search.views.cli import main

    for key, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_EC2_METADATA_DISABLED": "true",
                       "LOCALITY_SEARCH_CACHE": str(tmp_path / "cache" / "datasets")}.items():
        monkeypatch.setenv(key, value)
    dead = "s3://bucket/studies?endpoint_override=127.0.0.1:9&scheme=http"  # nothing listens on port 9
    assert main(["run", str(ROOT / "spaces" / "synthetic_smoke.yaml"), "--storage", dead]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach it" in err and "credentials" in err
    assert main(["pareto", "s3://bucket/studies/s?endpoint_override=127.0.0.1:9&scheme=http"]) == 2
    assert "cannot reach it" in capsys.readouterr().err
    # Mid-run, an upload that fails keeps the staged files whole and says so; the next flush retries.
    location = study_location(dead, "s")
    store = ResultsStore(location.local, space={}, objectives=[("val_acc", "max")], location=location)
    store.add_trial({"trial_id": "t0", "state": "COMPLETE", "val_acc": 0.5}, {})
    store.flush()
    assert "uploaded at the next write" in capsys.readouterr().err
    assert pq.read_table(location.local / "trials.parquet").to_pylist()[0]["trial_id"] == "t0"


def test_a_gcs_uri_gets_a_bounded_retry():
    # Arrow retries an unreachable gs:// bucket for 15 minutes by default: a command looked hung
    from search.results.location import _bounded_retries

    assert _bounded_retries("gs://bucket/studies") == "gs://bucket/studies?retry_limit_seconds=30"
    assert _bounded_retries("gs://bucket/s?anonymous=true") == "gs://bucket/s?anonymous=true&retry_limit_seconds=30"
    assert _bounded_retries("gs://bucket/s?retry_limit_seconds=600") == "gs://bucket/s?retry_limit_seconds=600"
    assert _bounded_retries("s3://bucket/s") == "s3://bucket/s"

"""The code version that studies and benchmark results record: HEAD's commit, and whether tracked
files differ from it (a results folder left out), in a real git checkout."""
import subprocess

from benchmarks._env import environment
from trainers import _source


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def test_commit_and_modified_tracked_files_with_a_folder_left_out(tmp_path, monkeypatch):
    repo = tmp_path / "checkout"
    (repo / "results").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "results" / "r.json").write_text("{}\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "first")
    monkeypatch.setattr(_source, "PROJECT_ROOT", repo)

    assert _source.git_commit() == _git(repo, "rev-parse", "HEAD").strip()
    assert _source.tracked_files_modified() is False
    (repo / "untracked.py").write_text("y = 2\n")  # untracked files are not the commit's code
    assert _source.tracked_files_modified() is False
    (repo / "results" / "r.json").write_text('{"new": 1}\n')
    assert _source.tracked_files_modified() is True
    assert _source.tracked_files_modified(ignore=("results",)) is False
    (repo / "code.py").write_text("x = 2\n")
    assert _source.tracked_files_modified(ignore=("results",)) is True


def test_outside_a_checkout_the_version_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(_source, "PROJECT_ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above it either
    assert _source.git_commit() is None
    assert _source.tracked_files_modified() is None


def test_benchmark_results_name_the_commit_they_ran_at():
    env = environment("cpu")
    assert env["git_commit"] == _source.git_commit()
    assert env["git_modified"] in (True, False, None)

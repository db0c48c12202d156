"""benchmarks/device.sh, the prepared call for a lent GPU machine: its user errors here (what it
runs there needs the device; docs/claims-gpu.md is what it produced)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device.sh"


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_a_verb_it_does_not_know_is_a_one_line_usage_error():
    out = _run("frobnicate")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "usage: benchmarks/device.sh prepare" in out.stderr


def test_claims_without_claims_and_without_the_packed_folder_say_what_to_do(tmp_path):
    out = _run("claims")
    assert out.returncode == 2 and "name the claims" in out.stderr
    # a checkout without .dev/: it says to prepare it here and carry it, and unpacks nothing
    copy = tmp_path / "repo" / "benchmarks"
    copy.mkdir(parents=True)
    (copy / "device.sh").write_text(SCRIPT.read_text())
    out = subprocess.run(["bash", str(copy / "device.sh"), "claims", "refiner-ratio"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "run 'benchmarks/device.sh prepare' here and carry .dev" in out.stderr

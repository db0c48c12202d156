"""A throughput measurement has its device to itself: trials training on it step aside, and
overlapping trials cannot starve it (trainers._device_share)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from trainers._device_share import device_share, lock_dir

ROOT = Path(__file__).resolve().parents[2]

# Trains until the test creates the stop file, then a little longer: no fixed duration, so a
# loaded machine (a slow interpreter start for the measurer) cannot end training before the
# measurement starts.
TRAINER_UNTIL_STOPPED = textwrap.dedent("""
    import json, os, sys, time, torch
    from trainers._device_share import device_share
    share = device_share(torch.device("cpu"))
    steps = []
    stop_file, stopped_at = sys.argv[1], None
    with share.training():
        print("training", flush=True)
        while stopped_at is None or time.time() < stopped_at + float(sys.argv[2]):
            share.step()
            steps.append(time.time())  # a "step" happens after step() lets us go on
            time.sleep(0.005)
            if stopped_at is None and os.path.exists(stop_file):
                stopped_at = time.time()
    print(json.dumps(steps), flush=True)
""")

MEASURER = textwrap.dedent("""
    import json, sys, time, torch
    from trainers._device_share import device_share
    share = device_share(torch.device("cpu"))
    asked = time.time()
    with share.exclusive():
        start = time.time()
        print("measuring", flush=True)
        time.sleep(float(sys.argv[1]))
        end = time.time()
    print(json.dumps([asked, start, end]), flush=True)
""")


TRAINER = textwrap.dedent("""
    import json, sys, time, torch
    from trainers._device_share import device_share
    share = device_share(torch.device("cpu"))
    steps = []
    with share.training():
        end = time.time() + float(sys.argv[1])
        print("training", flush=True)
        while time.time() < end:
            share.step()
            steps.append(time.time())  # a "step" happens after step() lets us go on
            time.sleep(0.005)
    print(json.dumps(steps), flush=True)
""")


def _start(script: str, *args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def test_measurement_waits_for_trainers_and_they_for_it(tmp_path):
    env = {**os.environ, "LOCALITY_SEARCH_LOCKS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    # Two trainers whose shared holds overlap all the time: without the gate, a measurement
    # waiting for the exclusive lock would never get it.
    stop_file = tmp_path / "stop"
    trainers = [_start(TRAINER_UNTIL_STOPPED, str(stop_file), "0.5", env=env) for _ in range(2)]
    for proc in trainers:
        assert proc.stdout.readline().strip() == "training"
    measurer = _start(MEASURER, "1", env=env)
    asked, start, end = json.loads(measurer.communicate(timeout=60)[0].splitlines()[-1])
    stop_file.touch()
    steps = [json.loads(proc.communicate(timeout=60)[0].splitlines()[-1]) for proc in trainers]
    assert start - asked < 2.0, "the measurement starved"
    for times in steps:
        assert not [t for t in times if start <= t <= end], "a trainer stepped while the device was measured"
        assert any(t > end for t in times), "the trainer did not resume after the measurement"
        assert any(t < start for t in times)


def test_exclusive_inside_training_does_not_deadlock(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALITY_SEARCH_LOCKS", str(tmp_path / "locks"))
    share = device_share(torch.device("cpu"))
    assert lock_dir() == tmp_path / "locks" and share.key == "cpu"
    with share.training():
        share.step()
        with share.exclusive():  # a T-CNN measures again mid-training
            pass
        share.step()
        with share.training():  # nested: one shared lock
            pass
    assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == ["cpu.gate", "cpu.lock"]


def test_training_waits_while_measured(tmp_path):
    env = {**os.environ, "LOCALITY_SEARCH_LOCKS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    measurer = _start(MEASURER, "5", env=env)
    assert measurer.stdout.readline().strip() == "measuring"  # it holds the device for 5 s
    trainer = _start(TRAINER, "0.5", env=env)  # starts (imports torch) well within them
    asked, start, end = json.loads(measurer.communicate(timeout=60)[0].splitlines()[-1])
    out = trainer.communicate(timeout=60)[0].splitlines()
    assert min(json.loads(out[-1])) >= end


def test_lock_files_closed_at_exit(tmp_path):
    # The lock files stay open for the process; at exit they are closed, not left to the GC
    # (which warns "ResourceWarning: unclosed file" under -X dev and in pytest's subprocesses).
    env = {**os.environ, "LOCALITY_SEARCH_LOCKS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-X", "dev", "-c", TRAINER, "0.05"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ResourceWarning" not in done.stderr

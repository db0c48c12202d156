"""A Ray cluster of two nodes on this machine (loopback), started with ``ray start``: the head and
a worker, one CPU and one ``trial_slot`` each, each with its own dataset cache (as on separate
machines). For the two-node test (tests/search/study/test_cluster.py) and the worker-kill soak
(benchmarks/kill_soak.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["Cluster", "two_node_spec"]

BIN = Path(sys.executable).parent


def two_node_spec(*, trials: int, epochs: int) -> str:
    """A study for the cluster: one trial slot per node (so trials land on both), synthetic data at
    32 px (epochs of 0.5-1 s: trials outlast a worker's start), retries from checkpoints."""
    return f"""
name: two_nodes
dataset: {{name: synthetic, val_fraction: 0.2, image_size: 32}}
model: {{name: ls_convit_nano}}
space:
  lr: {{type: loguniform, low: 1.0e-3, high: 5.0e-3}}
objectives:
  - {{metric: val_acc, mode: max}}
  - {{metric: throughput, mode: max}}
budget: {{trials: {trials}, max_epochs: {epochs}, max_failures: 3}}
algorithm: {{name: random, seed: 0}}
scheduler: {{name: none}}
resources: {{cpus: 1, custom: {{trial_slot: 1}}}}
train: {{batch_size: 64, num_workers: 1, warmup_epochs: 0.2}}
throughput: {{batch_size: 64, warmup: 1, repeats: 3}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Token authentication off for this throwaway loopback cluster (its token would live in ~/.ray).
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                    "LOCALITY_SEARCH_LOCKS": str(root / "locks")}
        self.env.pop("RAY_ADDRESS", None)
        self.procs: dict[str, subprocess.Popen] = {}

    def start_node(self, name: str, *, head: bool) -> None:
        cache = self.root / f"cache-{name}"
        resources = {"trial_slot": 1, f"node_{name}": 1}
        args = [str(BIN / "ray"), "start", "--block", "--num-cpus=1", f"--resources={json.dumps(resources)}",
                "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
        args += ["--head", f"--port={self.port}", "--include-dashboard=false"] if head else [f"--address={self.address}"]
        env = {**self.env, "LOCALITY_SEARCH_CACHE": str(cache),
               # the head's GCS declares a silent node dead after ~3 s instead of ~30 s
               "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
               "RAY_health_check_failure_threshold": "3"}
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 -- closed with the process
        self.procs[name] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def nodes(self) -> dict[str, str]:
        """Alive nodes: our name (from the node_<name> resource) -> Ray node id."""
        script = ("import json, ray; ray.init(address=%r, log_to_driver=False, logging_level='ERROR');"
                  "print(json.dumps([[n['NodeID'], list(n['Resources'])] for n in ray.nodes() if n['Alive']]))") % self.address
        out = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            return {}
        return {r[len("node_"):]: node for node, resources in json.loads(out.stdout.splitlines()[-1])
                for r in resources if r.startswith("node_")}

    def wait_for(self, names: set[str], timeout: float = 120) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # the head's GCS first: before it listens, ray.init hangs
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        while time.monotonic() < deadline:
            nodes = self.nodes()
            if set(nodes) == names:
                return nodes
            time.sleep(1)
        raise AssertionError(f"cluster nodes never became {names}; logs in {self.root}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)

    def stop(self) -> None:
        # SIGKILL: on SIGTERM a node drains for up to 30 s first, with nothing left to drain here
        for name in list(self.procs):
            self.kill(name)

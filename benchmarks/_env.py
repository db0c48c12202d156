"""Where a benchmark ran, and one JSON file per benchmark and device.

    write_result("gpsa_layer", {...})  ->  benchmarks/results/gpsa_layer-<device-slug>.json

On a CPU the slug also names the instruction set torch's kernels use, and where the model name
carries no model number (a VM's "AMD EPYC") the CPU family too ("amd-epyc-avx2-fam25": Zen 3,
"amd-epyc-avx512-fam25": Zen 4, "amd-epyc-avx512-fam26": Zen 5): one VM model name covers CPUs
generations apart.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import re
from pathlib import Path
from typing import Any, Iterator, Sequence, TypeVar

import torch

from trainers import PROJECT_ROOT, cpu_family, cpu_has_native_bf16, cpuinfo_field, git_commit, tracked_files_modified

__all__ = [
    "environment", "result_slug", "write_result", "bf16_by_default", "RESULTS_DIR", "setup_process",
    "add_malloc_option", "parse_and_set_up", "sync", "autocast", "init_local_ray", "project_pythonpath",
    "shuffled_rounds",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _cpu_name() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


_T = TypeVar("_T")


def shuffled_rounds(contenders: Sequence[_T], repeats: int, *, seed: int = 0) -> Iterator[list[_T]]:
    """`repeats` rounds of the contenders timed side by side, each round in its own order (seeded:
    the same from run to run). In a fixed order each contender always runs right after the same
    one, and pays for the state that one leaves (dirty caches, a grown heap): on the Xeon, our
    GPSA layer right after timm's read 5-7% slower than its identical twin later in the round
    (20.3-21.1 vs 18.9-19.5 ms, two runs; shuffled, 19.7-20.0 vs 19.4-19.8). Shifting the start by
    one each round leaves every contender's predecessor the same in all but one round in n."""
    order = random.Random(seed)
    for _ in range(repeats):
        round_ = list(contenders)
        order.shuffle(round_)
        yield round_


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a host clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """fp32: nothing; bf16: `torch.autocast(device, bfloat16)`, as a trial's `precision: bf16`."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def bf16_by_default(device: str | torch.device) -> tuple[bool, str]:
    """Whether a benchmark times bf16 columns unless told: on CUDA and on CPUs with bf16 hardware.
    Elsewhere oneDNN emulates bf16 about 16x slower than fp32: timing it would take the run's
    time and tell nothing. The second value says why it is off ("" when on)."""
    device = torch.device(device)
    if device.type == "cuda" or cpu_has_native_bf16():
        return True, ""
    return False, (f"{_cpu_name()} has no bf16 hardware ({torch.backends.cpu.get_cpu_capability()}); "
                   "bf16 is emulated there, about 16x slower than fp32")


def project_pythonpath() -> str:
    """PYTHONPATH for a process that imports this project (a benchmark's child, a Ray worker): the
    project root first, then what this process was given."""
    return os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))


def init_local_ray(*, num_cpus: int) -> None:
    """Start a local Ray of the benchmark's own, quiet and without the dashboard, whose workers
    import this project as the search's do."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", runtime_env={"env_vars": {"PYTHONPATH": project_pythonpath()}})


def setup_process(*, retain_memory: bool = True) -> bool:
    """What a trainer process does before timing anything: keep freed memory (glibc; see
    trainers/_malloc.py), as `train_trial` does. Every contender of a benchmark runs under it."""
    if not retain_memory:
        return False
    from trainers import retain_freed_memory

    return retain_freed_memory()


def add_malloc_option(parser: argparse.ArgumentParser) -> None:
    """--glibc-default-malloc: time the contenders without `setup_process`'s retained memory."""
    parser.add_argument("--glibc-default-malloc", action="store_true",
                        help="leave glibc's trim/mmap thresholds alone (default: keep freed memory, as the trainer does)")


def parse_and_set_up(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """A benchmark's arguments, with the process set up as a trainer's (`setup_process`, unless
    --glibc-default-malloc was given); a --device cuda (one or a list) without CUDA is a usage error."""
    args = parser.parse_args(argv)
    setup_process(retain_memory=not getattr(args, "glibc_default_malloc", False))
    devices = getattr(args, "device", None) or []
    if "cuda" in ([devices] if isinstance(devices, str) else devices) and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    return args


def device_name(device: str | torch.device = "cpu") -> str:
    """The CUDA device's name for a CUDA device, else the CPU model."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return _cpu_name()


def environment(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What the numbers depend on (no hostname): device, CPU features, library versions, threads, platform."""
    try:
        import timm
        timm_version = timm.__version__
    except ImportError:
        timm_version = None
    return {
        "device": str(torch.device(device)),
        "device_name": device_name(device),
        "cpu": _cpu_name(),
        "cpu_family": cpu_family(),  # x86 family: 25 for AMD Zen 3 and 4, 26 for Zen 5
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the ISA torch's CPU kernels use
        "cpu_native_bf16": cpu_has_native_bf16(),  # picks the GPSA core's GEMM dtype under bf16 autocast
        "cuda_available": torch.cuda.is_available(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "timm": timm_version,
        "python": platform.python_version(),
        "torch_num_threads": torch.get_num_threads(),
        "malloc_retains_freed_memory": _malloc_state(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        # tracked files changed since that commit (the results folder aside): the numbers then
        # come from code no commit holds
        "git_modified": tracked_files_modified(ignore=(RESULTS_DIR.relative_to(PROJECT_ROOT).as_posix(),)),
    }


def _malloc_state() -> bool | None:
    try:
        from trainers import freed_memory_retained
    except ImportError:
        return None
    return freed_memory_retained()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def result_slug(env: dict[str, Any]) -> str:
    """The device part of a result's file name: the device's name, and on a CPU its ISA level and,
    where the name has no model number, its family."""
    slug = _slug(env["device_name"])
    if env["device"] == "cpu" and env.get("cpu_capability"):
        slug += "-" + _slug(env["cpu_capability"])
    if env["device"] == "cpu" and env.get("cpu_family") is not None and not any(c.isdigit() for c in env["device_name"]):
        slug += f"-fam{env['cpu_family']}"
    return slug


def result_path(name: str, env: dict[str, Any] | None = None, *, results_dir: Path | None = None) -> Path:
    """Where ``write_result`` puts ``name`` on this machine (``env``: its ``environment()``)."""
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    return folder / f"{name}-{result_slug(env or environment())}.json"


def write_result(name: str, payload: dict[str, Any], device: str | torch.device = "cpu", *,
                 results_dir: Path | None = None) -> Path:
    """Write payload + environment + UTC timestamp to benchmarks/results/<name>-<result_slug>.json
    (or into ``results_dir``)."""
    env = environment(device)
    record = {
        "name": name,
        **payload,
        "environment": env,
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    path = result_path(name, env, results_dir=results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # a run killed mid-write leaves the last whole file
    partial.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return path

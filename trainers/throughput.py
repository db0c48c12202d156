"""Inference throughput, parameter count and FLOPs of a model, measured the same way every time.

Throughput depends on the architecture, the input and the device, not on the training
settings, so it is measured once per trial, before training: eval mode, inference mode,
a fixed batch, warm-up iterations, synchronised timing, the median of several repeats.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["ThroughputResult", "measure_throughput", "count_flops", "count_params", "device_name", "resolve_precision"]


@dataclasses.dataclass(frozen=True)
class ThroughputResult:
    images_per_s: float
    median_batch_s: float
    batch_size: int
    repeats: int
    device: str  # e.g. "cpu: AMD EPYC 7B13 (2 threads)" or "cuda: NVIDIA H100 80GB HBM3"
    precision: str  # fp32 | bf16 | fp16
    threads: int
    torch_version: str


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {model}"


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    return "fp16" if device.type == "cuda" else "fp32"


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, input_shape: tuple[int, int, int]) -> int:
    """Forward FLOPs for one image (a multiply-add counts 2), by ``torch.utils.flop_counter``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    x = torch.zeros((1, *input_shape), device=device)
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(x)
    model.train(was_training)
    return int(counter.get_total_flops())


def measure_throughput(
    model: nn.Module,
    *,
    input_shape: tuple[int, int, int],
    batch_size: int = 256,
    warmup: int = 3,
    repeats: int = 10,
    precision: str = "auto",
    channels_last: bool = False,
) -> ThroughputResult:
    """Images per second of ``model``'s forward pass, median over ``repeats`` timed batches."""
    device = next(model.parameters()).device
    precision = resolve_precision(precision, device)
    was_training = model.training
    model.eval()
    x = torch.randn((batch_size, *input_shape), device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    times = []
    with torch.inference_mode(), _autocast(precision, device):
        for _ in range(warmup):
            model(x)
        _sync(device)
        for _ in range(repeats):
            start = time.perf_counter()
            model(x)
            _sync(device)
            times.append(time.perf_counter() - start)
    model.train(was_training)
    median = statistics.median(times)
    return ThroughputResult(
        images_per_s=batch_size / median,
        median_batch_s=median,
        batch_size=batch_size,
        repeats=repeats,
        device=device_name(device),
        precision=precision,
        threads=torch.get_num_threads(),
        torch_version=str(torch.__version__),  # TorchVersion would not load with weights_only
    )

"""Inference throughput, parameter count and FLOPs of a model, measured the same way every time.

Throughput depends on the architecture, the input and the device, not on the training
settings, so it is measured once per architecture and reused: eval mode, inference mode, a
fixed batch, warm-up iterations, synchronised timing, the median of several repeats; on a GPU,
each batch one replay of the forward captured as a CUDA graph (``throughput.cuda_graph``); on the CPU,
the fastest of three such rounds, and a round timed again when another process took cores
meanwhile (:func:`measure_throughput`).

The cache (:func:`measure_model` with a ``cache_dir``) is keyed by the architecture's
fingerprint -- ``repr(model)`` (every module and its sizes) plus every parameter's and buffer's
name, shape and dtype -- by the source of the code that runs it (:func:`implementation_fingerprint`:
a faster implementation gets measured anew), and by the input shape, device name, precision,
batch size, CPU threads, memory layout and torch version. Knobs that only change the initial values or the
training (ConViT's locality strength, a gate's learning rate, T-CNN's conversion epoch) leave
the fingerprint alone, so every trial of one architecture gets the same number, and the Pareto
front compares architectures rather than the machine's noise between two measurements.
A measurement has its device to itself: it takes the device's lock exclusively, so neither
another measurement nor a trial training on the same device (a shared GPU, the machine's CPU)
runs while it times (see ``trainers._device_share``).

On the CPU a trial's model is also timed beside a reference (:func:`measure_model`'s
``reference``: the trainer passes the model as named, with default arguments), batch for batch.
A cloud VM has slow phases that no CPU accounting shows, up to seconds long, in which
everything runs slower; they slow the model and the reference alike, so the cost ratio
between the two holds, and the trial's number is the reference's (measured once per node)
divided by it.
"""

from __future__ import annotations

import dataclasses
import math
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
import contextlib
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainers._atomic import atomic_write
from trainers._cuda_graph import CaptureError, capture_inference
from trainers._device_share import device_share
from trainers.precision import autocast_dtype, autocast_for, resolve_precision

__all__ = [
    "ThroughputResult",
    "measure_throughput",
    "measure_model",
    "architecture_fingerprint",
    "implementation_fingerprint",
    "count_flops",
    "count_params",
    "median_interval",
    "with_noise_floor",
    "device_name",
]


@dataclasses.dataclass(frozen=True)
class ThroughputResult:
    images_per_s: float
    median_batch_s: float
    batch_size: int
    repeats: int
    device: str  # "cpu: <the CPU's model name>" or "cuda: <the GPU's name>" (`device_name`)
    precision: str  # fp32 | bf16 | fp16
    threads: int
    torch_version: str
    cpu_share: float = 1.0  # the kept round's share of threads x wall time this process ran (CPU)
    kept_round: int = 1  # which round was kept, the fastest (see measure_throughput)
    rounds: int = 1  # rounds timed: 1 on a GPU; on the CPU CPU_ROUNDS, more when some were contended
    reference_ratio: float | None = None  # with a reference: the model's batch time over the reference's (see measure_throughput)
    cuda_graph: bool = False  # timed as replays of one captured CUDA graph (GPU only, see measure_throughput)
    # the median cost's 95% interval as images/s (see median_interval); with a reference, of the
    # cost ratio (reference_ratio_low/high), which measure_model turns into images/s
    images_per_s_low: float = math.nan
    images_per_s_high: float = math.nan
    reference_ratio_low: float | None = None
    reference_ratio_high: float | None = None
    reference_images_per_s: float | None = None  # the reference's own batches in its fastest round beside the model


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
    with torch.inference_mode():
        model(x)  # first: loads (or builds) the CPU kernels, registering their formulas before the count
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(x)
    model.train(was_training)
    return int(counter.get_total_flops())


# A CPU measurement is the fastest of CPU_ROUNDS rounds timed one after another. A cloud VM has
# slow phases that no CPU accounting shows (the process's share of its cores unchanged), from a
# fraction of a second to a few seconds, that make a single round read far slower than the
# architecture's typical figure; the fastest of three stays near it. (Rule: a measurement must not
# depend on when it was taken; benchmarks/models.py times the families in shuffled rounds.)
CPU_ROUNDS = 3
MEASUREMENT_METHOD = "fastest-of-3+median-interval+reference-check"  # in the cache key: numbers timed another way are not reused
# A freshly timed reference is checked by the first model timed beside it: where the reference's
# own batches there ran this much faster than its number, a slow phase had set that number (one
# was read 4x low, and every trial of its study with it): it is timed again and the faster kept,
# before any trial's number is taken from it.
REFERENCE_RECHECK = 1.25
# A round counts only when this process had the CPU to itself: alone, its threads keep their cores
# busy (process CPU time ~ threads x wall, a share near 1), while another busy process (Ray
# starting its dashboard beside a study's first trial, say) takes a core, slows the forward
# severalfold and drops the share well below this floor. Below it the round is timed again after
# a pause, up to CPU_ATTEMPTS rounds in all, and the fastest round is kept.
CPU_SHARE_FLOOR = 0.9
CPU_ATTEMPTS = 6
CPU_RETRY_PAUSE_S = 1.0


def median_interval(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``samples``: the order statistics x_(j) and
    x_(n+1-j) with the largest j whose coverage, 1 - 2 P(Binomial(n, 1/2) < j), is at least
    ``confidence`` (Conover, Practical Nonparametric Statistics, 3rd ed., sec. 3.2); the range
    of the samples when there are too few for that (n < 6 at 95%)."""
    x = sorted(samples)
    n = len(x)
    if not n:
        return math.nan, math.nan
    j, below = 0, 0.0  # below: P(Binomial(n, 1/2) < j + 1)
    while True:
        below_next = below + math.comb(n, j) / 2.0**n
        if 1 - 2 * below_next < confidence or j + 1 > n // 2:
            break
        j, below = j + 1, below_next
    return (x[j - 1], x[n - j]) if j >= 1 else (x[0], x[-1])


def _timed_round(model: Callable[[torch.Tensor], Any], x: torch.Tensor, repeats: int, device: torch.device,
                 reference: Callable[[torch.Tensor], Any] | None = None) -> tuple[list[float], list[float], float]:
    """Seconds per batch over ``repeats`` batches; with a reference, seconds per reference batch,
    one after each of the model's (else an empty list); and the share of the CPU this process had
    while timing them (its CPU time over threads x wall time; 1 when its threads never waited for a
    core)."""
    times, reference_times = [], []
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        for net, into in ((model, times), (reference, reference_times)):
            if net is not None:
                start = time.perf_counter()
                net(x)
                _sync(device)
                into.append(time.perf_counter() - start)
    wall = time.perf_counter() - wall_start
    return times, reference_times, (time.process_time() - cpu_start) / max(wall * torch.get_num_threads(), 1e-9)


def measure_throughput(
    model: nn.Module,
    *,
    input_shape: tuple[int, int, int],
    batch_size: int = 256,
    warmup: int = 3,
    repeats: int = 10,
    precision: str = "auto",
    channels_last: bool = False,
    reference: nn.Module | None = None,
    cuda_graph: bool = True,
) -> ThroughputResult:
    """Images per second of ``model``'s forward pass, median over ``repeats`` timed batches. On the
    CPU the fastest of CPU_ROUNDS such rounds, a round timed while another process took cores not
    counted among them (see CPU_SHARE_FLOOR). On a GPU with ``cuda_graph``, the forward is
    captured after the warm-up and each timed batch is one replay of the graph
    (`trainers._cuda_graph`: the GPU's cost of the architecture, not the host's speed at
    enqueueing it); a model that cannot be captured is timed eagerly, with a warning
    (``ThroughputResult.cuda_graph`` says which).

    With a ``reference`` model (on the same device, taking the same input), each of the model's
    batches is followed by one of the reference's, and ``reference_ratio`` is the model's median
    batch time over the reference's, the median over the counted rounds: what the model costs
    relative to the reference, whatever the machine's speed while they were timed."""
    device = next(model.parameters()).device
    precision = resolve_precision(precision, device)  # throughput.precision: the rule of trainers.precision
    autocast = autocast_for(precision, device)
    timed = [(net, net.training) for net in (model, reference) if net is not None]
    for net, _ in timed:
        net.eval()
    x = torch.randn((batch_size, *input_shape), device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    best = None  # (median seconds per batch, CPU share, which round)
    reference_best = math.inf  # the reference's fastest round median (seconds per batch), beside the model
    ratios, contended_ratios = [], []  # per round: the model's median batch time over the reference's
    # every batch of the counted rounds (of all rounds, where none counted): its time; its time over the reference's
    counted_times, counted_ratios, all_times, all_ratios = [], [], [], []
    with torch.inference_mode(), autocast():
        for _ in range(warmup):
            for net, _ in timed:
                net(x)
        _sync(device)
    runners: list[Callable[[torch.Tensor], Any]] = [net for net, _ in timed]
    graphed = False
    if cuda_graph and device.type == "cuda":
        try:
            graphs = [capture_inference(net, x, autocast_dtype=autocast_dtype(precision, device)) for net in runners]
        except CaptureError as exc:
            warnings.warn(f"{exc}; its throughput is timed eagerly", stacklevel=2)
        else:  # each replay reads the graph's own input (same values as x): no copy per batch
            runners = [lambda _x, g=g: g(g.static_input) for g in graphs]
            graphed = True
    run_model, run_reference = runners[0], runners[1] if reference is not None else None
    with torch.inference_mode(), autocast():
        uncontended = 0
        for attempt in range(1, CPU_ATTEMPTS + 1):
            times, reference_times, cpu_share = _timed_round(run_model, x, repeats, device, run_reference)
            median = statistics.median(times)
            if best is None or median < best[0]:
                best = (median, cpu_share, attempt)
            counted = device.type != "cpu" or cpu_share >= CPU_SHARE_FLOOR
            batch_ratios = [t / r for t, r in zip(times, reference_times)]
            all_times += times
            all_ratios += batch_ratios
            if counted:
                counted_times += times
                counted_ratios += batch_ratios
            if reference_times:
                (ratios if counted else contended_ratios).append(median / statistics.median(reference_times))
                reference_best = min(reference_best, statistics.median(reference_times))
            if device.type != "cpu":
                break  # one round on a GPU, as before: the slow phases were seen on CPU VMs
            if cpu_share >= CPU_SHARE_FLOOR:
                uncontended += 1
            elif attempt < CPU_ATTEMPTS:
                time.sleep(CPU_RETRY_PAUSE_S)  # let the other work pass
            if uncontended == CPU_ROUNDS:
                break
    for net, training in timed:
        net.train(training)
    median, cpu_share, kept_round = best
    fast_s, slow_s = median_interval(counted_times or all_times)  # seconds per batch
    ratio_low, ratio_high = median_interval(counted_ratios or all_ratios) if reference is not None else (None, None)
    return ThroughputResult(
        images_per_s=batch_size / median,
        median_batch_s=median,
        batch_size=batch_size,
        repeats=repeats,
        device=device_name(device),
        precision=precision,
        threads=torch.get_num_threads(),
        torch_version=str(torch.__version__),  # TorchVersion would not load with weights_only
        cpu_share=cpu_share,
        kept_round=kept_round,
        rounds=attempt,
        reference_ratio=statistics.median(ratios or contended_ratios) if reference is not None else None,
        cuda_graph=graphed,
        # the kept (fastest) round's median may lie above the pooled interval: the interval holds it
        images_per_s_low=min(batch_size / slow_s, batch_size / median),
        images_per_s_high=max(batch_size / fast_s, batch_size / median),
        reference_ratio_low=ratio_low,
        reference_ratio_high=ratio_high,
        reference_images_per_s=batch_size / reference_best if reference is not None else None,
    )


# read by implementation_fingerprint
MODEL_SOURCES = Path(__file__).resolve().parent / "models"
KERNEL_SOURCES = Path(__file__).resolve().parent / "kernels"


def architecture_fingerprint(model: nn.Module) -> str:
    """What the cost of a forward pass depends on in the model itself (see the module doc)."""
    digest = hashlib.sha256(repr(model).encode())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()[:24]


def implementation_fingerprint(model: nn.Module) -> str:
    """The source that runs the model's forward: the files of every module defining one of its
    modules' classes (and their bases), plus this project's model files (shared helpers such as
    `_common`) and its kernels package with the C++ it builds (`kernels/csrc`). torch itself is keyed
    by its version.
    A speed-up in that code then gets a new measurement instead of a number timed with the old code."""
    files = (set(MODEL_SOURCES.glob("*.py")) | set(KERNEL_SOURCES.glob("*.py"))
             | set((KERNEL_SOURCES / "csrc").glob("*")))
    for module in model.modules():
        for cls in type(module).__mro__:
            source = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if source and not cls.__module__.startswith("torch"):
                files.add(Path(source).resolve())
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(str(path.name).encode())
        with suppress(OSError):  # a module without a readable source: its name only
            digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


def measure_model(
    model: nn.Module,
    *,
    input_shape: tuple[int, int, int],
    batch_size: int = 256,
    warmup: int = 3,
    repeats: int = 10,
    precision: str = "auto",
    channels_last: bool = False,
    cache_dir: str | os.PathLike | None = None,
    reference: nn.Module | None = None,
    cuda_graph: bool = True,
    runtime: str = "kernels",
) -> dict[str, Any]:
    """Params, FLOPs/image and throughput of ``model`` as a flat record (the trial row's columns);
    from the cache when this architecture was measured on this device with these settings.
    ``runtime``: "kernels" times the forward with this project's kernels as they are switched
    (trainers.kernels), "eager" with them off: torch's stock ops, whatever the switch says.

    With a ``reference`` model on the CPU (the trainer passes its model as named, with default
    arguments): the reference is measured as any model (once per node and settings, cached), and
    ``model`` is timed beside it (:func:`measure_throughput`): its ``throughput`` is the
    reference's divided by their cost ratio, so two architectures measured minutes apart compare
    by what they cost, not by how fast the VM ran at the time; ``throughput_timed`` is the model's
    own fastest round. A reference timed in this call is checked by the rounds beside the model
    (REFERENCE_RECHECK) and timed again where they ran clearly faster. On a GPU, ``cuda_graph`` times the forward as CUDA graph replays
    (:func:`measure_throughput`; ``throughput_cuda_graph`` says whether it was)."""
    device = next(model.parameters()).device
    precision = resolve_precision(precision, device)
    if runtime not in ("eager", "kernels"):
        raise ValueError(f"runtime must be 'eager' or 'kernels', got {runtime!r}")
    settings = dict(input_shape=input_shape, batch_size=batch_size, warmup=warmup, repeats=repeats,
                    precision=precision, channels_last=channels_last, runtime=runtime)
    reference_record, fresh_reference = None, False
    if reference is not None and device.type == "cpu":
        reference_record = measure_model(reference, **settings, cache_dir=cache_dir)
        if reference_record["architecture"] == architecture_fingerprint(model):
            return {**reference_record, "throughput_reference": reference_record["architecture"]}
        fresh_reference = not reference_record["throughput_cached"]
    key_settings = dict(input_shape=input_shape, precision=precision, batch_size=batch_size,
                        channels_last=channels_last, runtime=runtime, cuda_graph=cuda_graph)
    path = _cache_path(cache_dir, model, device, key_settings, reference_record)
    cached = _read_cached(path)
    if cached is not None:
        return cached
    with device_share(device).exclusive():
        if reference_record is not None:  # the check below, in another trial, may have timed it again
            reference_path = _cache_path(cache_dir, reference, device, key_settings, None)
            reread = _read_cached(reference_path) or reference_record
            fresh_reference = fresh_reference and reread["throughput"] == reference_record["throughput"]
            reference_record = reread
            path = _cache_path(cache_dir, model, device, key_settings, reference_record)
        cached = _read_cached(path)  # another trial may have measured it while we waited
        if cached is not None:
            return cached
        timed = {k: v for k, v in settings.items() if k != "runtime"}
        with _in_runtime(runtime):
            result = measure_throughput(model, **timed, reference=reference if reference_record is not None else None,
                                        cuda_graph=cuda_graph)
            if fresh_reference and result.reference_images_per_s > reference_record["throughput"] * REFERENCE_RECHECK:
                reference_record = _retime_reference(reference, reference_record, result.reference_images_per_s,
                                                     timed=timed, path=reference_path)
                path = _cache_path(cache_dir, model, device, key_settings, reference_record)
        throughput, low, high = result.images_per_s, result.images_per_s_low, result.images_per_s_high
        if reference_record is not None:
            # the reference's own number is the node's common scale: its noise moves every trial
            # alike, so the interval is the cost ratio's
            throughput = reference_record["throughput"] / result.reference_ratio
            low = reference_record["throughput"] / max(result.reference_ratio_high, result.reference_ratio)
            high = reference_record["throughput"] / min(result.reference_ratio_low, result.reference_ratio)
        record = {
            "params": count_params(model),
            "flops": count_flops(model, input_shape),
            "throughput": throughput,
            "throughput_timed": result.images_per_s,
            "throughput_low": low,
            "throughput_high": high,
            "throughput_reference": reference_record["architecture"] if reference_record is not None else None,
            "throughput_device": result.device,
            "throughput_runtime": runtime,
            "throughput_batch": result.batch_size,
            "throughput_precision": result.precision,
            "throughput_threads": result.threads,
            "throughput_cuda_graph": result.cuda_graph if device.type == "cuda" else None,
            "torch_version": result.torch_version,
            "architecture": architecture_fingerprint(model),
        }
        if path is not None:
            atomic_write(path, lambda handle: handle.write(json.dumps(record).encode()))
    return {**record, "throughput_cached": False}


@contextlib.contextmanager
def _in_runtime(runtime: str):
    """The kernels switched off for an "eager" measurement, as they were after it."""
    from trainers import kernels

    was = kernels.enabled()
    kernels.set_enabled(was and runtime == "kernels")
    try:
        yield
    finally:
        kernels.set_enabled(was)


def _cache_path(cache_dir: str | os.PathLike | None, model: nn.Module, device: torch.device,
                settings: dict[str, Any], reference_record: dict[str, Any] | None) -> Path | None:
    """Where ``model``'s measurement with these settings is cached (see the module doc)."""
    if cache_dir is None:
        return None
    key_fields = {
        "architecture": architecture_fingerprint(model),
        "code": implementation_fingerprint(model),
        "input_shape": list(settings["input_shape"]),
        "device": device_name(device),
        "precision": settings["precision"],
        "batch_size": settings["batch_size"],
        "threads": torch.get_num_threads(),
        "channels_last": settings["channels_last"],
        "torch": str(torch.__version__),
        "method": MEASUREMENT_METHOD,
        "runtime": settings["runtime"],
    }
    if device.type == "cuda":  # (not on the CPU: its measurements cached before the setting stay valid)
        key_fields["cuda_graph"] = settings["cuda_graph"]
    if reference_record is not None:  # measured against this reference's number: a new one, new measurements
        key_fields["reference"] = [reference_record["architecture"], reference_record["throughput"]]
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:32]
    return Path(cache_dir) / f"{key}.json"


def _retime_reference(reference: nn.Module, record: dict[str, Any], beside: float, *, timed: dict[str, Any],
                      path: Path | None) -> dict[str, Any]:
    """The reference timed again on its own (REFERENCE_RECHECK); the faster of its two numbers,
    written back to its cache entry."""
    again = measure_throughput(reference, **timed)
    warnings.warn(f"throughput: the reference model read {record['throughput']:,.0f} img/s when first timed and "
                  f"{beside:,.0f} beside the first model; timed again: {again.images_per_s:,.0f}, the faster kept",
                  stacklevel=3)
    if again.images_per_s <= record["throughput"]:
        return record
    kept = {k: v for k, v in record.items() if k != "throughput_cached"}
    kept.update(throughput=again.images_per_s, throughput_timed=again.images_per_s, throughput_low=again.images_per_s_low,
                throughput_high=again.images_per_s_high, throughput_retimed_from=record["throughput"])
    if path is not None:
        atomic_write(path, lambda handle: handle.write(json.dumps(kept).encode()))
    return {**kept, "throughput_cached": False}


def with_noise_floor(record: dict[str, Any], floor: float) -> dict[str, Any]:
    """``record`` with its throughput interval widened to at least ``floor`` of the value on each
    side: the noise between two measurements of one architecture (another process, another
    moment) that no single measurement's batches show. Unknown bounds (a cache entry from before
    intervals were recorded) stay unknown."""
    value, low, high = record.get("throughput"), record.get("throughput_low"), record.get("throughput_high")
    if value is None or low is None or high is None or not floor:
        return record
    return {**record, "throughput_low": min(low, value * (1 - floor)), "throughput_high": max(high, value * (1 + floor))}


def _read_cached(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        return {**json.loads(path.read_text()), "throughput_cached": True}
    except (OSError, ValueError):
        return None  # unreadable: measure again and overwrite it

"""One GPSA layer, forward + backward: timm's GPSA vs trainers.models.ls_convit.GPSA.

    python -m benchmarks.gpsa_layer                      # batch 256, 49 tokens, dim 96, 4 heads; CPU (+ CUDA)
    python -m benchmarks.gpsa_layer --device cpu --repeats 30

Both layers hold the same weights (ours loads timm's state dict) and see the same input; the two
are timed alternately (timm, ours, timm, ours, ...) after a warm-up, so drifts in machine load hit
both alike. Reports the median of each and the ratio timm / ours (> 1: ours is faster), and writes
benchmarks/results/gpsa_layer-<device>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from timm.models.convit import GPSA as TimmGPSA

from benchmarks._env import setup_process, write_result
from trainers.models.ls_convit import GPSA


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    layer(x).sum().backward()


def _time(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def run(*, batch: int, tokens: int, dim: int, heads: int, repeats: int, warmup: int, device: str) -> dict:
    dev = torch.device(device)
    torch.manual_seed(0)
    ref = TimmGPSA(dim, num_heads=heads, locality_strength=1.0).to(dev)
    ref.local_init()
    with torch.no_grad():  # move off the init so content and position both matter
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = GPSA(dim, num_heads=heads).to(dev)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(batch, tokens, dim, device=dev, requires_grad=True)
    with torch.no_grad():
        max_abs_diff = (ref(x) - ours(x)).abs().max().item()

    layers = {"timm": ref, "ours": ours}
    for _ in range(warmup):
        for layer in layers.values():
            _step(layer, x)
    times: dict[str, list[float]] = {"timm": [], "ours": []}
    for _ in range(repeats):
        for name, layer in layers.items():
            times[name].append(_time(lambda: _step(layer, x), dev))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "config": dict(batch=batch, tokens=tokens, dim=dim, heads=heads, repeats=repeats, warmup=warmup,
                       device=str(dev), dtype="float32", what="one GPSA layer, forward + backward"),
        "median_s": med,
        "times_s": times,
        "ratio_timm_over_ours": med["timm"] / med["ours"],
        "max_abs_output_diff": max_abs_diff,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=49, help="patch tokens; must be a square number")
    parser.add_argument("--dim", type=int, default=96, help="total width (timm GPSA's dim)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", action="append", choices=["cpu", "cuda"],
                        help="repeatable; default: cpu, plus cuda when available")
    parser.add_argument("--glibc-default-malloc", action="store_true",
                        help="leave glibc's trim/mmap thresholds alone (default: keep freed memory, as the trainer does)")
    args = parser.parse_args(argv)
    setup_process(retain_memory=not args.glibc_default_malloc)
    devices = args.device or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available here")
        result = run(batch=args.batch, tokens=args.tokens, dim=args.dim, heads=args.heads,
                     repeats=args.repeats, warmup=args.warmup, device=device)
        path = write_result("gpsa_layer", result, device=device)
        med = result["median_s"]
        print(f"[{device}] batch={args.batch} tokens={args.tokens} dim={args.dim} heads={args.heads} "
              f"threads={torch.get_num_threads()}")
        print(f"  timm GPSA  fwd+bwd median: {med['timm'] * 1e3:8.2f} ms")
        print(f"  ours GPSA  fwd+bwd median: {med['ours'] * 1e3:8.2f} ms")
        print(f"  ratio timm/ours: {result['ratio_timm_over_ours']:.2f}x   "
              f"(max |out diff| {result['max_abs_output_diff']:.1e})  -> {path}")


if __name__ == "__main__":
    main()

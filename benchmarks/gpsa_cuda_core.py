"""GPSA's attention core for CUDA inference: the fused Triton kernel vs fused SDPA + P @ V.

    python -m benchmarks.gpsa_cuda_core                  # ConViT-Ti at 224 px and at 32 px, bf16
    python -m benchmarks.gpsa_cuda_core --repeats 500

The two ways `ls_convit.GPSA` computes (1 - s) softmax(Q K^T / sqrt(d)) V + (s P) V in fp16/bf16
inference on a GPU, on the same inputs (q, k and v as the qkv projection lays them out, (B, N, 3,
H, d)); the outputs are compared. Per shape and per way, timed alternately in rounds after a
warm-up, each round in its own seeded order (`_env.shuffled_rounds`):
  gpu_us   GPU time per call: CUDA events around a round of back-to-back calls;
  host_us  host time per call: the same rounds' wall time to enqueue, the GPU drained before each
           round (a small model's eager batch on a GPU can be bound by this, not by GPU time).
Ratios are SDPA path / kernel (> 1: the kernel is faster). The fused SDPA content term alone is
timed too (the floor the two-term core is measured against). Writes
benchmarks/results/gpsa_cuda_core-<device>.json. Needs a CUDA GPU and Triton.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks._env import setup_process, shuffled_rounds, write_result
from trainers import kernels

# (label, batch, tokens, heads, head width): ConViT-Ti (dim 192, 4 heads) at its default batches
SHAPES = (("224 px (14 x 14 tokens)", 256, 196, 4, 48), ("32 px, patch 4 (8 x 8 tokens)", 1024, 64, 4, 48))


def _inputs(batch: int, tokens: int, heads: int, width: int, dtype: torch.dtype, device: str = "cuda"):
    torch.manual_seed(0)
    qkv = torch.randn(batch, tokens, 3, heads, width, device=device, dtype=dtype)
    gate = torch.rand(heads, device=device)
    positional = torch.softmax(3 * torch.randn(heads, tokens, tokens, device=device), dim=-1)
    gated_pos = (gate.view(-1, 1, 1) * positional).to(dtype)  # s P, as GPSA keeps it for inference
    return qkv, gated_pos, (1 - gate).to(dtype).view(-1, 1)


def _ways(qkv, gated_pos, content_weight, scale):
    B, N, _, H, d = qkv.shape
    q, k, v = qkv.unbind(2)

    def content():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    def sdpa_path():  # GPSA.forward's path with the kernel switched off
        pos_out = torch.bmm(gated_pos, v.permute(2, 1, 0, 3).reshape(H, N, B * d))
        pos_out = pos_out.view(H, N, B, d).permute(2, 1, 0, 3)
        return torch.addcmul(pos_out, content().transpose(1, 2), content_weight,
                             out=torch.empty((B, N, H, d), dtype=qkv.dtype, device=qkv.device))

    def kernel():
        return kernels.triton_gated_attention(qkv, gated_pos, content_weight, scale)

    return {"fused kernel": kernel, "SDPA + P @ V": sdpa_path, "SDPA content term alone": content}


def _round(fn, calls: int) -> tuple[float, float]:
    """(GPU us, host us) per call over `calls` back-to-back calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls, host * 1e6 / calls


def run(*, repeats: int, calls: int, warmup: int, dtype: torch.dtype) -> dict:
    results = {}
    for label, batch, tokens, heads, width in SHAPES:
        qkv, gated_pos, content_weight = _inputs(batch, tokens, heads, width, dtype)
        ways = _ways(qkv, gated_pos, content_weight, width ** -0.5)
        with torch.inference_mode():
            diff = (ways["fused kernel"]().float() - ways["SDPA + P @ V"]().float()).abs().max().item()
            for fn in ways.values():
                _round(fn, warmup)  # the kernel's first call tunes its blocks
            gpu = {name: [] for name in ways}
            host = {name: [] for name in ways}
            for round_ in shuffled_rounds(list(ways), repeats):
                for name in round_:
                    g, h = _round(ways[name], calls)
                    gpu[name].append(g)
                    host[name].append(h)
        gpu_us = {name: statistics.median(v) for name, v in gpu.items()}
        host_us = {name: statistics.median(v) for name, v in host.items()}
        results[label] = {
            "shape": dict(batch=batch, tokens=tokens, heads=heads, head_dim=width),
            "max_abs_diff": diff,
            "gpu_us": gpu_us,
            "host_us": host_us,
            "ratio_sdpa_path_over_kernel": {"gpu": gpu_us["SDPA + P @ V"] / gpu_us["fused kernel"],
                                            "host": host_us["SDPA + P @ V"] / host_us["fused kernel"]},
        }
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="rounds per way (medians over them)")
    parser.add_argument("--calls", type=int, default=50, help="back-to-back calls per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = parser.parse_args(argv)
    probe = torch.zeros(1, dtype=torch.bfloat16, device="cuda") if torch.cuda.is_available() else None
    if probe is None or not kernels.triton_gated_attention_usable(probe, 48):
        print("error: gpsa_cuda_core needs a CUDA GPU and Triton (the fused kernel runs nowhere else); "
              "run it on a GPU machine", file=sys.stderr)
        raise SystemExit(2)
    setup_process()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    results = run(repeats=args.repeats, calls=args.calls, warmup=args.warmup, dtype=dtype)
    print(f"GPSA core, CUDA inference, {args.dtype} ({torch.cuda.get_device_name()})")
    for label, r in results.items():
        s = r["shape"]
        print(f"[{label}] batch {s['batch']}, {s['tokens']} tokens, {s['heads']} x {s['head_dim']}; "
              f"max |diff| {r['max_abs_diff']:.1e}")
        for name in r["gpu_us"]:
            print(f"  {name:<24} GPU {r['gpu_us'][name]:7.1f} us   host {r['host_us'][name]:6.1f} us per call")
        ratio = r["ratio_sdpa_path_over_kernel"]
        print(f"  SDPA + P @ V / fused kernel: GPU {ratio['gpu']:.2f}x, host {ratio['host']:.2f}x")
    path = write_result("gpsa_cuda_core", {"config": vars(args), "shapes": results}, device="cuda")
    print(f"-> {path}")


if __name__ == "__main__":
    main()

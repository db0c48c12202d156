"""Attention layers of the locality families vs plain attention, forward + backward, side by side.

    python -m benchmarks.attention_blocks            # batch 256, 49 and 64 tokens, dim 96, 4 heads, CPU
    python -m benchmarks.attention_blocks --batch 64 --repeats 10
    python -m benchmarks.attention_blocks --device cuda --precisions fp32 bf16   # bf16: autocast, as AMP trains

Layers (all dim 96, 4 heads, the width of the *_micro models):
  plain      the families' plain attention (`MHSA`): fused scaled_dot_product_attention, or on a CPU
             with bf16 GEMMs under bf16 autocast, or in float32 on the float32 kernel, the explicit
             core (`kernels.plain_attention_on_explicit_core`)
  plain_fused  (where plain runs on the explicit core) the same layer on torch's fused kernel
             (the `explicit_plain_attention` backend off)
  gmm_K      Gaussian Mixture Mask attention with K kernels per head: on a CPU in float32, or under
             bf16 autocast with bf16 hardware, on that dtype's kernel (`masked_attention`);
             elsewhere explicit scores, mask, softmax
  gmm_K3_ops (where gmm runs on the kernel) gmm_K3 on its torch ops (the `libraries` backend off)
  refiner_r  Refiner attention with expansion ratio r, 3x3 kernel (plus a class token, as in the model):
             on a CPU with the float32 kernel, its maps refined there where `Refiner.choose_path` takes
             it (in float32 r <= 2 here; under bf16 autocast, forward + backward, r = 1)
  refiner_r2_ops (where the refiner runs on the kernel) refiner_r2 on its torch ops (the `libraries` backend off)
  gpsa       ConViT's GPSA, for reference
Each is timed alternately with the others after a warm-up (so load drifts hit all alike), each
round in its own seeded order (`_env.shuffled_rounds`: none always follows the same other); the
median of each and its ratio to plain are printed and written to benchmarks/results/, with the
kernels' gains (`kernel_gain`: the *_ops layer's time over the same layer's on the kernel).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from benchmarks._env import add_malloc_option, autocast, parse_and_set_up, shuffled_rounds, sync, write_result
from trainers import kernels
from trainers.models.ls_convit import GPSA, MHSA
from trainers.models.ls_gmm import GMMAttention
from trainers.models.ls_refiner import RefinedAttention


_ON_TORCH_OPS = {"gmm_K3_ops": "gmm_K3", "refiner_r2_ops": "refiner_r2"}  # contender -> the layer it runs off the kernel


def _layers(dim: int, heads: int, tokens: int, plain_fused: bool, gmm_ops: bool,
            refiner_ops: bool) -> dict[str, tuple[torch.nn.Module, int]]:
    """name -> (layer, extra prefix tokens it expects)."""
    side = math.isqrt(tokens)
    grid = (side, side)
    layers: dict[str, tuple[torch.nn.Module, int]] = {"plain": (MHSA(dim, num_heads=heads), 0)}
    if plain_fused:
        layers["plain_fused"] = (MHSA(dim, num_heads=heads), 0)
    for k in (1, 3, 5):
        layers[f"gmm_K{k}"] = (GMMAttention(dim, num_heads=heads, num_kernels=k, grid_size=grid), 0)
    if gmm_ops:
        layers["gmm_K3_ops"] = (GMMAttention(dim, num_heads=heads, num_kernels=3, grid_size=grid), 0)
    for r in (1, 2, 4, 6):
        layers[f"refiner_r{r}"] = (RefinedAttention(dim, num_heads=heads, grid_size=grid, ratio=r, kernel_size=3), 1)
    if refiner_ops:
        layers["refiner_r2_ops"] = (RefinedAttention(dim, num_heads=heads, grid_size=grid, ratio=2, kernel_size=3), 1)
    layers["gpsa"] = (GPSA(dim, num_heads=heads, grid_size=grid), 0)
    return layers


def run(*, batch: int, tokens: int, dim: int, heads: int, repeats: int, warmup: int, device: str = "cpu",
        bf16: bool = False) -> dict:
    dev = torch.device(device)
    torch.manual_seed(0)
    # where the two differ: MHSA on the explicit core (its choice for a qkv of this shape and dtype)
    probe = torch.zeros(3, 1, heads, tokens, dim // heads, dtype=torch.bfloat16 if bf16 else torch.float32, device=dev)
    plain_fused = kernels.plain_attention_on_explicit_core(probe)
    # and GMM on a kernel (float32, or bf16 under autocast on bf16 hardware)
    gmm_ops = kernels.masked_attention_usable(probe)
    # and the Refiner's maps on it (float32: r 2 is on the kernel; under bf16 autocast only r 1 is, fwd+bwd)
    refiner_ops = not bf16 and dev.type == "cpu" and kernels.cpu_library_available(torch.float32, tokens + 1)
    layers = {name: (layer.to(dev), extra)
              for name, (layer, extra) in _layers(dim, heads, tokens, plain_fused, gmm_ops, refiner_ops).items()}
    inputs = {name: torch.randn(batch, tokens + extra, dim, device=dev, requires_grad=True)
              for name, (_, extra) in layers.items()}

    def step(name: str) -> float:
        layer, x = layers[name][0], inputs[name]
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with kernels.backends(explicit_plain_attention=name != "plain_fused", libraries=name not in _ON_TORCH_OPS):
            sync(dev)
            start = time.perf_counter()
            with autocast(dev, "bf16" if bf16 else "fp32"):
                y = layer(x)
            y.float().sum().backward()
            sync(dev)
            return time.perf_counter() - start

    for _ in range(warmup):
        for name in layers:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in layers}
    for round_ in shuffled_rounds(list(layers), repeats):
        for name in round_:
            times[name].append(step(name))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "config": dict(batch=batch, tokens=tokens, dim=dim, heads=heads, repeats=repeats, warmup=warmup,
                       device=str(dev), what="one attention layer, forward + backward",
                       autocast="bfloat16" if bf16 else None),
        "median_s": median,
        "ratio_to_plain": {name: m / median["plain"] for name, m in median.items()},
        "kernel_gain": {layer: median[ops] / median[layer] for ops, layer in _ON_TORCH_OPS.items() if ops in median},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[49, 64], help="square numbers")
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                        help="bf16: under torch.autocast(bfloat16), fp32 weights and input (default: fp32)")
    add_malloc_option(parser)
    args = parse_and_set_up(parser, argv)
    results: dict = {}
    for precision in dict.fromkeys(args.precisions):
        key = "by_tokens" if precision == "fp32" else f"by_tokens_{precision}"
        results[key] = {}
        for tokens in args.tokens:
            if math.isqrt(tokens) ** 2 != tokens:
                parser.error(f"--tokens {tokens}: not a square patch grid")
            result = run(batch=args.batch, tokens=tokens, dim=args.dim, heads=args.heads, repeats=args.repeats,
                         warmup=args.warmup, device=args.device, bf16=precision == "bf16")
            results[key][str(tokens)] = result
            print(f"[{args.device} {precision}] batch={args.batch} tokens={tokens} dim={args.dim} "
                  f"heads={args.heads} threads={torch.get_num_threads()}")
            for name, seconds in result["median_s"].items():
                print(f"  {name:<14} {seconds * 1e3:8.2f} ms   {result['ratio_to_plain'][name]:5.2f}x plain")
            for layer, gain in result["kernel_gain"].items():
                print(f"  kernel gain, {layer}: {gain:.2f}x")
    path = write_result("attention_blocks", results, device=args.device)
    print(f"-> {path}")


if __name__ == "__main__":
    main()

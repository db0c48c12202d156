"""Transformed CNNs at the conversion: how far the logits move, and what the conversion costs.

    python -m benchmarks.tcnn_conversion                  # ls_tcnn_resnet10_micro_s at 28 px, resnet18 at 64 px
    python -m benchmarks.tcnn_conversion --repeats 20

For each network (BatchNorm statistics randomised, as after training; timm zero-inits each
block's last BN, which would hide the converted convs):
  * the logits' relative error ||T-CNN - CNN|| / ||CNN|| on random inputs right after the
    conversion, for initial alpha = lambda in {1, 5, 20} (the paper's init is 1, 1);
  * inference throughput (images/s) of the CNN and of its converted model, timed alternately
    (so load drifts hit both alike), and their ratio; both in the memory format a trial runs them
    in (channels_last: `trainers/_memory_format.py`) and with freed memory kept, as in a trial.
Written to benchmarks/results/tcnn_conversion-<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import timm
import torch
from torch import nn

import trainers.models  # noqa: F401  (registers the families)
from benchmarks._env import parse_and_set_up, write_result
from trainers import place_model

NETWORKS = {  # name -> input shape (C, H, W)
    "ls_tcnn_resnet10_micro_s": (1, 28, 28),
    "ls_tcnn_resnet18": (3, 64, 64),
}
ALPHA_GATE = (1.0, 5.0, 20.0)


def trained_looking(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random BatchNorm affine parameters and running statistics, as after training, in eval mode:
    timm zero-inits each block's last BN, which would hide the converted convs from the logits."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data = torch.rand(m.weight.shape, generator=gen) + 0.5
            m.bias.data = torch.randn(m.bias.shape, generator=gen) * 0.1
            m.running_mean = torch.randn(m.running_mean.shape, generator=gen) * 0.1
            m.running_var = torch.rand(m.running_var.shape, generator=gen) + 0.5
    return model.eval()


@torch.inference_mode()
def logit_errors(name: str, shape: tuple[int, int, int], batch: int = 16) -> dict[str, float]:
    out = {}
    for value in ALPHA_GATE:
        torch.manual_seed(0)
        model = trained_looking(timm.create_model(name, reparam_alpha=value, reparam_gate=value))
        x = torch.randn(batch, *shape)
        ref = model(x)
        model.reparametrise()
        out[f"alpha={value:g},gate={value:g}"] = float((model(x) - ref).norm() / ref.norm())
    return out


@torch.inference_mode()
def throughputs(name: str, shape: tuple[int, int, int], *, batch: int, repeats: int, warmup: int) -> dict[str, float]:
    cnn = trained_looking(timm.create_model(name))
    tcnn = copy.deepcopy(cnn)
    tcnn.reparametrise()
    cpu = torch.device("cpu")
    channels_last = place_model(cnn, cpu)  # as train_trial places it, before and after the conversion
    place_model(tcnn, cpu)
    models = {"cnn": cnn, "tcnn": tcnn}
    x = torch.randn(batch, *shape).contiguous(memory_format=torch.channels_last if channels_last
                                              else torch.contiguous_format)
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(warmup + repeats):
        for key, model in models.items():
            start = time.perf_counter()
            model(x)
            if i >= warmup:
                times[key].append(time.perf_counter() - start)
    result = {f"{k}_images_per_s": batch / statistics.median(v) for k, v in times.items()}
    result["tcnn_over_cnn"] = result["tcnn_images_per_s"] / result["cnn_images_per_s"]
    result["channels_last"] = channels_last
    result["cnn_params"] = sum(p.numel() for p in cnn.parameters())
    result["tcnn_params"] = sum(p.numel() for p in tcnn.parameters())
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parse_and_set_up(parser, argv)
    results = {}
    for name, shape in NETWORKS.items():
        batch = args.batch if shape[1] <= 32 else max(1, args.batch // 8)  # 64 px: 8x the work per image
        errors = logit_errors(name, shape)
        speed = throughputs(name, shape, batch=batch, repeats=args.repeats, warmup=args.warmup)
        results[name] = {"input": list(shape), "batch": batch, "logit_rel_error": errors, **speed}
        print(f"{name} at {shape[1]} px, batch {batch}:")
        print("  logits' relative error at the conversion: "
              + ", ".join(f"{k}: {v:.2e}" for k, v in errors.items()))
        print(f"  throughput: CNN {speed['cnn_images_per_s']:,.0f} img/s, T-CNN {speed['tcnn_images_per_s']:,.0f} img/s "
              f"({speed['tcnn_over_cnn']:.2f}x); params {speed['cnn_params']:,} -> {speed['tcnn_params']:,}")
    path = write_result("tcnn_conversion", {"repeats": args.repeats, "warmup": args.warmup, "networks": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

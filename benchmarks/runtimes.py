"""Each family of the locality zoo timed in both throughput runtimes, side by side in one process.

``spaces/locality_zoo.yaml``'s models at its smallest depth (3; the T-CNN as built), on
Fashion-MNIST's 28x28x1, batch 256: ``trainers.throughput.measure_model`` with ``runtime="eager"``
(torch's stock ops) and ``runtime="kernels"`` (this project's fused paths), alternating, each round
in its own seeded order, no cache. Prints each family's median images/s per runtime and kernels
over eager: how much of a front timed on the kernels would be implementation, not inductive bias.

    ./with-deps python -m benchmarks runtimes [--rounds 3]

Writes ``benchmarks/results/runtimes-<device>.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics

__all__ = ["main", "MODELS"]

# the zoo's entries (spaces/locality_zoo.yaml) at depth 3
MODELS = {
    "convit": ("ls_convit_micro", {"depth": 3, "local_up_to_layer": 2}),
    "gmm": ("ls_gmm_micro", {"depth": 3}),
    "refiner": ("ls_refiner_micro", {"depth": 3, "refiner_blocks": 2}),
    "tcnn": ("ls_tcnn_resnet10_micro_s", {}),
    "vit (timm)": ("vit_tiny_patch16_224", {"depth": 3, "patch_size": 4, "embed_dim": 96, "num_heads": 4,
                                            "class_token": False, "global_pool": "avg"}),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks runtimes", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)

    import timm
    import torch

    import trainers.models  # noqa: F401  (registers the families with timm)
    from benchmarks._env import write_result
    from trainers.throughput import measure_model

    torch.manual_seed(0)
    models = {family: timm.create_model(name, img_size=28, in_chans=1, num_classes=10, **kwargs).eval()
              for family, (name, kwargs) in MODELS.items()}
    runs = [(family, runtime) for family in models for runtime in ("eager", "kernels")]
    timings: dict[str, dict[str, list[float]]] = {f: {"eager": [], "kernels": []} for f in models}
    for r in range(args.rounds):
        random.Random(r).shuffle(runs)
        for family, runtime in runs:
            record = measure_model(models[family], input_shape=(1, 28, 28), batch_size=args.batch_size, runtime=runtime)
            timings[family][runtime].append(record["throughput"])
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    summary = {}
    for family, t in timings.items():
        eager, kernels = statistics.median(t["eager"]), statistics.median(t["kernels"])
        summary[family] = {"model": MODELS[family][0], "eager": eager, "kernels": kernels, "kernels_over_eager": kernels / eager,
                           "eager_rounds": t["eager"], "kernels_rounds": t["kernels"]}
        print(f"{family:<11} eager {eager:>9,.0f} img/s  kernels {kernels:>9,.0f} img/s  kernels/eager {kernels / eager:.2f}x")
    path = write_result("runtimes", {"config": {"rounds": args.rounds, "batch_size": args.batch_size,
                                                "threads": torch.get_num_threads()}, "families": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

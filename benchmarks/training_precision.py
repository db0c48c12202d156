"""Training precision: a whole trial in fp32 vs bf16 autocast (`train.precision`), time and accuracy.

    python -m benchmarks.training_precision              # the main job's trial: ls_convit_micro, 20% of Fashion-MNIST, 2 epochs
    python -m benchmarks.training_precision --epochs 4 --rounds 1 --model-arg local_up_to_layer=0

Each trial runs `trainers.train.train_trial` as a search does (the main job's training settings:
batch 64, lr 2e-3, warm-up 0.3 epochs, no augmentation), once per precision per round, in the
order fp32, bf16, bf16, fp32, ... (ABBA, so a drift in machine load hits both alike). A warm-up
trial of one epoch goes first, so FFCV's compilation and the throughput measurement are not
charged to either. Reports the median training seconds per epoch (the steps alone, no
validation) and per trial, their ratio fp32 / bf16 (> 1: bf16 is faster) and each precision's
validation accuracy after every epoch (same seed, same batches: the difference is the precision).

bf16 on a CPU pays off only with bf16 hardware (AMX, or AVX512-BF16 dot products); without it
oneDNN emulates bf16, slower than fp32, which is why `train.precision: auto` (and
`throughput.precision: auto`) is bf16 only on CPUs with it (`trainers.precision`).
Writes benchmarks/results/training_precision-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks._env import parse_and_set_up, write_result

# spaces/convit_locality.yaml's training settings, its lr at the middle of its range
MAIN_JOB_TRAIN = dict(batch_size=64, lr=2e-3, weight_decay=0.05, warmup_epochs=0.3, label_smoothing=0.1, pad_crop=0)


def _parse_arg(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if not key or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: write KEY=VALUE, e.g. local_up_to_layer=0")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def _trial(cfg) -> dict:
    from trainers.train import train_trial

    reports: list[dict] = []
    start = time.perf_counter()
    outcome = train_trial(cfg, on_epoch=lambda metrics, get_state: reports.append(metrics))
    return {"wall_s": time.perf_counter() - start, "train_s": [r["train_time_s"] for r in reports],
            "val_acc": [r["val_acc"] for r in reports], "train_loss": [r["train_loss"] for r in reports],
            "best_val_acc": outcome.best_val_acc}


def run(*, model: str, model_args: dict, epochs: int, rounds: int, train_fraction: float) -> dict:
    import dataclasses

    from search.results.location import default_cache_dir
    from trainers.config import ThroughputSettings, TrainSettings, TrialConfig
    from trainers.data import DatasetRequest, prepare_dataset

    data = prepare_dataset(DatasetRequest(name="fashion_mnist", train_fraction=train_fraction, val_fraction=0.1),
                           cache_dir=default_cache_dir())
    with tempfile.TemporaryDirectory(prefix="ls-bench-prec-") as cache:
        def config(precision: str, epochs: int) -> TrialConfig:
            return TrialConfig(model=model, model_args=model_args, data=data, epochs=epochs,
                               train=TrainSettings(**MAIN_JOB_TRAIN, precision=precision),
                               throughput=ThroughputSettings(), seed=0, device="cpu", throughput_cache_dir=cache)

        _trial(config("fp32", 1))  # warm-up: FFCV compiles, the throughput is measured and cached
        trials: dict[str, list[dict]] = {"fp32": [], "bf16": []}
        for i in range(rounds):
            order = ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32")
            for precision in order:
                trials[precision].append(_trial(config(precision, epochs)))
        settings = dataclasses.asdict(config("fp32", epochs).train)
    per_epoch = {p: statistics.median(s for t in ts for s in t["train_s"]) for p, ts in trials.items()}
    per_trial = {p: statistics.median(t["wall_s"] for t in ts) for p, ts in trials.items()}
    return {
        "config": {"model": model, "model_args": model_args, "dataset": data.name,
                   "train_images": data.counts["train"], "val_images": data.counts["val"], "epochs": epochs,
                   "rounds": rounds, "train": {k: v for k, v in settings.items() if k != "precision"}},
        "trials": trials,
        "train_s_per_epoch_median": per_epoch,
        "trial_wall_s_median": per_trial,
        "ratio_fp32_over_bf16_train_per_epoch": per_epoch["fp32"] / per_epoch["bf16"],
        "ratio_fp32_over_bf16_trial_wall": per_trial["fp32"] / per_trial["bf16"],
        # same seed and batches, so round by round the two differ by the precision alone
        "final_val_acc": {p: [t["val_acc"][-1] for t in ts] for p, ts in trials.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ls_convit_micro")
    parser.add_argument("--model-arg", action="append", type=_parse_arg, default=[], metavar="KEY=VALUE")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="trials per precision (ABBA order)")
    parser.add_argument("--train-fraction", type=float, default=0.2)
    args = parse_and_set_up(parser, argv)
    result = run(model=args.model, model_args=dict(args.model_arg), epochs=args.epochs, rounds=args.rounds,
                 train_fraction=args.train_fraction)
    c = result["config"]
    print(f"{c['model']} {c['model_args'] or ''}: {c['train_images']} train / {c['val_images']} val images, "
          f"{c['epochs']} epochs, batch {c['train']['batch_size']}, {c['rounds']} trial(s) per precision")
    for precision in ("fp32", "bf16"):
        accs = ", ".join(" -> ".join(f"{a:.4f}" for a in t["val_acc"]) for t in result["trials"][precision])
        print(f"  {precision}: {result['train_s_per_epoch_median'][precision]:6.1f} s training per epoch, "
              f"{result['trial_wall_s_median'][precision]:6.1f} s per trial; val_acc by epoch: {accs}")
    print(f"  fp32 / bf16: {result['ratio_fp32_over_bf16_train_per_epoch']:.2f}x per training epoch, "
          f"{result['ratio_fp32_over_bf16_trial_wall']:.2f}x per trial")
    print(f"-> {write_result('training_precision', result)}")


if __name__ == "__main__":
    main()

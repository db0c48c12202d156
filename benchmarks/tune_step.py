"""Training under Ray Tune: the same trial's training speed in a real Tune trial vs in a main thread.

    python -m benchmarks.tune_step                    # ls_convit_micro, batch 64, as the main job trains
    python -m benchmarks.tune_step --rounds 6 --epochs 3

Ray Tune runs a function trainable in a thread of its own, in a worker process beside Ray's own
threads, while `trial_overhead` times trials in its own main thread. This benchmark runs the same
trial (`trainers.train.train_trial`: the main job's model, data and batch size, --epochs epochs on
--train-fraction of Fashion-MNIST's training images) both ways, each round in fresh processes so
nothing is warm from the other contender: `main` calls it in the process's main thread,
`tune_trial` inside a real Tune trial on a local Ray of its own, started as `search run` starts one
(the trial given every CPU, PYTHONPATH through the runtime env). The contenders alternate
(ABBA...) over --rounds rounds; what each reports is its trial's training images/s, every epoch's
(`train_images_per_s`, the epochs table's column: training steps only, no validation or
measurement), and the ratio is the Tune trial's median over the main thread's. The throughput
measurement after a trial's first epoch is cached across the rounds, so only the first trial
waits for it. Needs Fashion-MNIST (as the main job).

Writes benchmarks/results/tune_step-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks._env import init_local_ray, parse_and_set_up, project_pythonpath, write_result
from trainers import PROJECT_ROOT

CONTENDERS = ("main", "tune_trial")


def _train_images_per_s(settings: dict) -> list[float]:
    """Every epoch's training images/s of the benchmark's trial, trained in the calling thread."""
    import dataclasses

    from benchmarks.trial_overhead import config
    from search.results.location import default_cache_dir
    from trainers.data import DatasetRequest, prepare_dataset
    from trainers.train import train_trial

    data = prepare_dataset(DatasetRequest(name="fashion_mnist", train_fraction=settings["train_fraction"]),
                           cache_dir=default_cache_dir())
    cfg = config(data, epochs=settings["epochs"], cache_dir=settings["cache_dir"], model=settings["model"],
                 batch_size=settings["batch_size"])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pad_crop=0))  # as spaces/convit_locality.yaml
    outcome = train_trial(cfg)
    return [epoch["train_images_per_s"] for epoch in outcome.history]


def _tune_trainable(config: dict) -> None:
    from ray import tune

    tune.report({"train_images_per_s": _train_images_per_s(config)})


def _child(where: str, settings: dict) -> None:
    """One contender's round, in this (fresh) process: print its epochs' training images/s."""
    if where == "main":
        rates = _train_images_per_s(settings)
    else:
        import ray
        from ray import tune

        init_local_ray(num_cpus=os.cpu_count())
        try:
            trainable = tune.with_resources(_tune_trainable, {"cpu": os.cpu_count()})
            with tempfile.TemporaryDirectory(prefix="ls-bench-tune-step-") as storage:
                results = tune.Tuner(trainable, param_space=settings,
                                     run_config=tune.RunConfig(storage_path=storage, verbose=0)).fit()
                rates = results[0].metrics["train_images_per_s"]
        finally:
            ray.shutdown()
    print(json.dumps({"train_images_per_s": rates}))


def _round(contender: str, settings: dict) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own, never a running one
    env["PYTHONPATH"] = project_pythonpath()
    command = [sys.executable, "-m", "benchmarks.tune_step", "--child", contender, "--settings", json.dumps(settings)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["train_images_per_s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ls_convit_micro")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-fraction", type=float, default=0.1, help="of Fashion-MNIST's 60,000 training images")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parse_and_set_up(parser, argv)
    if args.child:
        _child(args.child, json.loads(args.settings))
        return

    from search.results.location import default_cache_dir
    from trainers.data import DatasetRequest, prepare_dataset
    from trainers.errors import ConfigError

    try:  # here, once: a missing dataset is one line, and no round pays for converting it
        prepare_dataset(DatasetRequest(name="fashion_mnist", train_fraction=args.train_fraction),
                        cache_dir=default_cache_dir())
    except ConfigError as error:
        parser.error(str(error))
    rounds: dict[str, list[list[float]]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="ls-bench-tput-") as cache:
        settings = {"model": args.model, "batch_size": args.batch_size, "epochs": args.epochs,
                    "train_fraction": args.train_fraction, "cache_dir": cache}
        for index in range(args.rounds):
            order = CONTENDERS if index % 2 == 0 else tuple(reversed(CONTENDERS))
            for name in order:
                rounds[name].append(_round(name, settings))
            print(f"round {index + 1}: " + ", ".join(
                f"{n} {' '.join(f'{r:.0f}' for r in rounds[n][-1])} img/s" for n in CONTENDERS), flush=True)
    images_per_s = {name: statistics.median(r for epochs in per_round for r in epochs)
                    for name, per_round in rounds.items()}
    ratio = images_per_s["tune_trial"] / images_per_s["main"]
    print(f"{args.model}, batch {args.batch_size}, {args.rounds} rounds of {args.epochs} epoch(s) on "
          f"{args.train_fraction:.0%} of the training images")
    for name in CONTENDERS:
        print(f"  {name:<12} {images_per_s[name]:7.0f} training img/s")
    print(f"  a Tune trial trains at {ratio:.3f}x the rate of the same trial in a main thread")
    path = write_result("tune_step", {
        "config": {key: value for key, value in settings.items() if key != "cache_dir"} | {"rounds": args.rounds},
        "rounds_train_images_per_s": rounds, "median_train_images_per_s": images_per_s,
        "tune_trial_over_main": ratio,
    })
    print(f"-> {path}")


if __name__ == "__main__":
    main()

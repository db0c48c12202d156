"""The plain, typed records a trial runs from. ``search`` builds them; trainers know nothing of Ray."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # only a type here; importing the data package pulls in FFCV and numba
    from trainers.data import PreparedDataset

__all__ = ["SettingError", "TrainSettings", "ThroughputSettings", "TrialConfig", "TRAIN_KEYS", "PRECISIONS", "COMPILE_MODES", "Constraint", "CONSTRAINT_METRICS"]


class SettingError(ValueError):
    """A setting is out of range; ``key`` names it (relative to its record)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


Precision = Literal["auto", "fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
# num_workers: auto's bounds. 2 was the fixed default before auto; 8 is the most threads
# benchmarks/trial_overhead.py --num-workers has timed
_MIN_AUTO_LOADER_THREADS, _MAX_AUTO_LOADER_THREADS = 2, 8
Runtime = Literal["eager", "kernels"]
RUNTIMES: tuple[str, ...] = typing.get_args(Runtime)
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES: tuple[str, ...] = typing.get_args(CompileMode)  # torch.compile's modes
_COMPILE_MODES_WITH_CUDA_GRAPHS = ("reduce-overhead", "max-autotune")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Optimisation and input settings; in a spec any of them may be searched instead."""

    batch_size: int = 128
    lr: float = 1e-3  # peak learning rate of AdamW, reached after warm-up
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    min_lr: float = 1e-5  # the cosine decay ends here
    label_smoothing: float = 0.1
    grad_clip: float | None = None  # max global grad norm; None: no clipping
    # FFCV's loader threads. auto: the CPUs the trial was given (in a search Ray's resources.cpus,
    # else the CPUs the process may run on), at least 2 and at most 8, the most measured: a fast
    # GPU's trial is fed faster by more threads (benchmarks/trial_overhead.py --num-workers
    # measures it). See `loader_threads`
    num_workers: int | Literal["auto"] = "auto"
    pad_crop: int = 2  # random pad-and-crop augmentation, pixels
    flip: bool | None = None  # horizontal flips; None: what the dataset catalog says
    # autocast dtype of training and validation. auto: AMP on CUDA (bf16 where the GPU has it,
    # else fp16 with loss scaling); on a CPU bf16 where it has bf16 hardware, AMX or AVX512-BF16,
    # else fp32 (emulated bf16 is far slower); see trainers.precision, and
    # benchmarks/training_precision.py for the time and accuracy of each
    precision: Precision = "auto"
    # run the training and validation batches through torch.compile (the same parameters;
    # throughput is still measured on the eager model): true (torch's default mode) or one of
    # torch.compile's modes. For GPUs, where a small model's step is bound by launching kernels
    # (benchmarks/trial_overhead.py --compile [MODE] measures the gain). On a CPU no faster: the
    # compiled step runs torch's attention, not this project's kernels
    compile: bool | CompileMode = False
    # GPU: capture the whole training step (forward, backward, clipping, AdamW) as one CUDA graph
    # and replay it per batch, so the host launches one graph instead of a few hundred kernels and
    # autograd's and the optimizer's Python (trainers/_cuda_graph.py). With compile: true the
    # captured step runs the compiled kernels. A step that cannot be captured (a host sync), or
    # fp16's loss scaling, trains eagerly with a warning. Ignored on the CPU
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise SettingError("batch_size", f"must be at least 1, got {self.batch_size}")
        if self.lr <= 0:
            raise SettingError("lr", f"must be positive, got {self.lr}")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise SettingError("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.weight_decay < 0:
            raise SettingError("weight_decay", f"must be >= 0, got {self.weight_decay}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise SettingError("label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")
        if self.warmup_epochs < 0:
            raise SettingError("warmup_epochs", f"must be >= 0, got {self.warmup_epochs}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise SettingError("grad_clip", f"must be positive (or leave it out), got {self.grad_clip}")
        if self.num_workers != "auto" and (isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int)
                                           or self.num_workers < 1):
            raise SettingError("num_workers", f"must be a whole number of threads, at least 1, or auto; got {self.num_workers!r}")
        if self.pad_crop < 0:
            raise SettingError("pad_crop", f"must be >= 0, got {self.pad_crop}")
        if not isinstance(self.compile, bool) and not (isinstance(self.compile, str) and self.compile in COMPILE_MODES):
            raise SettingError("compile", f"must be true, false or a torch.compile mode ({', '.join(COMPILE_MODES)}), "
                                          f"got {self.compile!r}")
        if not isinstance(self.cuda_graph, bool):
            raise SettingError("cuda_graph", f"must be true or false, got {self.cuda_graph!r}")
        if self.cuda_graph and self.compile in _COMPILE_MODES_WITH_CUDA_GRAPHS:
            raise SettingError("cuda_graph", f"captures the whole step, which cannot hold compile: {self.compile}'s own "
                                             "CUDA graphs; use compile: true (or max-autotune-no-cudagraphs), or "
                                             "cuda_graph: false")
        if self.precision not in PRECISIONS:
            raise SettingError("precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    @property
    def loader_threads(self) -> int:
        """num_workers as a number of threads: auto resolved for this process (see the field)."""
        if self.num_workers != "auto":
            return self.num_workers
        from trainers._cpu import cpus_given

        return min(max(cpus_given(), _MIN_AUTO_LOADER_THREADS), _MAX_AUTO_LOADER_THREADS)

    @property
    def compile_mode(self) -> str | None:
        """torch.compile's mode for the batches, or None to run them eagerly."""
        if self.compile is False:
            return None
        return "default" if self.compile is True else self.compile


TRAIN_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainSettings))


@dataclasses.dataclass(frozen=True)
class ThroughputSettings:
    batch_size: int = 256
    warmup: int = 3
    repeats: int = 10
    precision: Precision = "auto"  # auto: as train.precision's (trainers.precision), bf16 where the hardware has it
    # on a GPU, time the forward as replays of one captured CUDA graph: the GPU's cost of the
    # architecture rather than the host's speed at enqueueing its kernels, which bounds small
    # models there (trainers/_cuda_graph.py); false: eagerly. Ignored on the CPU
    cuda_graph: bool = True
    # what the forward runs on while timed: "eager", torch's stock ops (what timm's benchmark.py
    # times; any model, this project's or timm's, on the same footing), or "kernels", this
    # project's fused CPU/GPU paths (trainers.kernels). Every trial of a study is timed in one,
    # and studies timed in different runtimes are not compared (docs/intervals.md#runtimes)
    runtime: Runtime = "eager"
    # the relative noise between two measurements of one architecture (another process, another
    # moment) that one measurement's batches cannot show: each throughput interval is at least
    # this wide on each side (benchmarks/throughput_noise.py measures it on a machine)
    noise_floor: float = 0.15

    def __post_init__(self) -> None:
        for key in ("batch_size", "repeats"):
            if getattr(self, key) < 1:
                raise SettingError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.warmup < 0:
            raise SettingError("warmup", f"must be >= 0, got {self.warmup}")
        if not 0.0 <= self.noise_floor < 1.0:
            raise SettingError("noise_floor", f"must be in [0, 1) (a fraction of the value), got {self.noise_floor}")


# What a trial knows about its architecture before any training: constraints may use these.
CONSTRAINT_METRICS = ("throughput", "params", "flops")
_CONSTRAINT = re.compile(r"^\s*([a-z_]+)\s*(>=|<=|>|<)\s*([-+0-9.eE_]+)\s*$")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """``throughput >= 5000``: a bound on what is measured before training. A trial that breaks
    one is REJECTED without training."""

    metric: str
    op: Literal[">=", "<=", ">", "<"]
    bound: float

    @classmethod
    def parse(cls, text: str) -> "Constraint":
        match = _CONSTRAINT.match(text) if isinstance(text, str) else None
        if match is None:
            raise SettingError("", f"{text!r} is not a constraint; write METRIC OP NUMBER, e.g. 'throughput >= 5000' "
                                   f"(METRIC one of {', '.join(CONSTRAINT_METRICS)}; OP one of >=, <=, >, <)")
        metric, op, number = match.groups()
        if metric not in CONSTRAINT_METRICS:
            raise SettingError("", f"{metric!r} is not known before training; constrain one of {', '.join(CONSTRAINT_METRICS)}")
        try:
            bound = float(number)
        except ValueError:
            raise SettingError("", f"{number!r} in {text!r} is not a number") from None
        if not math.isfinite(bound):
            raise SettingError("", f"the bound in {text!r} must be finite")
        return cls(metric, op, bound)  # type: ignore[arg-type]

    def violation(self, value: float) -> float:
        """0 when ``value`` satisfies the constraint, else how far off it is, relative to the bound."""
        ok = {">=": value >= self.bound, "<=": value <= self.bound, ">": value > self.bound, "<": value < self.bound}[self.op]
        if ok:
            return 0.0
        return max(abs(value - self.bound) / max(abs(self.bound), 1e-12), 1e-12)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.bound:g}"


@dataclasses.dataclass(frozen=True)
class TrialConfig:
    """Everything one trial needs, with no reference to the search that made it."""

    model: str  # a timm model name (this project's families are registered with timm)
    model_args: dict[str, Any]  # constructor keyword arguments: fixed ones and searched ones
    data: PreparedDataset
    epochs: int
    train: TrainSettings = dataclasses.field(default_factory=TrainSettings)
    throughput: ThroughputSettings = dataclasses.field(default_factory=ThroughputSettings)
    patience: int | None = None  # stop after this many epochs without a better val_acc
    seed: int = 0
    device: str = "auto"  # auto: cuda when available, else cpu
    constraints: tuple[Constraint, ...] = ()  # broken by the measured architecture: rejected untrained
    throughput_cache_dir: str | None = None  # measurements reused per architecture (None: measure every trial)

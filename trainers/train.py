"""What one trial runs: build the model, measure it, train it, report once per epoch.

Read top to bottom: ``train_trial`` is the whole loop. It knows nothing of Ray; the search
passes ``on_epoch`` (which calls ``tune.report`` with a checkpoint) and, on restore, ``resume``.

    model   = timm.create_model(name, num_classes, in_chans, img_size, **args)
    measure = params, FLOPs/image, inference images/s   (before training where the constraints
              need it, else after the first epoch); a config that breaks a constraint is rejected
    loaders = FFCV train (random pad-crop, flip) / val (plain)              (`trial_loaders`)
    optim   = AdamW (fused) over the model's parameter groups, lr_at(step): linear warm-up, cosine decay
    step    = lr, forward, loss, backward, [clip], AdamW, chosen once: eager, or on a GPU with
              train.cuda_graph one CUDA graph captured at the first batch and replayed after
              (`training_step`: what benchmarks/trial_overhead.py times on its own)
    epochs  = train -> validate -> on_epoch(metrics, state) -> stop on max_epochs or patience;
              the best validation epoch's weights go with every state (``selected``): the model
              a held-out test scores (`trainers.heldout`)

A model that changes architecture mid-training (`trainers.hooks.ConvertsDuringTraining`, the
T-CNN) is converted before the epoch it names, re-measured, and given a fresh AdamW with its own
warm-up and cosine decay over the remaining epochs (``reparam_optimizer='fresh'``) or the same
optimizer state and schedule (``'keep'``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
import warnings
from typing import Any, Callable, ContextManager, Iterable, Iterator

import timm
import torch
from torch import nn

import trainers.models  # noqa: F401  (registers this project's model families with timm)
from trainers._cuda_graph import CaptureError, GraphedTrainStep, capture_train_step
from trainers._device_share import device_share
from trainers._malloc import retain_freed_memory
from trainers._memory_format import place_model
from trainers.config import TrainSettings, TrialConfig
from trainers.data import make_loader
from trainers.hooks import ConvertsDuringTraining, HasParamGroups, ReportsMechanisms, mechanisms, param_groups
from trainers.precision import autocast_dtype, autocast_for, resolve_precision
from trainers.throughput import measure_model, with_noise_floor

# what trainers' API (trainers/__init__.py) takes from here, and the types of its results and errors
__all__ = ["train_trial", "TrialOutcome", "NonFiniteLossError", "build_model", "evaluate", "pick_device",
           "trial_loaders", "eval_loader", "training_step", "TrainingStep"]

EpochCallback = Callable[[dict[str, Any], Callable[[], dict[str, Any]]], None]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the trial fails with this reason."""


@dataclasses.dataclass
class TrialOutcome:
    history: list[dict[str, Any]]  # one metrics dict per epoch run
    best_val_acc: float
    epochs_run: int
    stop_reason: str  # max_epochs | patience | constraint (rejected before training)
    measurement: dict[str, Any]  # params, flops, throughput and how it was measured


def lr_at(step: int, *, total_steps: int, warmup_steps: int, peak_lr: float, min_lr: float) -> float:
    """Linear warm-up from 0 to ``peak_lr``, then cosine decay to ``min_lr`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_model(cfg: TrialConfig) -> nn.Module:
    """timm model sized for the dataset; ``img_size`` is passed only to models that take it."""
    data = cfg.data
    args = {"num_classes": data.num_classes, "in_chans": data.channels, "img_size": data.image_size}
    args.update(cfg.model_args)
    try:
        return timm.create_model(cfg.model, **args)
    except TypeError as exc:
        if "img_size" not in str(exc) or "img_size" in cfg.model_args:
            raise
        del args["img_size"]  # e.g. ResNets are size-agnostic
        return timm.create_model(cfg.model, **args)


_references: dict[tuple, nn.Module | None] = {}  # per process (Ray reuses its actors): built once, not per trial


def _reference_model(cfg: TrialConfig, device: torch.device) -> nn.Module | None:
    """What a CPU measurement times the model beside (see trainers/throughput.py): the model as
    named, with default arguments; None where those do not build for this dataset (the model is
    then timed on its own)."""
    data = cfg.data
    key = (cfg.model, data.num_classes, data.channels, data.image_size, str(device))
    if key in _references:
        return _references[key]
    try:
        reference = build_model(dataclasses.replace(cfg, model_args={}))
        place_model(reference, device)
    except Exception as exc:  # noqa: BLE001  (any model's constructor: a plain measurement is the fallback)
        warnings.warn(f"{cfg.model} with default arguments does not build here ({exc}); "
                      "its throughput is timed without a reference", stacklevel=2)
        reference = None
    _references[key] = reference
    return reference


def _param_groups_of(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trial's AdamW groups: the model's own (`trainers.hooks.HasParamGroups`, e.g. ConViT's
    gates with their own learning rate), else `trainers.hooks.param_groups`' rule with no weight
    decay on what the model lists in ``no_weight_decay()``."""
    if isinstance(model, HasParamGroups):
        return model.param_groups(weight_decay=weight_decay)
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    return param_groups(model, weight_decay, no_decay=lambda name, param: name in skip)


def adamw(groups: list[dict[str, Any]], *, lr: float, capturable: bool = False) -> torch.optim.AdamW:
    """The trial's optimizer: AdamW with torch's fused kernel (one pass over each tensor, on the CPU
    as on CUDA) rather than the default for CPU tensors, a loop of ~10 small ops per parameter
    tensor; the same update up to float rounding (benchmarks/trial_overhead.py times whole steps).
    ``capturable``: the step can be captured in a CUDA graph (`capture_step`)."""
    optimizer = torch.optim.AdamW(groups, lr=lr, fused=True, capturable=capturable)
    # torch's fused AdamW (CPU, torch 2.15) walks a parameter, its gradient and its moments as one
    # flat array each: a channels_last weight with an NCHW gradient or moment is updated element
    # against wrong element, silently. Autograd gives gradients their parameter's strides; moments
    # resumed from a checkpoint saved while the weight was NCHW have the old ones.
    optimizer.register_step_pre_hook(_align_gradients_to_params)  # a stride comparison per tensor where none differs
    optimizer.register_load_state_dict_post_hook(_align_moments_to_params)  # once, where it can happen
    return optimizer


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Each param group's lr: ``lr`` times the group's ``lr_scale``. A captured step's groups hold
    their lr as a CUDA tensor, which the graph reads: filled in place, no host sync."""
    for group in optimizer.param_groups:
        value = lr * group.get("lr_scale", 1.0)
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def graphs_steps(settings: TrainSettings, device: torch.device) -> bool:
    """Whether a trial captures its training step as a CUDA graph: train.cuda_graph on a GPU,
    unless it trains in fp16, whose loss scaling reads the gradients' finiteness on the host."""
    if not settings.cuda_graph or device.type != "cuda":
        return False
    if autocast_dtype(settings.precision, device) == torch.float16:
        warnings.warn("train.cuda_graph: fp16's loss scaling syncs with the host every step, so this trial trains "
                      "eagerly; use precision bf16 or fp32 to graph its steps", stacklevel=2)
        return False
    return True


def capture_step(*, model: nn.Module, runner: nn.Module, criterion: nn.Module, optimizer: torch.optim.Optimizer,
                 images: torch.Tensor, labels: torch.Tensor, settings: TrainSettings) -> GraphedTrainStep | None:
    """The training step captured for batches like ``images``/``labels`` (`capture_train_step`),
    or None, with a warning, where it cannot be: the trial then trains eagerly."""
    try:
        return capture_train_step(model=model, runner=runner, criterion=criterion, optimizer=optimizer,
                                  images=images, labels=labels, grad_clip=settings.grad_clip,
                                  autocast_dtype=autocast_dtype(settings.precision, images.device))
    except CaptureError as exc:
        warnings.warn(f"train.cuda_graph: {exc}; this trial trains eagerly", stacklevel=2)
        return None


def _layout_differs(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether a flat walk of `tensor` meets `param`'s elements in another order."""
    return not (tensor.is_contiguous() and param.is_contiguous()) and tensor.stride() != param.stride()


def _align_gradients_to_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and _layout_differs(param.grad, param):
                param.grad = torch.empty_like(param).copy_(param.grad)


def _align_moments_to_params(optimizer: torch.optim.Optimizer) -> None:
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == param.shape and _layout_differs(value, param):
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def runner_for_batches(model: nn.Module, settings: TrainSettings, device: torch.device) -> nn.Module:
    """The model, or its torch.compile wrapper in the mode train.compile names."""
    if settings.compile_mode is None:
        return model
    if device.type == "cpu":
        warnings.warn("train.compile on a CPU: compiled batches run torch's attention instead of this "
                      "project's CPU kernels, slower than eager (benchmarks/trial_overhead.py --compile "
                      "measures it); it is meant for GPUs", stacklevel=2)
    return torch.compile(model, mode=settings.compile_mode)


def _portable(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state_dict with a captured step's CUDA lr tensors as numbers, so that its
    checkpoint resumes on any device, graphed or not (state_dict's groups are copies)."""
    for group in optimizer_state["param_groups"]:
        if torch.is_tensor(group.get("lr")):
            group["lr"] = float(group["lr"])
    return optimizer_state


def _waited_for(batches: Iterable[Any], waited: list[float]) -> Iterator[Any]:
    """The items of `batches`, adding the seconds each took to arrive to waited[0]."""
    iterator = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        waited[0] += time.perf_counter() - start
        yield item


PROBE_IMAGES = 256  # the validation images a model's mechanisms are read on after each epoch (hooks)


@torch.inference_mode()
def evaluate(model: nn.Module, loader, *, autocast, probe: list | None = None) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over every image of ``loader``. An empty ``probe`` list gets a
    copy of the first `PROBE_IMAGES` images (the loader's order is fixed: the same ones each epoch)."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct = 0
    count = 0
    for images, labels in loader:  # images (B, C, H, W) float, labels (B,) int64
        if probe is not None and not probe:
            probe.append(images[:PROBE_IMAGES].float().clone())
        with autocast():
            logits = model(images)  # (B, num_classes)
        loss_sum += nn.functional.cross_entropy(logits.float(), labels, reduction="sum").double().cpu()
        correct += int((logits.argmax(dim=1) == labels).sum())
        count += labels.numel()
    model.train()
    return float(loss_sum) / max(count, 1), correct / max(count, 1)


def train_trial(
    cfg: TrialConfig,
    *,
    on_epoch: EpochCallback | None = None,
    resume: dict[str, Any] | None = None,
) -> TrialOutcome:
    """Train one configuration. ``on_epoch(metrics, get_state)`` is called after every epoch;
    ``get_state()`` returns what ``resume`` takes to continue after that epoch. Its tensors are
    the live ones: serialise them inside ``on_epoch`` (as the Tune adapter does).

    A configuration that breaks one of ``cfg.constraints`` is not trained: ``on_epoch`` gets one
    report with ``epoch`` 0, ``rejected`` (the reason) and ``get_state`` None."""
    settings = cfg.train
    device = pick_device(cfg.device)
    retain_freed_memory()  # no page faults for each step's activations (see trainers/_malloc.py)
    torch.manual_seed(cfg.seed)
    train_precision = resolve_precision(settings.precision, device)  # what auto became here

    # -- model, measured before training where something needs the number then ------------
    model = build_model(cfg)
    # T-CNN: a CNN recast as attention mid-training, after convert_at epochs; None: never converts
    convert_at = model.reparam_epoch_for(cfg.epochs) if isinstance(model, ConvertsDuringTraining) else None
    if resume is not None and resume.get("reparametrised"):
        model.reparametrise()  # checkpointed after the conversion: restore into the converted model
    channels_last = place_model(model, device)  # CUDA, or a CNN on the CPU: the model and its batches
    measure = functools.partial(_measure, cfg=cfg, device=device, channels_last=channels_last)
    if resume is not None:
        measurement = dict(resume["measurement"])
    else:
        measurement = measure(model) if _measured_before_training(cfg, model, convert_at) else None
        rejected = _reject_by_constraints(cfg, model, measurement, convert_at=convert_at, measure=measure,
                                          on_epoch=on_epoch)
        if rejected is not None:
            return rejected  # not trained: one report, epoch 0
    if convert_at == 0 and not model.is_reparametrised:
        measurement = _convert(model, epoch=0, before=measurement, device=device, measure=measure)  # the hybrid

    # -- data -------------------------------------------------------------------------------
    train_loader, val_loader = trial_loaders(cfg, device=device, channels_last=channels_last)
    steps_per_epoch = len(train_loader)

    # -- optimisation: the step chosen once, eager or graphed --------------------------------
    # the schedule counts from the conversion in a trial resumed after it (with 'fresh')
    first_step = _schedule_start(model, convert_at=convert_at, steps_per_epoch=steps_per_epoch)
    train_step = training_step(model, cfg, device, steps_per_epoch=steps_per_epoch, first_step=first_step)

    start_epoch, best_val_acc, best_val_loss, bad_epochs, history = 0, -1.0, math.inf, 0, []
    selected = None  # the weights of the best validation epoch: what a held-out test scores (trainers.heldout)
    if resume is not None:
        start_epoch, best_val_acc, best_val_loss, bad_epochs, history = _restore(
            resume, model=model, optimizer=train_step.optimizer, scaler=train_step.scaler)
        selected = resume.get("selected")
        if history and "stop_reason" in history[-1]:
            # Restored from the checkpoint of its last epoch (the driver died before the search
            # recorded the end): say the final result again, train nothing.
            if on_epoch is not None:
                on_epoch(dict(history[-1]), lambda: resume)
            return TrialOutcome(history=history, best_val_acc=best_val_acc, epochs_run=len(history),
                                stop_reason=history[-1]["stop_reason"], measurement=measurement)

    # -- epochs -----------------------------------------------------------------------------
    train_loader.next_epoch = start_epoch  # a resumed trial sees the batches it would have seen
    share = device_share(device)
    stop_reason = "max_epochs"
    for epoch in range(start_epoch, cfg.epochs):
        epoch_start = time.perf_counter()
        if epoch == convert_at and not model.is_reparametrised:
            measurement = _convert(model, epoch=epoch, before=measurement, device=device, measure=measure)
            # another model and optimizer: captured again, unless capturing failed before
            train_step = _step_after_conversion(train_step, cfg, device, convert_at=convert_at,
                                                steps_per_epoch=steps_per_epoch)
        # Shared with other trials on this device; a throughput measurement waits for us to step
        # aside (share.step()). Not held across the report: Tune may never resume this thread.
        with share.training():
            loss_sum, loader_wait = _train_epoch(train_step, train_loader, epoch=epoch,
                                                 steps_per_epoch=steps_per_epoch, share=share, device=device)
            train_time = time.perf_counter() - epoch_start
            # mean cross-entropy, accuracy
            probe: list = [] if isinstance(model, ReportsMechanisms) else None
            val_loss, val_acc = evaluate(train_step.runner, val_loader, autocast=train_step.autocast, probe=probe)
        epoch_time = time.perf_counter() - epoch_start
        if measurement is None:  # after the first epoch (see _measured_before_training), not holding the device
            measurement = measure(model)

        best_val_loss = min(best_val_loss, val_loss)
        if val_acc > best_val_acc:
            best_val_acc, bad_epochs = val_acc, 0
            selected = selected_weights(model, epoch=epoch + 1)
        else:
            bad_epochs += 1
        done = epoch + 1 == cfg.epochs
        if not done and cfg.patience is not None and bad_epochs >= cfg.patience:
            stop_reason, done = "patience", True
        metrics = {
            "epoch": epoch + 1,
            "train_loss": float(loss_sum) / max(steps_per_epoch, 1),
            "val_loss": val_loss,
            "val_acc": val_acc,
            "best_val_acc": best_val_acc,
            "best_val_loss": best_val_loss,
            "best_epoch": None if selected is None else selected["epoch"],  # None: a checkpoint from before it was kept
            "lr": train_step.lr,  # the last step's
            "epoch_time_s": epoch_time,
            "train_time_s": train_time,
            "train_images_per_s": steps_per_epoch * settings.batch_size / train_time,
            "train_loader_wait_s": loader_wait,
            "train_precision": train_precision,
            "val_images": cfg.data.counts["val"],  # what val_acc's binomial interval rests on
            "mechanisms": mechanisms(model, probe[0] if probe else None),  # hooks.ReportsMechanisms (None for other models)
            **measurement,
        }
        if convert_at is not None:
            metrics["converted"] = model.is_reparametrised  # this epoch trained the converted model
        if done:
            metrics["stop_reason"] = stop_reason
        history.append(metrics)
        if on_epoch is not None:
            on_epoch(metrics, functools.partial(
                _checkpoint, model=model, optimizer=train_step.optimizer, scaler=train_step.scaler, epoch=epoch + 1,
                best_val_acc=best_val_acc, best_val_loss=best_val_loss, bad_epochs=bad_epochs, history=history,
                measurement=measurement, selected=selected))
        if done:
            break

    return TrialOutcome(history=history, best_val_acc=best_val_acc, epochs_run=len(history), stop_reason=stop_reason,
                        measurement=measurement)


# -- the pieces of train_trial, in the order it uses them ----------------------------------------

def _measure(net: nn.Module, *, cfg: TrialConfig, device: torch.device, channels_last: bool) -> dict[str, Any]:
    """params, FLOPs and inference throughput of ``net`` (`measure_model`), with its family."""
    # The measurement draws random inputs; keep them out of the training's random stream.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        reference = _reference_model(cfg, device) if device.type == "cpu" else None
        record = measure_model(
            net,
            input_shape=(cfg.data.channels, cfg.data.image_size, cfg.data.image_size),
            batch_size=cfg.throughput.batch_size,
            warmup=cfg.throughput.warmup,
            repeats=cfg.throughput.repeats,
            precision=cfg.throughput.precision,
            channels_last=channels_last,
            cache_dir=cfg.throughput_cache_dir,
            reference=reference,
            cuda_graph=cfg.throughput.cuda_graph,
            runtime=cfg.throughput.runtime,
        )
    record = with_noise_floor(record, cfg.throughput.noise_floor)
    # this project's families say so; for a plain timm model, its name's first word (vit, deit, ...)
    return {"family": getattr(net, "family", None) or cfg.model.split("_")[0], **record}


def _measured_before_training(cfg: TrialConfig, model: nn.Module, convert_at: int | None) -> bool:
    """Whether a fresh trial measures its model before training: only where something needs the
    number then, the constraints (a config is judged untrained) or a T-CNN converting at epoch 0
    (the CNN's number). Otherwise after the first epoch, so that a study's first measurement is not
    timed while Ray starts up, a window in which machines run measurably slow."""
    return bool(cfg.constraints) or (convert_at == 0 and not model.is_reparametrised)


def _reject_by_constraints(cfg: TrialConfig, model: nn.Module, measurement: dict[str, Any] | None, *,
                           convert_at: int | None, measure: Callable[[nn.Module], dict[str, Any]],
                           on_epoch: EpochCallback | None) -> TrialOutcome | None:
    """Where a fresh trial's architecture breaks one of ``cfg.constraints``: its one report
    (epoch 0, ``rejected``: the reason, no state) and its outcome; None where it may train. Judged
    on the architecture the trial is meant to end with (a T-CNN: the converted one)."""
    if not cfg.constraints:
        return None
    final = measurement
    if convert_at is not None and convert_at < cfg.epochs and not model.is_reparametrised:
        converted = copy.deepcopy(model)
        converted.reparametrise()
        final = measure(converted)
    broken = [(c, c.violation(final[c.metric])) for c in cfg.constraints]
    broken = [(c, v) for c, v in broken if v > 0]
    if not broken:
        return None
    reason = "; ".join(f"{c.metric}={final[c.metric]:.4g} breaks {c}" for c, _ in broken)
    if on_epoch is not None:
        on_epoch({"epoch": 0, **final, "rejected": reason, "constraint_violation": sum(v for _, v in broken),
                  "stop_reason": "constraint", "best_val_acc": math.nan, "best_val_loss": math.nan}, None)
    return TrialOutcome(history=[], best_val_acc=math.nan, epochs_run=0, stop_reason="constraint", measurement=final)


def _convert(model: ConvertsDuringTraining, *, epoch: int, before: dict[str, Any], device: torch.device,
             measure: Callable[[nn.Module], dict[str, Any]]) -> dict[str, Any]:
    """Recast the model in place; the measurement of what it is now (and was before)."""
    throughput_before = before["throughput"]
    model.reparametrise()
    place_model(model, device)  # the new layers; the convs left before them keep the format decided
    return {**measure(model), "converted_at_epoch": epoch, "throughput_before_conversion": throughput_before}


def _step_after_conversion(previous: TrainingStep, cfg: TrialConfig, device: torch.device, *, convert_at: int,
                           steps_per_epoch: int) -> TrainingStep:
    """The step for the converted model: a new AdamW over its groups (with
    ``reparam_optimizer='keep'`` the parameters that survived the conversion, the same Parameters:
    the filters, keep their moments), a new runner, the schedule from the conversion on ('fresh');
    graphed again unless capturing failed before."""
    model = previous.model
    optimizer = adamw(_param_groups_of(model, cfg.train.weight_decay), lr=cfg.train.lr, capturable=previous.graphed)
    if model.reparam_optimizer == "keep":
        for param in previous.optimizer.state:
            optimizer.state[param] = previous.optimizer.state[param]
    first_step = _schedule_start(model, convert_at=convert_at, steps_per_epoch=steps_per_epoch)
    return dataclasses.replace(previous, runner=runner_for_batches(model, cfg.train, device), optimizer=optimizer,
                               schedule=_lr_schedule(cfg, steps_per_epoch=steps_per_epoch, first_step=first_step))


def _schedule_start(model: nn.Module, *, convert_at: int | None, steps_per_epoch: int) -> int:
    """The step the lr schedule counts from: a fresh optimizer after a conversion starts over."""
    fresh = convert_at is not None and model.is_reparametrised and model.reparam_optimizer == "fresh"
    return convert_at * steps_per_epoch if fresh else 0


def trial_loaders(cfg: TrialConfig, *, device: torch.device, channels_last: bool) -> tuple[Any, Any]:
    """The trial's FFCV training loader (random pad-crop and flip, shuffled per epoch, seeded with
    the trial's seed) and its validation loader (`eval_loader`)."""
    data, settings = cfg.data, cfg.train
    flip = data.flip if settings.flip is None else settings.flip
    train_loader = make_loader(data.train_path, batch_size=settings.batch_size, train=True, seed=cfg.seed,
                               flip=flip, pad_crop=settings.pad_crop, mean=data.mean, std=data.std, device=device,
                               num_workers=settings.loader_threads, channels_last=channels_last)
    return train_loader, eval_loader(cfg, data.val_path, device=device, channels_last=channels_last)


def eval_loader(cfg: TrialConfig, path: str, *, device: torch.device, channels_last: bool) -> Any:
    """The loader a trial is evaluated with, on its validation split (``cfg.data.val_path``) or its
    test split (``search train``): every image once in file order, no augmentation, the dataset's
    normalisation, batches of max(256, train.batch_size); images channels_last where the model is
    (`place_model` says)."""
    data, settings = cfg.data, cfg.train
    return make_loader(path, batch_size=max(256, settings.batch_size), train=False, mean=data.mean, std=data.std,
                       device=device, num_workers=settings.loader_threads, channels_last=channels_last)


def _lr_schedule(cfg: TrialConfig, *, steps_per_epoch: int, first_step: int) -> Callable[[int], float]:
    """The lr at the trial's step i (0-based over all its epochs): `lr_at` over the trial's steps,
    counted from ``first_step``."""
    settings, total_steps = cfg.train, steps_per_epoch * cfg.epochs
    warmup_steps = round(settings.warmup_epochs * steps_per_epoch)

    def lr(step: int) -> float:
        return lr_at(step - first_step, total_steps=total_steps - first_step, warmup_steps=warmup_steps,
                     peak_lr=settings.lr, min_lr=settings.min_lr)

    return lr


def training_step(model: nn.Module, cfg: TrialConfig, device: torch.device, *, steps_per_epoch: int,
                  first_step: int = 0) -> "TrainingStep":
    """The step `train_trial` trains ``model`` (built by `build_model`, placed by `place_model` on
    ``device``) with: fused AdamW (`adamw`) over the model's parameter groups, the autocast and
    loss scaling of train.precision, the cross-entropy with train.label_smoothing, the batches
    through torch.compile where train.compile says, graphed where `graphs_steps` says, and the
    learning rate of `lr_at` over ``steps_per_epoch`` x ``cfg.epochs`` steps counted from
    ``first_step`` (a fresh optimizer after a conversion starts over)."""
    settings = cfg.train
    graphed = graphs_steps(settings, device)
    optimizer = adamw(_param_groups_of(model, settings.weight_decay), lr=settings.lr, capturable=graphed)
    fp16 = autocast_dtype(settings.precision, device) == torch.float16
    return TrainingStep(
        model=model, runner=runner_for_batches(model, settings, device),  # batches only: state dicts use `model`
        criterion=nn.CrossEntropyLoss(label_smoothing=settings.label_smoothing), optimizer=optimizer,
        scaler=torch.amp.GradScaler(device.type, enabled=fp16), autocast=autocast_for(settings.precision, device),
        settings=settings, graphed=graphed,
        schedule=_lr_schedule(cfg, steps_per_epoch=steps_per_epoch, first_step=first_step))


@dataclasses.dataclass(eq=False)
class TrainingStep:
    """One batch's learning rate (``schedule(at)``), forward, loss, backward, [clip] and AdamW
    update: ``step(images, labels, at=i)`` with images (B, C, H, W), labels (B,) and i the batch's
    index in the trial (0-based over all its epochs) returns the loss (a 0-d tensor); ``lr`` is
    the rate it stepped with. Eager, or with ``graphed`` (train.cuda_graph on a GPU,
    `graphs_steps`) captured as one CUDA graph at the first batch (or at `capture`; its shapes are
    the trial's) and replayed for every batch after; a step that cannot be captured trains eagerly
    from then on (`capture_step` says why) and ``graphed`` turns False. Made by `training_step`."""

    model: nn.Module
    runner: nn.Module  # the model, or its torch.compile wrapper: what the batches go through
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: Callable[[], ContextManager]
    settings: TrainSettings
    graphed: bool
    schedule: Callable[[int], float]
    lr: float = dataclasses.field(init=False)
    _replay: GraphedTrainStep | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.lr = self.settings.lr

    def capture(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """Where graphed and not captured yet, capture the step for batches like these now (a
        benchmark keeps the capture off its clock); else nothing."""
        if self.graphed and self._replay is None:
            self._replay = capture_step(model=self.model, runner=self.runner, criterion=self.criterion,
                                        optimizer=self.optimizer, images=images, labels=labels, settings=self.settings)
            self.graphed = self._replay is not None

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, *, at: int) -> torch.Tensor:
        self.lr = self.schedule(at)
        set_lr(self.optimizer, self.lr)
        self.capture(images, labels)
        if self._replay is not None:
            return self._replay(images, labels)  # forward, backward, [clip], AdamW: one replay
        with self.autocast():
            loss = self.criterion(self.runner(images), labels)  # logits (B, num_classes) -> ()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.settings.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss


def _train_epoch(train_step: TrainingStep, loader: Iterable[Any], *, epoch: int, steps_per_epoch: int, share: Any,
                 device: torch.device) -> tuple[torch.Tensor, float]:
    """One epoch's batches through ``train_step``. (The summed loss, on the device; host seconds
    spent waiting for batches: is the trial input-bound?)"""
    train_step.model.train()
    loss_sum = torch.zeros((), device=device)  # summed on the device: no host sync per step
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    waited = [0.0]
    for step, (images, labels) in enumerate(_waited_for(loader, waited)):  # (B, C, H, W) float, (B,) int64
        loss = train_step(images, labels, at=epoch * steps_per_epoch + step)  # (): lr, forward, loss, backward, AdamW
        nonfinite |= ~torch.isfinite(loss.detach())
        # Checking every step would sync the GPU each step; every 50 is soon enough.
        if (step % 50 == 49 or step == steps_per_epoch - 1) and bool(nonfinite):
            raise NonFiniteLossError(f"training loss became {loss.item()} at epoch {epoch + 1}, step {step + 1}; "
                                     f"lower the learning rate (lr={train_step.settings.lr:g}) or set "
                                     "train.grad_clip")
        loss_sum += loss.detach().float()
        share.step()
    return loss_sum, waited[0]


def _restore(resume: dict[str, Any], *, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler) -> tuple[int, float, float, int, list[dict[str, Any]]]:
    """Load a checkpoint (`_checkpoint`) into the trial; (epochs done, best val acc, best val
    loss, epochs without improvement, history) to go on from."""
    model.load_state_dict(resume["model"])
    optimizer.load_state_dict(resume["optimizer"])
    scaler.load_state_dict(resume["scaler"])
    torch.set_rng_state(resume["rng"])
    return (int(resume["epoch"]), float(resume["best_val_acc"]), float(resume["best_val_loss"]),
            int(resume["bad_epochs"]), list(resume["history"]))


def selected_weights(model: nn.Module, *, epoch: int) -> dict[str, Any]:
    """The model's weights after ``epoch``, copied to the CPU: the selection a held-out test scores
    (``trainers.heldout``). A T-CNN selected before its conversion is a CNN (``reparametrised`` false)."""
    return {"model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
            "epoch": epoch, "reparametrised": bool(getattr(model, "is_reparametrised", False))}


def _checkpoint(*, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, epoch: int,
                best_val_acc: float, best_val_loss: float, bad_epochs: int, history: list[dict[str, Any]],
                measurement: dict[str, Any], selected: dict[str, Any] | None) -> dict[str, Any]:
    """What ``resume`` takes to continue after ``epoch`` (the live tensors: serialise at once)."""
    return {
        "model": model.state_dict(),
        "optimizer": _portable(optimizer.state_dict()),
        "scaler": scaler.state_dict(),
        "rng": torch.get_rng_state(),
        "epoch": epoch,
        "best_val_acc": best_val_acc,
        "best_val_loss": best_val_loss,
        "bad_epochs": bad_epochs,
        "history": list(history),
        "measurement": measurement,
        "reparametrised": bool(getattr(model, "is_reparametrised", False)),
        "selected": selected,  # the best validation epoch's weights: a copy, so a checkpoint holds two sets
    }

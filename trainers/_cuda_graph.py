"""A model's inference forward, or a whole training step, captured once as a CUDA graph and
replayed per batch.

A small vision transformer on a fast GPU is bound by the host: the GPU runs a batch in about
the time Python takes to enqueue its few hundred kernels (`python -m benchmarks models --device
cuda --cuda-graphs PREFIX` times both ways). Timed eagerly, its throughput then says how fast
the host's Python runs, and two architectures compare by the number of operations they
issue rather than by what the GPU spends on them. Replayed as one CUDA graph the batch costs a
single launch, so the number is the GPU's cost of the architecture, which is also what a deployed
model (CUDA graphs, `torch.compile(mode="reduce-overhead")`, TensorRT) pays.

`capture_inference` follows torch's recipe (`torch.cuda.graphs`): a few forwards on a side stream
first (lazy initialisation, cuBLAS workspaces, the Triton kernels' launch tuning and the values
inference keeps, all of which must not happen during capture), then one forward captured into a
private memory pool. Autocast's cast cache is off while capturing: a cached cast made before the
capture would be read by every replay after the autocast context that held it freed it.

The graph holds the input and output tensors it was captured with (fixed shape, dtype and
memory format): a replay reads its batch from that input and writes the same output tensor.

`capture_train_step` does the same for a training step: forward, loss, backward, gradient
clipping and AdamW's update, all in one graph (torch's "whole network capture"). Training is
host-bound the same way: even with `torch.compile(mode="reduce-overhead")` (which graphs the
forward and the backward but leaves autograd's gradient accumulation, the optimizer and Dynamo's
guards to Python) a small model's GPU idles for much of each step (benchmarks/trial_profile.py
measures host and GPU time per step). A replay leaves the host one launch and the batch's copy
into the graph's input.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["CaptureError", "GraphedInference", "GraphedTrainStep", "capture_inference", "capture_train_step"]


class CaptureError(RuntimeError):
    """The model's forward cannot be captured as a CUDA graph (it synchronises with the host,
    say); run it eagerly."""


class GraphedInference:
    """``run(x)``: the captured forward on ``x`` (copied into the graph's input unless it is that
    tensor); returns the graph's output tensor, overwritten by the next replay."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static_input: torch.Tensor, static_output: torch.Tensor):
        self.graph = graph
        self.static_input = static_input
        self.static_output = static_output

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self.static_input:
            if x.shape != self.static_input.shape:
                raise ValueError(f"this CUDA graph was captured for inputs of shape {tuple(self.static_input.shape)}, "
                                 f"got {tuple(x.shape)}; capture another for this shape")
            self.static_input.copy_(x)
        self.graph.replay()
        return self.static_output


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)


@contextmanager
def _capture_or_restore(device: torch.device, what: str) -> Iterator[None]:
    """Turn a failed capture into CaptureError, leaving the device's random generator and the
    current stream as they were (torch 2.11-2.14 leave the generator in capture mode: every later
    random op in the process then fails with "Offset increment outside graph capture")."""
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    rng_before, stream_before = generator.clone_state(), torch.cuda.current_stream(device)
    try:
        yield
    except RuntimeError as exc:  # e.g. "operation not permitted when stream is capturing"
        generator.graphsafe_set_state(rng_before)
        torch.cuda.set_stream(stream_before)
        raise CaptureError(f"{what} cannot be captured as a CUDA graph: "
                           f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


def capture_inference(model: nn.Module, example: torch.Tensor, *, autocast_dtype: torch.dtype | None = None,
                      warmup: int = 2) -> GraphedInference:
    """Capture ``model``'s forward on a batch shaped like ``example`` (on a CUDA device, the
    model in eval mode) under ``torch.inference_mode`` and, with ``autocast_dtype``, CUDA
    autocast in that dtype. The graph's input is a copy of ``example``. Raises CaptureError
    where the forward cannot be captured; the model, the device's random generator and the current
    stream are then left as they were, ready to run eagerly.
    """
    if example.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA input, got one on {example.device}")
    device = example.device
    static_input = example.detach().clone(memory_format=torch.preserve_format)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode(), _autocast(device, autocast_dtype):
        for _ in range(warmup):
            model(static_input)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with _capture_or_restore(device, f"{type(model).__name__}'s forward"):
        # thread_local: another thread's CUDA work (a trial's FFCV loader copying batches) is neither
        # captured nor an error
        with (torch.inference_mode(), _autocast(device, autocast_dtype),
              torch.cuda.graph(graph, capture_error_mode="thread_local")):
            static_output = model(static_input)
    return GraphedInference(graph, static_input, static_output)



class GraphedTrainStep:
    """``step(images, labels)``: one captured training step on this batch (copied into the graph's
    inputs); returns the graph's float32 loss tensor (0-dim), overwritten by the next replay. The
    learning rate is each param group's ``lr`` tensor: ``fill_`` it before a replay."""

    def __init__(self, graph: torch.cuda.CUDAGraph, images: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor):
        self.graph = graph
        self.images = images
        self.labels = labels
        self.loss = loss

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if images.shape != self.images.shape or labels.shape != self.labels.shape:
            raise ValueError(f"this training step was captured for batches of shape {tuple(self.images.shape)}, "
                             f"got {tuple(images.shape)}; capture another for this shape")
        self.images.copy_(images)
        self.labels.copy_(labels)
        self.graph.replay()
        return self.loss


def capture_train_step(
    *,
    model: nn.Module,
    runner: Callable[[torch.Tensor], torch.Tensor],
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast_dtype: torch.dtype | None = None,
    grad_clip: float | None = None,
    warmup: int = 3,
) -> GraphedTrainStep:
    """Capture ``loss = criterion(runner(images), labels); loss.backward(); [clip]; optimizer.step()``
    on batches shaped like ``images``/``labels`` (CUDA tensors; ``runner`` is ``model`` or its
    torch.compile wrapper without CUDA graphs of its own, in train mode).

    ``optimizer`` must be made with ``capturable=True``; its param groups' ``lr`` become 0-dim
    CUDA tensors (their values kept), which the replays read. Before the capture, ``warmup`` steps
    run on a side stream (compilation, cuBLAS workspaces, the optimizer's state), after which the
    parameters, buffers and optimizer state get their values from before back, in place (the graph
    holds their addresses): capturing changes nothing the training sees, except the device's random
    stream. Raises CaptureError where the step cannot be captured (a host sync, a GradScaler's
    dynamic loss scale), with everything left as it was, ready to train eagerly.
    """
    if images.device.type != "cuda":
        raise ValueError(f"CUDA graphs need CUDA batches, got images on {images.device}")
    if not optimizer.defaults.get("capturable"):
        raise ValueError(f"{type(optimizer).__name__} must be made with capturable=True to be captured")
    device = images.device
    for group in optimizer.param_groups:
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    model_before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state_before = {p: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
                    for p in params if p in optimizer.state}
    static_images = images.detach().clone(memory_format=torch.preserve_format)
    static_labels = labels.detach().clone()

    def step() -> torch.Tensor:
        with _autocast(device, autocast_dtype):
            loss = criterion(runner(static_images), static_labels)
        loss.backward()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        return loss.detach().float()

    with torch.random.fork_rng(devices=[device]):  # the warm-up's dropout draws
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                optimizer.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream(device).wait_stream(side)
    with torch.no_grad():  # undo the warm-up's updates, into the same tensors
        for key, value in model.state_dict().items():
            value.copy_(model_before[key])
        for p in params:
            before = state_before.get(p, {})
            for key, value in optimizer.state[p].items():
                if torch.is_tensor(value):  # AdamW's fresh state is zeros (moments, step)
                    value.copy_(before[key]) if key in before else value.zero_()
    optimizer.zero_grad(set_to_none=True)  # the capture's backward allocates the gradients the replays write
    graph = torch.cuda.CUDAGraph()
    with _capture_or_restore(device, f"{type(model).__name__}'s training step"):
        # thread_local: the FFCV loader's thread copying batches meanwhile is neither captured nor an error
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_loss = step()
    return GraphedTrainStep(graph, static_images, static_labels, static_loss)

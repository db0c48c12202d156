"""A model's inference forward captured once as a CUDA graph and replayed per batch.

A small vision transformer on a fast GPU is bound by the host: at 224 px and batch 256 the GPU
runs a ConViT-Ti batch in about 8 ms, while Python takes 5-11 ms to enqueue its few hundred
kernels (H100 and H200 runs in `benchmarks/README.md`). Timed eagerly, its throughput then says
how fast the host's Python runs, and two architectures compare by the number of operations they
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
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

__all__ = ["CaptureError", "GraphedInference", "capture_inference"]


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
    # what a failed capture leaves behind (torch 2.11-2.14): the device's random generator still in
    # capture mode (every later random op in the process then fails: "Offset increment outside
    # graph capture"), and the capture stream as the current one
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    rng_before, stream_before = generator.clone_state(), torch.cuda.current_stream(device)
    try:
        # thread_local: another thread's CUDA work (a trial's FFCV loader copying batches) is neither
        # captured nor an error
        with (torch.inference_mode(), _autocast(device, autocast_dtype),
              torch.cuda.graph(graph, capture_error_mode="thread_local")):
            static_output = model(static_input)
    except RuntimeError as exc:  # e.g. "operation not permitted when stream is capturing"
        generator.graphsafe_set_state(rng_before)
        torch.cuda.set_stream(stream_before)
        raise CaptureError(f"{type(model).__name__}'s forward cannot be captured as a CUDA graph: "
                           f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    return GraphedInference(graph, static_input, static_output)


"""GPU throughput timed as CUDA graph replays (trainers/_cuda_graph.py): the replay computes what
the eager forward does, for every family; a forward that cannot be captured is timed eagerly and
says so; the setting leaves CPU measurements (and their cache) alone."""

from __future__ import annotations

import pytest
import timm
import torch
import yaml

import trainers.models  # noqa: F401  (registers the ls_* families)
from trainers import CaptureError, capture_inference, throughput
from trainers.hooks import ConvertsDuringTraining
from trainers.throughput import measure_model, measure_throughput


def test_capture_needs_a_cuda_input():
    with pytest.raises(ValueError, match="CUDA input"):
        capture_inference(timm.create_model("ls_convit_nano"), torch.zeros(2, 1, 28, 28))


def test_the_setting_parses_and_a_non_boolean_is_refused(tmp_path):
    from search import load_spec  # (pyarrow: imported here, so a bare GPU machine runs the CUDA tests)

    spec = {"name": "t", "dataset": {"name": "synthetic"}, "model": {"name": "ls_convit_nano"},
            "space": {"locality_strength": {"type": "uniform", "low": 0.5, "high": 2.0}},
            "objectives": [{"metric": "val_acc", "mode": "max"}], "budget": {"trials": 2, "max_epochs": 1}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert load_spec(path).throughput.cuda_graph is True  # the default
    path.write_text(yaml.safe_dump({**spec, "throughput": {"cuda_graph": False}}))
    assert load_spec(path).throughput.cuda_graph is False
    path.write_text(yaml.safe_dump({**spec, "throughput": {"cuda_graph": "yes"}}))
    with pytest.raises(Exception, match=r"throughput\.cuda_graph: expected true or false"):
        load_spec(path)


def test_on_the_cpu_the_setting_changes_neither_the_measurement_nor_its_cache(tmp_path, monkeypatch):
    def no_capture(*args, **kwargs):
        raise AssertionError("captured a CUDA graph on the CPU")

    monkeypatch.setattr(throughput, "capture_inference", no_capture)
    kwargs = dict(input_shape=(1, 28, 28), batch_size=8, warmup=1, repeats=2, cache_dir=tmp_path)
    first = measure_model(timm.create_model("ls_convit_nano"), **kwargs, cuda_graph=True)
    again = measure_model(timm.create_model("ls_convit_nano"), **kwargs, cuda_graph=False)
    assert not first["throughput_cached"] and again["throughput_cached"]
    assert first["throughput_cuda_graph"] is None
    result = measure_throughput(timm.create_model("ls_convit_nano"), input_shape=(1, 28, 28), batch_size=4,
                                warmup=0, repeats=1)
    assert result.cuda_graph is False


# every family at test size, the T-CNN as it ends a run (its last stage recast as GPSA), and timm's DeiT
FAMILIES = ["ls_convit_nano", "ls_gmm_nano", "ls_refiner_nano", "ls_tcnn_nano", "deit_tiny_patch16_224"]


def _model(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    if name.startswith("deit"):
        return timm.create_model(name, img_size=32, patch_size=4, num_classes=10), (3, 32, 32)
    model = timm.create_model(name)
    if isinstance(model, ConvertsDuringTraining):
        model.reparametrise()
    return model, (model.in_chans if hasattr(model, "in_chans") else 1, 28, 28)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_replay_computes_what_the_eager_forward_does(name, dtype):
    torch.manual_seed(0)
    model, shape = _model(name)
    model = model.cuda().eval().to(memory_format=torch.channels_last)
    first, second = (torch.randn(32, *shape, device="cuda").contiguous(memory_format=torch.channels_last)
                     for _ in range(2))
    graph = capture_inference(model, first, autocast_dtype=dtype)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype is None else dict(rtol=2e-2, atol=2e-2)
    for x in (first, second, first):  # a new batch is copied into the graph's input
        with torch.inference_mode(), torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            expected = model(x).float()
        torch.testing.assert_close(graph(x).float(), expected, **tolerance)
    with pytest.raises(ValueError, match="captured for inputs of shape"):
        graph(first[:4])


class _SyncsWithTheHost(torch.nn.Module):
    """A forward that reads a value back to the host, as no CUDA graph can capture."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(28, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.flatten(2).mean(1)[:, :28])
        return y * float(y.abs().max())


@pytest.mark.cuda
def test_a_forward_that_cannot_be_captured_is_timed_eagerly_and_says_so():
    model = _SyncsWithTheHost().cuda()
    stream = torch.cuda.current_stream()
    with pytest.raises(CaptureError, match="cannot be captured"):
        capture_inference(model, torch.randn(8, 1, 28, 28, device="cuda"))
    # the process goes on as before: random ops (a trial's dropout), the same stream
    assert torch.cuda.current_stream() == stream
    torch.randn(4, device="cuda").sum().item()
    with pytest.warns(UserWarning, match="timed eagerly"):
        result = measure_throughput(model, input_shape=(1, 28, 28), batch_size=8, warmup=1, repeats=2, precision="fp32")
    assert result.cuda_graph is False and result.images_per_s > 0
    graphed = measure_throughput(timm.create_model("ls_convit_nano").cuda(), input_shape=(1, 28, 28), batch_size=8,
                                 warmup=1, repeats=2)
    assert graphed.cuda_graph is True
    eager = measure_throughput(timm.create_model("ls_convit_nano").cuda(), input_shape=(1, 28, 28), batch_size=8,
                               warmup=1, repeats=2, cuda_graph=False)
    assert eager.cuda_graph is False

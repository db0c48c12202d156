"""throughput.runtime: every family's nano variant timed in each runtime, and eager really is eager."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

import trainers.models  # noqa: F401  (registers the families with timm)
from trainers import kernels
from trainers.config import RUNTIMES
from trainers.throughput import measure_model

FAMILIES = ["ls_convit_nano", "ls_gmm_nano", "ls_refiner_nano", "ls_tcnn_nano"]
SHAPE = (1, 28, 28)


def _nano(name: str) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, img_size=28, in_chans=1, num_classes=10)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", FAMILIES)
def test_every_runtime_measures_every_familys_nano_variant(name, runtime, tmp_path):
    record = measure_model(_nano(name), input_shape=SHAPE, batch_size=16, warmup=1, repeats=6,
                           reference=_nano(name), cache_dir=tmp_path, runtime=runtime)
    assert record["throughput"] > 0 and record["throughput_runtime"] == runtime
    assert record["throughput_low"] <= record["throughput"] <= record["throughput_high"]


class _Spy(nn.Module):
    """Records whether the kernels were on during each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(28, 10)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(kernels.enabled())
        return self.proj(x.mean(dim=(1, 2)))


def test_eager_times_with_the_kernels_off_and_each_runtime_has_its_own_cache_entry(tmp_path):
    was = kernels.enabled()
    spy = _Spy()
    eager = measure_model(spy, input_shape=SHAPE, batch_size=4, warmup=1, repeats=6, cache_dir=tmp_path, runtime="eager")
    timed = spy.seen.index(True) if True in spy.seen else len(spy.seen)  # then the flop count's, after
    assert timed >= 1 + 6 * 3 and not any(spy.seen[:timed])  # the warm-up and every round, kernels off
    assert kernels.enabled() == was  # the switch is as it was
    spy.seen.clear()
    fused = measure_model(spy, input_shape=SHAPE, batch_size=4, warmup=1, repeats=6, cache_dir=tmp_path, runtime="kernels")
    assert len(spy.seen) >= 1 + 6 * 3 and set(spy.seen) == {was}  # as the switch says, not the eager entry
    assert not eager["throughput_cached"] and not fused["throughput_cached"]
    assert len(list(tmp_path.glob("*.json"))) == 2
    with pytest.raises(ValueError, match="runtime must be"):
        measure_model(spy, input_shape=SHAPE, batch_size=4, runtime="onnx")


def test_a_measurement_whose_rounds_were_all_contended_still_has_its_interval(monkeypatch):
    import trainers.throughput as throughput

    # no round counts as uncontended (another process always had the cores): every round is timed,
    # none counted, and the interval comes from all of them (it once raised a TypeError)
    monkeypatch.setattr(throughput, "CPU_SHARE_FLOOR", 2.0)
    monkeypatch.setattr(throughput, "CPU_ATTEMPTS", 2)
    monkeypatch.setattr(throughput, "CPU_RETRY_PAUSE_S", 0.0)
    record = measure_model(_nano("ls_convit_nano"), input_shape=SHAPE, batch_size=8, warmup=1, repeats=6,
                           reference=_nano("ls_gmm_nano"))
    assert record["throughput_low"] <= record["throughput"] <= record["throughput_high"]

"""trainers.precision: the one rule for what train.precision and throughput.precision compute in;
auto is bf16 where the hardware multiplies in it (a CPU with AMX or AVX512-BF16, a GPU that has
it), fp16 on other GPUs, fp32 on other CPUs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainers.precision
from trainers import throughput
from trainers.config import SettingError, TrainSettings
from trainers.precision import autocast_dtype, autocast_for, resolve_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("device,bf16_hardware,expected", [
    (CPU, True, "bf16"),  # AMX or AVX512-BF16: bf16 autocast
    (CPU, False, "fp32"),  # any other CPU would emulate bf16, far slower than fp32
    (CUDA, True, "bf16"),
    (CUDA, False, "fp16"),  # AMP in fp16 (with loss scaling) on a GPU without bf16
])
def test_auto_is_bf16_where_the_hardware_multiplies_in_it(device, bf16_hardware, expected):
    assert resolve_precision("auto", device, bf16_hardware=bf16_hardware) == expected


def test_auto_asks_the_cpu(monkeypatch):
    for native, precision, dtype in ((True, "bf16", torch.bfloat16), (False, "fp32", None)):
        monkeypatch.setattr(trainers.precision, "cpu_has_native_bf16", lambda: native)
        assert resolve_precision("auto", CPU) == precision and autocast_dtype("auto", CPU) is dtype
    assert resolve_precision("auto", torch.device("meta")) == "fp32"  # neither a CPU nor a GPU


def test_an_explicit_precision_is_kept_and_bf16_needs_a_gpu_that_has_it():
    for device in (CPU, CUDA):
        for precision in ("fp32", "fp16"):
            assert resolve_precision(precision, device, bf16_hardware=False) == precision
    assert resolve_precision("bf16", CPU, bf16_hardware=False) == "bf16"  # emulated, but asked for
    assert resolve_precision("bf16", CUDA, bf16_hardware=True) == "bf16"
    with pytest.raises(SettingError, match="bf16: .* does not support it; use fp16 or auto") as info:
        resolve_precision("bf16", CUDA, bf16_hardware=False)
    assert info.value.key == "precision"
    assert autocast_dtype("fp32", CPU) is None and autocast_dtype("fp16", CPU) is torch.float16
    for bad in (lambda: resolve_precision("fp8", CPU), lambda: TrainSettings(precision="fp8")):
        with pytest.raises(SettingError, match="must be one of auto, fp32, bf16, fp16, got 'fp8'") as info:
            bad()
        assert info.value.key == "precision"


def test_fp32_turns_an_outer_autocast_off():
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with autocast_for("fp32", CPU)():
            assert (a @ a).dtype == torch.float32
        with autocast_for("bf16", CPU)():
            assert (a @ a).dtype == torch.bfloat16


@pytest.mark.parametrize("native", [True, False])
def test_the_throughput_measurement_resolves_auto_as_training_does(monkeypatch, native):
    monkeypatch.setattr(trainers.precision, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(throughput, "CPU_ROUNDS", 1)  # one short round is enough to read the precision
    monkeypatch.setattr(throughput, "CPU_ATTEMPTS", 1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    result = throughput.measure_throughput(model, input_shape=(1, 4, 4), batch_size=2, warmup=0, repeats=1)
    assert result.precision == resolve_precision("auto", CPU) == ("bf16" if native else "fp32")

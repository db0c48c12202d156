"""benchmarks/models.py: every model timed in the memory format a trial runs it in."""

from __future__ import annotations

import copy
import warnings

import pytest
import timm
import torch

from benchmarks.models import NCHW, _with_onednn_linears, _with_torch_inference_ops, run_group
from tests._layers import OpCalls
from trainers import kernels
from trainers.kernels import _linear

TCNN = "ls_tcnn_resnet10_micro_s (converted)"


def test_micro_group_times_the_tcnn_channels_last_against_its_nchw_twin():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # fp32 only: no word of a bf16 kernel
        r = run_group("micro", batch=4, repeats=1, warmup=0, device="cpu", train=True, precisions=("fp32",))
    assert r["config"]["channels_last"] == [TCNN]  # the ViTs and the NCHW twin stay NCHW on the CPU
    assert NCHW + TCNN in r["params"] and r["params"][NCHW + TCNN] == r["params"][TCNN]
    gain = r["channels_last_gain"][TCNN]
    assert set(gain) == {"inference", "train"} and all(v > 0 for v in gain.values())
    assert r["inference"]["speed_vs_baseline"]["deit micro (ls_convit_micro, 0 GPSA)"] == 1.0


def test_a_timm_model_with_onednn_linears_has_every_linear_swapped_and_the_same_outputs(monkeypatch):
    """The "oneDNN-linear" DeiT the convit and tiny groups time where our float32 linears run on
    oneDNN: the same parameters, every nn.Linear now ours (forced onto oneDNN here), same logits."""
    monkeypatch.setattr(_linear, "onednn_beats_mkl_here", lambda: True)
    torch.manual_seed(0)
    reference = timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10).eval()
    swapped = _with_onednn_linears(copy.deepcopy(reference))
    linears = [m for m in swapped.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is kernels.Linear for m in linears)
    assert swapped.state_dict().keys() == reference.state_dict().keys()
    x = torch.randn(8, 3, 32, 32)
    with torch.inference_mode(), OpCalls() as ops:
        out = swapped(x)
    assert ops.calls.get("mkldnn._linear_pointwise", 0) > 0
    with torch.inference_mode():
        torch.testing.assert_close(out, reference(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.avx2),
                                       pytest.param("bf16", marks=pytest.mark.avx512_bf16)])
def test_the_torch_inference_ops_twin_runs_inference_on_torch_ops_and_switches_back(monkeypatch, precision):
    """The "torch-inference-ops" model the convit and micro groups time: the same weights with the
    inference norms on torch's ops and fc1's GELU (and in bf16 the linears) off oneDNN's fused op,
    and oneDNN's products on the plain weights (no packing), during its forward only; the flags
    come back on."""
    if precision == "bf16" and (not kernels.onednn_runs_bf16_here() or kernels.cpu_library(torch.bfloat16) is None):
        pytest.skip("no bf16 oneDNN products or bf16 kernel here")
    if precision == "fp32" and kernels.cpu_library(torch.float32) is None:
        pytest.skip("no float32 kernel here")
    monkeypatch.setattr(_linear, "onednn_beats_mkl_here", lambda: True)  # fc1's GELU fuses on any CPU
    torch.manual_seed(0)
    model = timm.create_model("ls_convit_micro").eval()
    twin = _with_torch_inference_ops(model)
    x = torch.randn(8, 1, 28, 28)
    library = "locality_search" if precision == "bf16" else "locality_search_fp32"
    fused_ops, torch_norms = {f"{library}.layer_norm"}, {"aten.layer_norm", "aten.native_layer_norm"}
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        with OpCalls() as ops:
            slow = twin(x)
        assert not fused_ops & set(ops.calls) and torch_norms & set(ops.calls) and "aten.gelu_" in ops.calls
        assert "mkldnn._reorder_linear_weight" not in ops.calls
        assert kernels.selected_backends() == kernels.Backends()  # every backend back on
        with OpCalls() as ops:
            fast = model(x)
        assert fused_ops <= set(ops.calls) and not {"aten.gelu_", "aten.gelu"} & set(ops.calls)
        assert "mkldnn._reorder_linear_weight" in ops.calls  # the weights packed on this first call
    assert sum(p.numel() for p in twin.parameters()) == sum(p.numel() for p in model.parameters())
    tolerance = 0.05 if precision == "bf16" else 1e-4
    torch.testing.assert_close(fast.float(), slow.float(), atol=tolerance * slow.abs().max().item(), rtol=0)

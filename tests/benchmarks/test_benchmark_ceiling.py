"""benchmarks/_ceiling.py: a speed-up's arithmetic ceiling, and the benchmarks that report it."""
from __future__ import annotations

import pytest
import timm
import torch
from timm.models.convit import GPSA as TimmGPSA

from benchmarks import gpsa_layer
from benchmarks._ceiling import MultiplyAddPeak, PeakMatmul, arithmetic_ceiling, counted_flops
from benchmarks.models import PEAKS, run_group
from trainers import cpu_has_native_bf16
from benchmarks.peak import peak_build_error, peak_ops
from trainers import kernels


def test_the_ceiling_is_the_baseline_over_its_arithmetic_at_the_peak_rate():
    # a 2 GFLOP peak product in 10 ms: 200 GFLOP/s; 3.5 GFLOP take 17.5 ms at it
    c = arithmetic_ceiling(baseline_flops=3_500_000_000, baseline_s=0.0525, peak_flops=2_000_000_000, peak_s=0.010,
                           ours_s=0.025)
    assert c["peak_flop_per_s"] == pytest.approx(200e9)
    assert c["floor_s"] == pytest.approx(0.0175)
    assert c["ratio"] == pytest.approx(3.0)
    assert c["ours_share_of_peak"] == pytest.approx(0.7)
    assert "ours_share_of_peak" not in arithmetic_ceiling(baseline_flops=1, baseline_s=1.0, peak_flops=1, peak_s=1.0)
    for bad in (dict(baseline_flops=0), dict(peak_s=0.0), dict(baseline_s=-1.0)):
        with pytest.raises(ValueError, match="positive"):
            arithmetic_ceiling(**{**dict(baseline_flops=1, baseline_s=1.0, peak_flops=1, peak_s=1.0), **bad})


def test_timm_gpsa_steps_counted_flops_are_its_products_worked_by_hand():
    batch, tokens, dim, heads = 4, 49, 96, 4
    layer = TimmGPSA(dim, num_heads=heads)
    x = torch.randn(batch, tokens, dim, requires_grad=True)
    rows = batch * tokens
    projections = 2 * rows * dim * (2 * dim + dim + dim)  # q and k, v, the output
    attention = 2 * (2 * batch * heads * tokens * tokens * (dim // heads))  # q k^T and A v
    positional = 2 * batch * tokens * tokens * 3 * heads  # pos_proj over rel_indices, for every image
    # backward: two products per forward product (positions: the weight's only, rel_indices needs none)
    expected = 3 * projections + 3 * attention + 2 * positional
    assert counted_flops(lambda: gpsa_layer._step(layer, x)) == expected


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_peak_matmul_computes_its_product_in_the_precision_asked(precision):
    peak = PeakMatmul(64)
    assert peak.flops == {"fp32": 2 * 64 ** 3, "bf16": 2 * 64 ** 3}
    peak(precision)
    a, b = peak._operands[precision]
    assert a.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    torch.testing.assert_close(peak._out[precision], a @ b)
    assert not peak._out[precision].requires_grad


def _check_ceilings(ceilings: dict, *, baseline_s: float, ours_s: float, peaks: dict[str, tuple[int, float]]) -> None:
    """Each ceiling is the baseline's time over its counted arithmetic at that peak's timed rate."""
    assert set(ceilings) == set(peaks)
    for kind, c in ceilings.items():
        flops, seconds = peaks[kind]
        assert c["peak_flop_per_s"] == pytest.approx(flops / seconds)
        assert c["floor_s"] == pytest.approx(c["baseline_flops"] / c["peak_flop_per_s"])
        assert c["ratio"] == pytest.approx(baseline_s / c["floor_s"])
        assert c["ours_share_of_peak"] == pytest.approx(c["floor_s"] / ours_s)


def test_the_gpsa_benchmark_reports_ceilings_from_timms_counted_step_and_the_peaks_timed_beside_it():
    r = gpsa_layer.run(batch=2, tokens=16, dim=32, heads=2, repeats=1, warmup=0, device="cpu", bf16=False)
    med = r["median_s"]
    peaks = {"matmul": (2 * 1024 ** 3, med["matmul_peak"])}
    if kernels.cpu_library(torch.float32) is not None:
        peaks["multiply_add"] = (MultiplyAddPeak(["fp32"]).flops["fp32"], med["multiply_add_peak"])
    _check_ceilings(r["ceiling"], baseline_s=med["timm"], ours_s=med["ours"], peaks=peaks)
    expected = 3 * (2 * 32 * 32 * 4 * 32) + 3 * (2 * 2 * 2 * 2 * 16 * 16 * 16) + 2 * (2 * 2 * 16 * 16 * 3 * 2)
    assert all(c["baseline_flops"] == expected for c in r["ceiling"].values())


def test_the_convit_pair_groups_time_the_peaks_beside_the_models_and_bound_ours_over_timm():
    precisions = ("fp32", "bf16") if cpu_has_native_bf16() else ("fp32",)
    r = run_group("px32", batch=2, repeats=1, warmup=0, device="cpu", train=True, precisions=precisions)
    for label in PEAKS:  # not models
        assert label not in r["params"] and label not in r["inference"]["median_batch_s"]
    kernels_built = all(kernels.cpu_library({"fp32": torch.float32, "bf16": torch.bfloat16}[p]) is not None
                        for p in precisions)
    assert set(r["peaks"]) == ({"multiply_add", "matmul"} if kernels_built else {"matmul"})
    ours, timm_convit = "ls_convit_tiny (32 px, patch 4)", "timm convit_tiny (32 px, patch 4)"
    reference = timm.create_model("convit_tiny", img_size=32, patch_size=4).eval()
    with torch.inference_mode():
        forward_flops = counted_flops(lambda: reference(torch.randn(2, 3, 32, 32)))
    keys = {key for precision in precisions for key in (("inference", "train") if precision == "fp32"
                                                        else ("inference_bf16", "train_bf16"))}
    assert set(r["ceiling"]) == keys
    for key, by_kind in r["ceiling"].items():
        _check_ceilings(by_kind, baseline_s=r[key]["median_batch_s"][timm_convit], ours_s=r[key]["median_batch_s"][ours],
                        peaks={kind: (timed[key]["flops"], timed[key]["median_s"]) for kind, timed in r["peaks"].items()})
        # the baseline's own arithmetic: its forward, and in training its backward's too
        for c in by_kind.values():
            assert c["baseline_flops"] == forward_flops if key.startswith("inference") else c["baseline_flops"] > 2 * forward_flops
    assert "ceiling" not in run_group("micro", batch=2, repeats=1, warmup=0, device="cpu", train=False,
                                      precisions=("fp32",))


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.avx2),
                                       pytest.param("bf16", marks=pytest.mark.avx512_bf16)])
def test_the_multiply_add_peak_counts_what_it_did_on_every_thread(precision):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    if kernels.cpu_library(dtype) is None:
        pytest.skip(f"no {precision} kernel here: {kernels.cpu_library_error(dtype)}")
    ops = peak_ops(dtype)
    assert ops is not None, peak_build_error(dtype)
    # float32: one FMA a chain a step, 2 flops a lane; bf16: one vdpbf16ps, 4 flops a float32 lane of 16
    lanes = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
    chains = 16 if precision == "bf16" or lanes == 16 else 12
    per_step = chains * (16 * 4 if precision == "bf16" else lanes * 2)
    threads = torch.get_num_threads()
    assert ops.multiply_add_peak(1) == threads * per_step
    assert ops.multiply_add_peak(1000) == 1000 * threads * per_step
    peak = MultiplyAddPeak([precision])
    assert precision in peak and peak.flops[precision] == MultiplyAddPeak.ITERATIONS * threads * per_step
    with pytest.raises(RuntimeError, match="positive iteration count"):
        ops.multiply_add_peak(0)

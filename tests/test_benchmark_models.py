"""benchmarks/models.py: every model timed in the memory format a trial runs it in."""

from __future__ import annotations

import warnings

from benchmarks.models import NCHW, run_group

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

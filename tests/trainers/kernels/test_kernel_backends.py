"""Every kernel backend available here equals the reference path: each op of `trainers.kernels`
(through the family layer that calls it) x each backend this machine has x dtype, forward and,
where the backend has one, backward, against the same layer with the kernels switched off (the
family's reference math on torch ops). And with the switch off every family's nano variant trains
a step without any backend running, in this process (`set_enabled(False)`) and in a fresh one
(``LOCALITY_SEARCH_CPU_KERNELS=0``), to the result it trains to with them on."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterator

import pytest
import timm
import torch

import trainers.models  # noqa: F401  (registers the ls_* families)
from tests._layers import OpCalls, run_layer
from trainers import kernels
from trainers.kernels import _gpsa, _gpsa_triton, _library, _linear, _norm
from trainers.models._common import MHSA
from trainers.models.ls_convit import GPSA
from trainers.models.ls_gmm import GMMAttention
from trainers.models.ls_refiner import RefinedAttention

REPO = Path(__file__).resolve().parents[3]
FP32_LIBRARY, BF16_LIBRARY = "locality_search_fp32.", "locality_search."
ONEDNN = "mkldnn._linear_pointwise"


def _layer(op: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The family layer that calls `op`, its parameters moved off their init, and its input shape."""
    torch.manual_seed(0)
    layer, shape = {
        "gated_attention": lambda: (GPSA(32, num_heads=4), (4, 49, 32)),
        "masked_attention": lambda: (GMMAttention(32, num_heads=4, num_kernels=2), (4, 49, 32)),
        "refine_maps": lambda: (RefinedAttention(32, 4, (7, 7), ratio=2, kernel_size=3), (4, 50, 32)),
        "plain_attention": lambda: (MHSA(32, num_heads=4), (4, 50, 32)),
        "linear": lambda: (kernels.Linear(32, 96), (4, 49, 32)),
        "layer_norm": lambda: (kernels.LayerNorm(32), (4, 49, 32)),
    }[op]()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer, shape


def _library_or_skip(dtype: torch.dtype) -> None:
    if kernels.cpu_library(dtype) is None:  # the compiler failed (the CPU's markers passed)
        pytest.skip(f"the {dtype} kernel library is not built here: {kernels.cpu_library_error(dtype)}")


@contextlib.contextmanager
def _backend(name: str, monkeypatch: pytest.MonkeyPatch, *, bf16: bool,
             linear: bool) -> Iterator[Callable[[dict], bool]]:
    """Sets up backend `name` and yields a check of the ops a call dispatched: whether it ran there."""
    if name == "fp32_library":
        _library_or_skip(torch.float32)
        if linear:  # the weight gradient's kernel, under the float32 linears on oneDNN
            monkeypatch.setattr(_linear, "onednn_beats_mkl_here", lambda: True)
            monkeypatch.setattr(_linear, "MIN_MULTIPLY_ADDS", 0)
        yield lambda calls: any(op.startswith(FP32_LIBRARY) for op in calls)
    elif name == "bf16_library":
        _library_or_skip(torch.bfloat16)
        with kernels.backends(bf16_kernel_linear=False):  # its linear: test_linear.py
            yield lambda calls: any(op.startswith(BF16_LIBRARY) for op in calls)
    elif name == "torch_ops":  # the kernels on, their libraries off: the explicit core, heads-first inference
        # bf16 linears too where they beat oneDNN (a Zen 4): a library
        with kernels.backends(libraries=False, onednn_fp32=False, bf16_kernel_linear=False):
            yield lambda calls: not any(op.startswith((FP32_LIBRARY, BF16_LIBRARY)) for op in calls)
    elif name == "sdpa":  # GPSA's GPU path (fused SDPA + P @ V), forced on the CPU
        monkeypatch.setattr(_gpsa, "takes_cpu_core", lambda x: False)
        yield lambda calls: "aten._scaled_dot_product_flash_attention_for_cpu" in calls
    elif name == "onednn":  # linears on oneDNN, float32 as on the CPUs where it beats MKL
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            pytest.skip("this torch has no oneDNN linear op")
        if bf16 and not kernels.onednn_runs_bf16_here():
            pytest.skip("torch runs no bf16 products on oneDNN on this CPU")
        monkeypatch.setattr(_linear, "onednn_beats_mkl_here", lambda: True)
        monkeypatch.setattr(_linear, "MIN_MULTIPLY_ADDS", 0)
        with kernels.backends(bf16_kernel_linear=False):  # bf16 linears on oneDNN, not the kernel's
            yield lambda calls: ONEDNN in calls
    else:
        raise AssertionError(name)


_AVX2, _BF16 = [pytest.mark.avx2], [pytest.mark.avx512, pytest.mark.avx512_bf16]
BOTH, INFER, TRAIN = (False, True), (False,), (True,)
# (op, backend, its markers, precision: float32 or bf16 under CPU autocast, inference and/or training:
# where the backend runs that op; elsewhere the op keeps the reference's torch ops)
BACKENDS = [
    ("gated_attention", "fp32_library", _AVX2, "fp32", BOTH),  # the fused layer
    ("gated_attention", "bf16_library", _BF16, "bf16", BOTH),
    ("gated_attention", "torch_ops", [], "fp32", BOTH),  # heads-first inference, the explicit core
    ("gated_attention", "torch_ops", [], "bf16", BOTH),
    ("gated_attention", "sdpa", [], "fp32", BOTH),
    ("masked_attention", "fp32_library", _AVX2, "fp32", BOTH),
    ("masked_attention", "bf16_library", _BF16, "bf16", BOTH),
    ("refine_maps", "fp32_library", _AVX2, "fp32", BOTH),
    ("refine_maps", "fp32_library", _AVX2, "bf16", INFER),  # float32 maps under autocast
    ("plain_attention", "fp32_library", _AVX2, "fp32", BOTH),
    ("plain_attention", "bf16_library", _BF16, "bf16", BOTH),
    ("plain_attention", "torch_ops", [], "bf16", TRAIN),  # SDPA in float32 for a bf16 backward
    ("linear", "onednn", [], "fp32", BOTH),
    ("linear", "onednn", [], "bf16", INFER),
    ("linear", "fp32_library", _AVX2, "fp32", TRAIN),  # the weight gradient
    ("layer_norm", "fp32_library", _AVX2, "fp32", INFER),
    ("layer_norm", "bf16_library", _BF16, "bf16", INFER),
]
CASES = [pytest.param(op, backend, precision, train, marks=marks,
                      id=f"{op}-{backend}-{precision}-{'train' if train else 'infer'}")
         for op, backend, marks, precision, trains in BACKENDS for train in trains]
# relative to the reference's largest value: float32 sums in another order; bf16 rounds differently
TOLERANCE = {"fp32": 2e-5, "bf16": 3e-2}


@pytest.mark.parametrize("op, backend, precision, train", CASES)
def test_every_backend_here_equals_the_reference_path(op, backend, precision, train, monkeypatch):
    layer, shape = _layer(op)
    layer.train(train)
    x = torch.randn(*shape)
    upstream = torch.linspace(-1, 1, shape[-1] if op != "linear" else 96)
    bf16 = precision == "bf16"
    with _backend(backend, monkeypatch, bf16=bf16, linear=op == "linear") as ran_there:
        with OpCalls() as ops:
            got = run_layer(layer, x, dtype=torch.float32, bf16=bf16, train=train, upstream=upstream)
        assert ran_there(ops.calls), sorted(ops.calls)
    kernels.set_enabled(False)
    try:
        with OpCalls() as ops:
            want = run_layer(copy.deepcopy(layer), x, dtype=torch.float32, bf16=bf16, train=train, upstream=upstream)
        assert not any(name.startswith((FP32_LIBRARY, BF16_LIBRARY, ONEDNN)) for name in ops.calls)
    finally:
        kernels.set_enabled(True)
    names = ["out", "x"] + [name for name, _ in layer.named_parameters()]
    largest = max(b.abs().max().item() for b in want)
    for name, a, b in zip(names, got, want):
        # a floor: P's bias has a zero gradient (softmax is shift-invariant), rounding noise on both sides
        scale = max(b.abs().max().item(), 0.1 * largest)
        error = (a.float() - b.float()).abs().max().item() / scale
        assert error <= TOLERANCE[precision], (name, error)


def test_the_triton_backend_is_marked_and_used_where_there(monkeypatch):
    """On a GPU with Triton: GPSA's inference in bf16 runs the Triton kernel and agrees with the
    reference formula (the kernel's own tests: test_gpsa_triton.py)."""
    if _gpsa_triton._triton() is None or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and Triton")  # (the `triton` marker where the suite carries it)
    layer, shape = _layer("gated_attention")
    layer = layer.cuda().eval()
    x = torch.randn(*shape, device="cuda")
    calls = []
    kernel = _gpsa_triton.gated_attention_inference
    monkeypatch.setattr(_gpsa_triton, "gated_attention_inference", lambda *a: calls.append(1) or kernel(*a))
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        got = layer(x).float()
        kernels.set_enabled(False)
        try:
            want = layer(x).float()
        finally:
            kernels.set_enabled(True)
    assert calls == [1]
    assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item()


NANO = ["ls_convit_nano", "ls_gmm_nano", "ls_refiner_nano", "ls_tcnn_nano"]

# one AdamW step of a nano model on a fixed batch; prints the loss before and the logits after
TRAIN_STEP = """
    import json, sys
    import timm, torch
    import trainers.models
    from trainers import kernels
    losses = {}
    for variant in sys.argv[1:]:
        torch.manual_seed(0)
        model = timm.create_model(variant)
        x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            after = model.eval()(x)
        losses[variant] = [loss.item(), after.flatten().tolist()]
    print(json.dumps({"enabled": kernels.enabled(), "losses": losses}))
"""


def _train_steps(env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(TRAIN_STEP), *NANO], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _forbid_every_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel entry point the families call, and every backend below them, raises if called."""
    def forbidden(name: str):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} ran with the kernels switched off")
        return call

    for name in ("gated_attention", "masked_attention", "masked_attention_usable", "refine_maps",
                 "refine_maps_usable", "plain_attention", "add_and_norm", "add_residual"):
        monkeypatch.setattr(kernels, name, forbidden(f"kernels.{name}"))
    monkeypatch.setattr(kernels.KeptValues, "keep", forbidden("KeptValues.keep"))
    monkeypatch.setattr(_library, "cpu_library", forbidden("_library.cpu_library"))
    monkeypatch.setattr(_linear, "_onednn", forbidden("_linear._onednn"))
    monkeypatch.setattr(_norm, "_norm_kernel", forbidden("_norm._norm_kernel"))
    monkeypatch.setattr(_gpsa_triton, "gated_attention_inference", forbidden("the Triton kernel"))


@pytest.mark.parametrize("variant", NANO)
def test_switched_off_every_family_trains_on_its_reference_path(variant, monkeypatch):
    def step() -> tuple[float, torch.Tensor]:
        torch.manual_seed(0)
        model = timm.create_model(variant)
        x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            return loss.item(), model.eval()(x)

    on_loss, on_logits = step()
    with monkeypatch.context() as m:
        kernels.set_enabled(False)
        try:
            _forbid_every_backend(m)
            with OpCalls() as ops:
                off_loss, off_logits = step()
        finally:
            kernels.set_enabled(True)
    assert not any(name.startswith((FP32_LIBRARY, BF16_LIBRARY, ONEDNN)) for name in ops.calls)
    assert off_loss == pytest.approx(on_loss, rel=1e-5)
    torch.testing.assert_close(off_logits, on_logits, rtol=1e-4, atol=1e-5)


def test_the_environment_variable_switches_every_backend_off(tmp_path):
    """``LOCALITY_SEARCH_CPU_KERNELS=0`` in a fresh process: `enabled()` is False, no library is
    built, and every nano family trains its step to what it trains to with the kernels on."""
    off = _train_steps({"LOCALITY_SEARCH_CPU_KERNELS": "0", "XDG_CACHE_HOME": str(tmp_path)})
    on = _train_steps()
    assert off["enabled"] is False and on["enabled"] is True
    assert not (tmp_path / "locality-search" / "kernels").exists()
    for variant in NANO:
        (off_loss, off_logits), (on_loss, on_logits) = off["losses"][variant], on["losses"][variant]
        assert off_loss == pytest.approx(on_loss, rel=1e-5), variant
        torch.testing.assert_close(torch.tensor(off_logits), torch.tensor(on_logits), rtol=1e-4, atol=1e-5)


def test_the_switch_takes_only_a_bool():
    with pytest.raises(TypeError, match="pass True or False"):
        kernels.set_enabled(0)
    assert kernels.enabled()


def test_backends_switches_for_the_block_and_restores_the_selection_it_found():
    """`kernels.backends` changes only the backends it names, nests, and on exit (also on an
    exception) brings back the selection it found, whatever that was."""
    default = kernels.selected_backends()
    assert default == kernels.Backends() and all(vars(default).values())  # every backend on by default
    with kernels.backends(libraries=False, fused_gelu=False) as outer:
        assert kernels.selected_backends() == outer
        assert not outer.libraries and not outer.fused_gelu and outer.norm_kernel
        with kernels.backends(libraries=True, norm_kernel=False) as inner:
            assert inner.libraries and not inner.fused_gelu and not inner.norm_kernel
        assert kernels.selected_backends() == outer
        with pytest.raises(ZeroDivisionError):
            with kernels.backends(triton=False):
                assert not kernels.selected_backends().triton
                1 / 0
        assert kernels.selected_backends() == outer
    assert kernels.selected_backends() == default
    with kernels.backends():  # nothing named: the selection as it is
        assert kernels.selected_backends() == default


def test_backends_refuses_an_unknown_name_or_a_value_not_a_bool_before_changing_anything():
    with pytest.raises(TypeError, match="no backend named 'onednn'; the backends are libraries, "):
        kernels.backends(onednn=False, libraries=False)
    with pytest.raises(TypeError, match=r"backends\(libraries=0\): pass True or False"):
        kernels.backends(libraries=0)
    assert kernels.selected_backends() == kernels.Backends()


def test_a_build_reads_its_sources_from_its_cache_folder_whatever_the_checkout(tmp_path):
    # ninja's build file names the source's path: two checkouts of one source must name the same one
    for checkout in ("one", "two"):
        (tmp_path / checkout).mkdir()
        (tmp_path / checkout / "core.cpp").write_text('#include "core.h"\nint f() { return 1; }\n')
        (tmp_path / checkout / "core.h").write_text("#pragma once\n")
    build = tmp_path / "cache" / "core_fp32_0123"
    build.mkdir(parents=True)
    first = _library._staged(tmp_path / "one" / "core.cpp", build)
    mtime = first.stat().st_mtime_ns
    assert _library._staged(tmp_path / "two" / "core.cpp", build) == first == build / "core.cpp"
    assert first.stat().st_mtime_ns == mtime  # the same bytes: not rewritten (ninja would rebuild)
    assert (build / "core.h").read_text() == "#pragma once\n"
    assert sorted(p.name for p in build.iterdir()) == ["core.cpp", "core.h"]  # no temporary left

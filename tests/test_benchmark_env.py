"""Where benchmark results go, and which precisions a benchmark times unless told."""
import torch

from benchmarks._env import bf16_by_default, environment, result_slug


def test_cpu_result_names_carry_the_instruction_set():
    # One VM model name ("AMD EPYC") covers CPUs generations apart: the ISA keeps their JSONs apart.
    env = {"device": "cpu", "device_name": "AMD EPYC", "cpu_capability": "AVX512"}
    assert result_slug(env) == "amd-epyc-avx512"
    assert result_slug({**env, "cpu_capability": "AVX2"}) == "amd-epyc-avx2"
    assert result_slug({"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
                        "cpu_capability": "AVX512"}) == "nvidia-h100-80gb-hbm3"
    here = environment("cpu")
    assert result_slug(here).endswith("-" + torch.backends.cpu.get_cpu_capability().lower())


def test_bf16_columns_are_off_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN capped below bf16: emulated
    on, why = bf16_by_default("cpu")
    assert not on and "emulated" in why
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    from trainers._cpu import cpu_has_native_bf16
    assert bf16_by_default("cpu") == (cpu_has_native_bf16(), "" if cpu_has_native_bf16() else why)

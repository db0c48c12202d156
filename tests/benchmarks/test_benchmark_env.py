"""Where benchmark results go, which precisions a benchmark times unless told, and how it parses
its arguments."""
import argparse

import pytest
import torch

from benchmarks import _env
from benchmarks._env import (add_malloc_option, bf16_by_default, environment, parse_and_set_up, result_slug,
                             shuffled_rounds)


def test_cpu_result_names_carry_the_instruction_set_and_a_nameless_cpus_family():
    # One VM model name ("AMD EPYC") covers CPUs generations apart: the ISA and the family (Zen 3
    # and 4: 25, Zen 5: 26) keep their JSONs apart.
    env = {"device": "cpu", "device_name": "AMD EPYC", "cpu_capability": "AVX512", "cpu_family": 26}
    assert result_slug(env) == "amd-epyc-avx512-fam26"
    assert result_slug({**env, "cpu_family": 25}) == "amd-epyc-avx512-fam25"
    assert result_slug({**env, "cpu_capability": "AVX2", "cpu_family": 25}) == "amd-epyc-avx2-fam25"
    assert result_slug({**env, "cpu_family": None}) == "amd-epyc-avx512"
    # a model number names the CPU already
    assert result_slug({**env, "device_name": "AMD EPYC 9654 96-Core Processor"}) == "amd-epyc-9654-96-core-processor-avx512"
    assert result_slug({"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
                        "cpu_capability": "AVX512", "cpu_family": 25}) == "nvidia-h100-80gb-hbm3"
    here = environment("cpu")
    assert torch.backends.cpu.get_cpu_capability().lower() in result_slug(here)
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        family_line = next((line for line in f if line.startswith("cpu family")), None)
    if family_line is not None:
        assert here["cpu_family"] == int(family_line.split(":")[1])


def test_bf16_columns_are_off_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN capped below bf16: emulated
    on, why = bf16_by_default("cpu")
    assert not on and "emulated" in why
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    from trainers import cpu_has_native_bf16
    assert bf16_by_default("cpu") == (cpu_has_native_bf16(), "" if cpu_has_native_bf16() else why)


def _parser(**device_kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", **device_kwargs)
    add_malloc_option(parser)
    return parser


def test_arguments_set_the_process_up_unless_the_default_malloc_is_asked_for(monkeypatch):
    asked = []
    monkeypatch.setattr(_env, "setup_process", lambda *, retain_memory: asked.append(retain_memory))
    parse_and_set_up(_parser(default="cpu"), [])
    parse_and_set_up(_parser(default="cpu"), ["--glibc-default-malloc"])
    assert asked == [True, False]


@pytest.mark.parametrize("device_kwargs, argv", [(dict(default="cpu"), ["--device", "cuda"]),
                                                 (dict(action="append"), ["--device", "cpu", "--device", "cuda"])])
def test_cuda_asked_for_where_there_is_none_is_a_usage_error(device_kwargs, argv, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, also on a GPU
    with pytest.raises(SystemExit) as exit_info:
        parse_and_set_up(_parser(**device_kwargs), argv)
    assert exit_info.value.code == 2
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err


def test_rounds_time_every_contender_once_each_in_changing_orders_the_same_from_run_to_run():
    contenders = ["timm", "ours", "floor", "ours_torch_ops", "ours_recomputing"]
    rounds = list(shuffled_rounds(contenders, 40))
    assert len(rounds) == 40 and all(sorted(r) == sorted(contenders) for r in rounds)
    assert rounds == list(shuffled_rounds(contenders, 40))  # seeded
    assert rounds != list(shuffled_rounds(contenders, 40, seed=1))
    # no contender always runs right after the same other (a fixed or shifted order would)
    before = {name: {r[r.index(name) - 1] for r in rounds if r.index(name) > 0} for name in contenders}
    assert all(len(others) >= 3 for others in before.values()), before
    assert list(shuffled_rounds(["a"], 3)) == [["a"]] * 3 and list(shuffled_rounds(contenders, 0)) == []

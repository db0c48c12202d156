"""The training loop without Ray: schedule, reports, early stopping, NaN, checkpoint/resume."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import time

import pytest
import timm
import torch

from trainers.config import SettingError, ThroughputSettings, TrainSettings, TrialConfig
from trainers.data import DatasetRequest, prepare_dataset
from trainers.train import NonFiniteLossError, adamw, evaluate, lr_at, train_trial

FAST_THROUGHPUT = ThroughputSettings(batch_size=16, warmup=1, repeats=2)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return prepare_dataset(DatasetRequest(name="synthetic", val_fraction=0.2), cache_dir=tmp_path_factory.mktemp("cache"))


def _config(data, **train) -> TrialConfig:
    # On the CPU, also on a machine with a GPU: these tests check the CPU's paths (its
    # precision, its reference model, its warnings); the CUDA tests ask for "cuda" themselves.
    epochs = train.pop("epochs", 2)
    patience = train.pop("patience", None)
    settings = TrainSettings(**{"batch_size": 64, "num_workers": 1, "warmup_epochs": 0.5, **train})
    return TrialConfig(model="ls_convit_nano", model_args={}, data=data, epochs=epochs, train=settings,
                       throughput=FAST_THROUGHPUT, patience=patience, seed=0, device="cpu")


def test_lr_schedule():
    kw = dict(total_steps=100, warmup_steps=10, peak_lr=1.0, min_lr=0.01)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(55, **kw) == pytest.approx(0.01 + 0.99 * 0.5)
    assert lr_at(100, **kw) == pytest.approx(0.01)
    after = [lr_at(s, **kw) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert lr_at(0, total_steps=10, warmup_steps=0, peak_lr=1.0, min_lr=0.0) == pytest.approx(1.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_evaluate_matches_a_per_image_reference(device):
    # The same mean loss and accuracy as scoring each image on its own, over uneven batches;
    # nothing for no batches.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5)).to(device)
    batches = [(torch.randn(n, 3, 2, 2, device=device), torch.randint(0, 5, (n,), device=device)) for n in (7, 7, 3)]
    no_autocast = lambda: torch.autocast(device, enabled=False)  # noqa: E731
    loss, acc = evaluate(model, batches, autocast=no_autocast)
    assert model.training  # left in training mode
    with torch.no_grad():
        per_image = [(torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).item(),
                      int(model(x[i:i + 1]).argmax()) == int(y[i])) for x, y in batches for i in range(len(y))]
    assert loss == pytest.approx(sum(l for l, _ in per_image) / 17, rel=1e-5)
    assert acc == sum(c for _, c in per_image) / 17 and isinstance(acc, float) and isinstance(loss, float)
    assert evaluate(model, [], autocast=no_autocast) == (0.0, 0.0)


def test_reports_once_per_epoch(synthetic):
    reports = []
    outcome = train_trial(_config(synthetic), on_epoch=lambda m, state: reports.append(m))
    assert [m["epoch"] for m in reports] == [1, 2]
    assert outcome.epochs_run == 2 and outcome.stop_reason == "max_epochs"
    assert reports[-1]["stop_reason"] == "max_epochs" and "stop_reason" not in reports[0]
    for m in reports:
        assert 0.0 <= m["val_acc"] <= 1.0 and math.isfinite(m["train_loss"])
        assert m["throughput"] > 0 and m["params"] > 0 and m["flops"] > 0
        assert m["throughput_batch"] == 16 and m["throughput_device"].startswith("cpu")
        assert m["throughput_reference"] and m["throughput_timed"] > 0  # timed beside the model as named
        assert m["family"] == "convit"
    assert outcome.best_val_acc == max(m["val_acc"] for m in reports)
    assert reports[0]["lr"] > reports[1]["lr"]  # cosine decay
    # ls_convit_nano's one GPSA block reports its 4 gates after each epoch: moved from sigmoid(1) by training
    reported = [m["mechanisms"] for m in reports]
    gates = [{k: v for k, v in r.items() if k.startswith("gate.")} for r in reported]
    assert all(set(g) == {f"gate.0.{h}" for h in range(4)} for g in gates)
    assert all(0 < v < 1 for g in gates for v in g.values())
    # and each block's heads' nonlocality on the first validation images (at most the grid's diagonal)
    depth = len(timm.create_model("ls_convit_nano").blocks)
    for r in reported:
        nonlocality = {k: v for k, v in r.items() if k.startswith("nonlocality.")}
        assert {k.split(".")[1] for k in nonlocality} == {str(b) for b in range(depth)}
        assert all(0 < v < math.hypot(6, 6) for v in nonlocality.values())
    assert any(abs(v - 1 / (1 + math.exp(-1))) > 1e-6 for v in gates[-1].values()) and gates[0] != gates[1]


def test_training_step_is_the_step_train_trial_takes(synthetic):
    """trainers.training_step (what benchmarks/trial_overhead.py times on its own) over the trial's
    own batches (trainers.trial_loaders) trains as train_trial's first epoch does: its losses and
    its learning rate."""
    from trainers import build_model, pick_device, place_model, training_step, trial_loaders

    cfg = _config(synthetic, epochs=2)
    torch.manual_seed(cfg.seed)  # as train_trial, before it builds the model
    device = pick_device(cfg.device)
    model = build_model(cfg)
    train, _ = trial_loaders(cfg, device=device, channels_last=place_model(model, device))
    step = training_step(model, cfg, device, steps_per_epoch=len(train))
    losses = [float(step(images, labels, at=i).detach()) for i, (images, labels) in enumerate(train)]
    first = train_trial(cfg).history[0]
    assert sum(losses) / len(losses) == pytest.approx(first["train_loss"], rel=1e-5)
    assert step.lr == pytest.approx(first["lr"]) and not step.graphed  # on the CPU: eager


@pytest.mark.parametrize("constraints", [(), ("params <= 1e9",)], ids=["after_first_epoch", "before_training"])
def test_throughput_is_measured_after_the_first_epoch_unless_needed_before(synthetic, monkeypatch, constraints):
    """Without constraints the number is first needed in the first report, so the architecture is
    timed after that epoch (not beside a study's start-up); constraints judge it before training."""
    from trainers import train as train_module
    from trainers.config import Constraint

    timed = []  # per measurement: whether the model it timed had trained already

    def measure_model(model, **kwargs):
        torch.manual_seed(0)
        untrained = timm.create_model("ls_convit_nano", num_classes=synthetic.num_classes,
                                      in_chans=synthetic.channels, img_size=synthetic.image_size)
        timed.append(any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                untrained.state_dict().values())))
        return real_measure_model(model, **kwargs)

    real_measure_model = train_module.measure_model
    monkeypatch.setattr(train_module, "measure_model", measure_model)
    cfg = _config(synthetic)
    cfg = dataclasses.replace(cfg, constraints=tuple(Constraint.parse(c) for c in constraints))
    reports = []
    train_trial(cfg, on_epoch=lambda m, state: reports.append(m))
    assert timed == [bool(not constraints)]  # once per trial, after training began or before it
    assert [m["epoch"] for m in reports] == [1, 2] and all(m["throughput"] > 0 for m in reports)
    assert reports[0]["throughput"] == reports[1]["throughput"]


def test_the_first_epoch_waits_for_nothing_but_the_model_and_its_loaders(synthetic, monkeypatch):
    """Without constraints nothing is timed before training: the loaders are made and the first
    batch trained before the one measurement; a broken constraint rejects the config before any
    loader exists (no data is read for a config that will not train)."""
    from trainers import train as train_module
    from trainers.config import Constraint

    events = []
    real_measure_model, real_make_loader = train_module.measure_model, train_module.make_loader
    monkeypatch.setattr(train_module, "measure_model",
                        lambda model, **kw: events.append("measure") or real_measure_model(model, **kw))
    monkeypatch.setattr(train_module, "make_loader",
                        lambda path, **kw: events.append("loader") or real_make_loader(path, **kw))
    reports = []
    train_trial(_config(synthetic, epochs=2), on_epoch=lambda m, state: reports.append(events.copy()))
    assert events == ["loader", "loader", "measure"] and reports[0] == events  # measured once, before epoch 1's report
    events.clear()
    cfg = dataclasses.replace(_config(synthetic), constraints=(Constraint.parse("params <= 10"),))
    outcome = train_trial(cfg, on_epoch=lambda m, state: reports.append(m))
    assert outcome.stop_reason == "constraint" and outcome.epochs_run == 0
    assert events == ["measure"] and reports[-1]["epoch"] == 0 and "params=" in reports[-1]["rejected"]


def test_a_reference_that_does_not_build_leaves_the_model_timed_on_its_own(synthetic, monkeypatch):
    """The reference is the model with default arguments; where those fail for the dataset, the
    trial still trains and is measured alone, with a warning saying why."""
    from trainers import train as train_module

    real_build = train_module.build_model

    def build_model(cfg):
        if not cfg.model_args:
            raise ValueError("img_size 32 is not a multiple of patch_size 7")
        return real_build(cfg)

    monkeypatch.setattr(train_module, "build_model", build_model)
    monkeypatch.setattr(train_module, "_references", {})  # none built yet in this process
    cfg = dataclasses.replace(_config(synthetic, epochs=1), model_args={"depth": 2})
    reports = []
    with pytest.warns(UserWarning, match="default arguments does not build here.*without a reference"):
        train_trial(cfg, on_epoch=lambda m, state: reports.append(m))
    assert reports[0]["throughput"] > 0 and reports[0]["throughput_reference"] is None
    assert reports[0]["throughput"] == reports[0]["throughput_timed"]


def test_the_reference_is_built_once_per_process(synthetic, monkeypatch):
    """Ray reuses its actors between trials: the reference model is built by the first trial that
    measures, not again by every trial after it."""
    from trainers import train as train_module

    real_build, built = train_module.build_model, []

    def build_model(cfg):
        built.append(dict(cfg.model_args))
        return real_build(cfg)

    monkeypatch.setattr(train_module, "build_model", build_model)
    monkeypatch.setattr(train_module, "_references", {})
    for depth in (2, 3):
        train_trial(dataclasses.replace(_config(synthetic, epochs=1), model_args={"depth": depth}))
    assert built == [{"depth": 2}, {}, {"depth": 3}]  # the reference ({}): once


def test_trial_optimizer_is_fused_adamw_and_steps_as_the_reference_adamw(synthetic):
    states = []
    train_trial(_config(synthetic, epochs=1), on_epoch=lambda m, get_state: states.append(get_state()))
    assert all(group["fused"] for group in states[0]["optimizer"]["param_groups"])
    # the fused kernel against torch's per-tensor loop: three steps from the same weights, given the
    # same gradients (gradients recomputed on weights a rounding apart would move Adam's update by a
    # lot wherever a gradient is near eps)
    torch.manual_seed(0)
    models = [timm.create_model("ls_convit_nano") for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [adamw(models[0].param_groups(weight_decay=0.05), lr=1e-2),
                  torch.optim.AdamW(models[1].param_groups(weight_decay=0.05), lr=1e-2, foreach=False)]
    for _ in range(3):
        x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
        models[0].zero_grad()
        torch.nn.functional.cross_entropy(models[0](x), y).backward()
        for fused, reference in zip(models[0].parameters(), models[1].parameters()):
            reference.grad = fused.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    moved = [(a - b).abs().max().item() for a, b in zip(models[0].parameters(), timm.create_model(
        "ls_convit_nano").parameters())]
    assert max(moved) > 1e-3  # the steps did something
    for (name, fused), reference in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mismatch", ["gradient", "moments"])
def test_fused_adamw_updates_a_channels_last_weight_whatever_the_layout_of_its_gradient_or_moments(mismatch):
    """torch's fused AdamW walks parameter, gradient and moments as flat arrays: `adamw` gives them
    one layout first (an NCHW checkpoint resumed into a channels_last model; a gradient set by hand)."""
    torch.manual_seed(0)
    start, grads = torch.randn(16, 8, 3, 3), [torch.randn(16, 8, 3, 3) for _ in range(2)]

    def run(make, *, channels_last: bool, grads, state=None):
        weight = start.clone().contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        weight.requires_grad_(True)
        optimizer = make([weight])
        if state is not None:
            optimizer.load_state_dict(copy.deepcopy(state))
        for grad in grads:
            weight.grad = grad.clone()  # NCHW, as given: channels_last weights get a mismatched gradient
            optimizer.step()
        return weight.detach(), optimizer.state_dict()

    fused = lambda params: adamw([{"params": params}], lr=0.1)
    reference = lambda params: torch.optim.AdamW(params, lr=0.1, foreach=False)
    if mismatch == "gradient":
        out, _ = run(fused, channels_last=True, grads=grads)
        ref, _ = run(reference, channels_last=False, grads=grads)
    else:  # one step on an NCHW weight, saved; resumed into a channels_last one with gradients of its layout
        _, saved = run(fused, channels_last=False, grads=grads[:1])
        assert saved["param_groups"][0]["fused"]
        later = [g.contiguous(memory_format=torch.channels_last) for g in grads[1:]]
        out, _ = run(fused, channels_last=True, grads=later, state=saved)
        ref, _ = run(reference, channels_last=False, grads=grads[1:], state=saved)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_any_model_implementing_the_conversion_hook_is_converted_at_its_epoch(synthetic, monkeypatch):
    """trainers.hooks.ConvertsDuringTraining is the whole contract between the loop and a model that
    converts mid-training (not the T-CNN's class): converted before the epoch it names, measured
    again, reported as converted, given a fresh optimizer. A model missing a method cannot be built."""
    from trainers import train as train_module
    from trainers.hooks import ConvertsDuringTraining

    class Widens(torch.nn.Module, ConvertsDuringTraining):  # a linear classifier that grows a hidden layer
        def __init__(self, features: int, classes: int):
            super().__init__()
            self.features, self.classes, self.asked = features, classes, []
            self.head = torch.nn.Linear(features, classes)

        def forward(self, x):
            return self.head(x.flatten(1))

        def reparam_epoch_for(self, total_epochs):
            self.asked.append(total_epochs)
            return 1

        def reparametrise(self):
            self.head = torch.nn.Sequential(torch.nn.Linear(self.features, 64), torch.nn.ReLU(),
                                            torch.nn.Linear(64, self.classes))
            self.is_reparametrised = True
            return ["head"]

    built = []

    def build_model(cfg):
        built.append(Widens(cfg.data.channels * cfg.data.image_size ** 2, cfg.data.num_classes))
        return built[-1]

    monkeypatch.setattr(train_module, "build_model", build_model)
    monkeypatch.setattr(train_module, "_references", {})
    states = {}
    history = train_trial(_config(synthetic, epochs=2),
                          on_epoch=lambda m, get_state: states.__setitem__(m["epoch"], get_state())).history
    assert built[0].asked == [2] and built[0].is_reparametrised
    assert [m["converted"] for m in history] == [False, True]
    assert "converted_at_epoch" not in history[0] and history[1]["converted_at_epoch"] == 1
    assert history[1]["params"] > history[0]["params"]
    assert history[1]["throughput_before_conversion"] == history[0]["throughput"]
    assert [states[e]["reparametrised"] for e in (1, 2)] == [False, True]
    assert {float(s["step"]) for s in states[2]["optimizer"]["state"].values()} == {float(
        synthetic.counts["train"] // 64)}  # 'fresh', the default: every parameter restarted after it

    class Incomplete(torch.nn.Module, ConvertsDuringTraining):
        def reparam_epoch_for(self, total_epochs):
            return 0

    with pytest.raises(TypeError, match="abstract method.*reparametrise"):
        Incomplete()


def test_patience_stops_a_flat_trial(synthetic):
    # A learning rate of ~0 leaves the model as it is: no epoch beats the first one.
    outcome = train_trial(_config(synthetic, epochs=6, patience=2, lr=1e-12, min_lr=0.0))
    assert outcome.stop_reason == "patience"
    assert outcome.epochs_run == 3
    assert outcome.history[-1]["stop_reason"] == "patience"


def test_nan_loss_fails_with_the_reason(synthetic):
    with pytest.raises(NonFiniteLossError, match="lower the learning rate"):
        train_trial(_config(synthetic, lr=1e30))


def test_checkpoint_resume_matches_an_uninterrupted_run(synthetic):
    saved = []

    def save(metrics, get_state):  # what the Tune adapter does: torch.save inside the callback
        buffer = io.BytesIO()
        torch.save(get_state(), buffer)
        saved.append(buffer.getvalue())

    full = train_trial(_config(synthetic, epochs=2), on_epoch=save)
    state = torch.load(io.BytesIO(saved[0]), weights_only=True)  # after epoch 1
    resumed = train_trial(_config(synthetic, epochs=2), resume=state)
    assert resumed.epochs_run == 2
    assert resumed.history[0] == full.history[0]
    assert resumed.history[1]["throughput"] == full.history[1]["throughput"]  # measured once, kept
    assert resumed.history[1]["val_acc"] == pytest.approx(full.history[1]["val_acc"], abs=1e-6)
    assert resumed.history[1]["train_loss"] == pytest.approx(full.history[1]["train_loss"], rel=1e-4)


def test_compiled_trial_trains_like_the_eager_one(synthetic):
    """train.compile runs the batches through torch.compile: the same training up to float
    rounding, and checkpoints of the model itself (no wrapper prefix in the keys)."""
    states = {}

    def keep(name):
        return lambda metrics, get_state: states.__setitem__(name, get_state())

    eager = train_trial(_config(synthetic, epochs=1), on_epoch=keep("eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with pytest.warns(UserWarning, match="meant for GPUs"):
        compiled = train_trial(_config(synthetic, epochs=1, compile=True), on_epoch=keep("compiled"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # training and validation graphs
    assert compiled.history[0]["train_loss"] == pytest.approx(eager.history[0]["train_loss"], rel=1e-3)
    assert compiled.history[0]["val_acc"] == pytest.approx(eager.history[0]["val_acc"], abs=0.02)
    assert compiled.history[0]["throughput"] > 0  # measured on the eager model, as without compile
    assert list(states["compiled"]["model"]) == list(states["eager"]["model"])


def test_compile_takes_true_false_or_a_torch_compile_mode(synthetic, monkeypatch):
    assert TrainSettings().compile_mode is None and TrainSettings(compile=True).compile_mode == "default"
    assert TrainSettings(compile="reduce-overhead").compile_mode == "reduce-overhead"
    for bad in ("fast", 1, None):
        with pytest.raises(SettingError, match="must be true, false or a torch.compile mode") as info:
            TrainSettings(compile=bad)
        assert info.value.key == "compile"
    # the mode reaches torch.compile (compiled here by aot_eager: the mode's own work is torch's)
    modes, compile_ = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: modes.append(mode) or compile_(model, backend="aot_eager"))
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="train.compile on a CPU.*meant for GPUs"):  # slower there: it says so
        train_trial(_config(synthetic, epochs=1, compile="max-autotune-no-cudagraphs"))
    torch._dynamo.reset()
    assert modes == ["max-autotune-no-cudagraphs"]


@pytest.mark.cuda
def test_cuda_graphed_trial_trains_like_the_eager_one(synthetic):
    """train.compile: reduce-overhead on a GPU (torch.compile's CUDA graphs; benchmarks/trial_overhead.py
    --compile reduce-overhead measures the gain): the same training up to bf16 rounding."""
    eager = train_trial(dataclasses.replace(_config(synthetic, epochs=2), device="cuda"))
    torch._dynamo.reset()
    graphed = train_trial(dataclasses.replace(_config(synthetic, epochs=2, compile="reduce-overhead"), device="cuda"))
    torch._dynamo.reset()
    for e, g in zip(eager.history, graphed.history):
        assert g["train_loss"] == pytest.approx(e["train_loss"], rel=2e-2)
        assert g["val_acc"] == pytest.approx(e["val_acc"], abs=0.05)


def test_epoch_reports_the_time_spent_waiting_for_batches(synthetic, monkeypatch):
    """train_loader_wait_s: the host's wait for the training loader's batches, part of the epoch's
    training time; a loader that takes 20 ms a batch makes the epoch wait at least that per step."""
    import trainers.train as train_module

    make_loader = train_module.make_loader
    delay_s, steps = 0.02, []

    class SlowLoader:
        def __init__(self, loader):
            self.loader = loader

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            for batch in self.loader:
                time.sleep(delay_s)
                steps.append(1)
                yield batch

    def slow_train_loader(path, **kwargs):
        loader = make_loader(path, **kwargs)
        return SlowLoader(loader) if kwargs.get("train") else loader

    fast = train_trial(_config(synthetic, epochs=1)).history[0]
    assert 0 <= fast["train_loader_wait_s"] <= fast["train_time_s"]
    monkeypatch.setattr(train_module, "make_loader", slow_train_loader)
    slow = train_trial(_config(synthetic, epochs=1)).history[0]
    assert len(steps) > 0 and delay_s * len(steps) <= slow["train_loader_wait_s"] <= slow["train_time_s"]
    assert slow["train_loss"] == pytest.approx(fast["train_loss"])  # the same batches, only later


def test_native_bf16_follows_the_cpu_and_onednn_cap(monkeypatch):
    from pathlib import Path

    from trainers import cpu_has_native_bf16

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # the kernel's flags, an independent reading of the same hardware
        flags = set(cpuinfo.read_text().split())
        assert cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})
    hardware = cpu_has_native_bf16()
    for cap in ("AVX2", "avx512_core", "AVX512_CORE_VNNI"):  # oneDNN capped below bf16: it would emulate
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert not cpu_has_native_bf16(), cap
    for cap in ("AVX512_CORE_BF16", "avx512_core_amx", "ALL"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert cpu_has_native_bf16() == hardware, cap


@pytest.mark.parametrize("precision,native_bf16,dtype", [
    ("fp32", True, torch.float32), ("bf16", False, torch.bfloat16),  # as asked, whatever the CPU
    ("auto", True, torch.bfloat16), ("auto", False, torch.float32),  # auto: bf16 only with bf16 hardware
])
def test_cpu_trial_trains_and_validates_in_the_requested_precision(synthetic, monkeypatch, precision, native_bf16,
                                                                   dtype):
    import trainers.precision
    import trainers.train as train_module

    monkeypatch.setattr(trainers.precision, "cpu_has_native_bf16", lambda: native_bf16)  # the CPU's bf16 hardware

    seen = {"train": set(), "validate": set()}
    validating = []
    build, evaluate = train_module.build_model, train_module.evaluate

    def record(module, inputs, out):  # the classifier's output dtype: what autocast made of the forward
        if module.training:
            seen["train"].add(out.dtype)
        elif validating:  # not the FLOP count or the throughput measurement
            seen["validate"].add(out.dtype)

    def recording_build(cfg):
        model = build(cfg)
        model.get_classifier().register_forward_hook(record)
        return model

    def recording_evaluate(*args, **kwargs):
        validating.append(True)
        try:
            return evaluate(*args, **kwargs)
        finally:
            validating.pop()

    monkeypatch.setattr(train_module, "build_model", recording_build)
    monkeypatch.setattr(train_module, "evaluate", recording_evaluate)
    outcome = train_trial(_config(synthetic, precision=precision))
    assert seen == {"train": {dtype}, "validate": {dtype}}
    assert {m["train_precision"] for m in outcome.history} == {"bf16" if dtype == torch.bfloat16 else "fp32"}
    # throughput.precision auto follows the same rule (trainers.precision), whatever the training's
    assert {m["throughput_precision"] for m in outcome.history} == {"bf16" if native_bf16 else "fp32"}
    assert all(math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"]) for m in outcome.history)
    assert outcome.history[-1]["train_loss"] < outcome.history[0]["train_loss"]

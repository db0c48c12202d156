"""train.cuda_graph: a trial's whole training step (forward, backward, clipping, AdamW) captured as
one CUDA graph (trainers/_cuda_graph.capture_train_step). Replays update the weights as eager steps
do; capturing changes nothing the training sees; a step that cannot be captured, or fp16, trains
eagerly with a warning; checkpoints resume anywhere; on the CPU the setting changes nothing."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import timm
import torch
import yaml
from torch import nn

import trainers.models  # noqa: F401  (registers the ls_* families)
import trainers.train as train_module
from tests.trainers.test_cuda_graph import _SyncsWithTheHost
from trainers._cuda_graph import capture_train_step
from trainers.config import SettingError, ThroughputSettings, TrainSettings, TrialConfig
from trainers.data import DatasetRequest, prepare_dataset
from trainers.hooks import param_groups
from trainers.train import adamw, capture_step, graphs_steps, set_lr, train_trial

FAST_THROUGHPUT = ThroughputSettings(batch_size=8, warmup=1, repeats=2)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return prepare_dataset(DatasetRequest(name="synthetic", val_fraction=0.2), cache_dir=tmp_path_factory.mktemp("cache"))


def _config(data, *, device: str = "cpu", epochs: int = 2, **train) -> TrialConfig:
    settings = TrainSettings(**{"batch_size": 64, "num_workers": 1, "warmup_epochs": 0.5, **train})
    return TrialConfig(model="ls_convit_nano", model_args={}, data=data, epochs=epochs, train=settings,
                       throughput=FAST_THROUGHPUT, seed=0, device=device)


def test_the_setting_is_checked(tmp_path):
    from search import load_spec

    assert TrainSettings().cuda_graph is False  # the default
    with pytest.raises(SettingError, match="must be true or false, got 'yes'"):
        TrainSettings(cuda_graph="yes")
    for mode in ("reduce-overhead", "max-autotune"):  # torch.compile's own CUDA graphs
        with pytest.raises(SettingError, match="use compile: true") as info:
            TrainSettings(cuda_graph=True, compile=mode)
        assert info.value.key == "cuda_graph"
    assert TrainSettings(cuda_graph=True, compile=True).compile_mode == "default"
    spec = {"name": "t", "dataset": {"name": "synthetic"}, "model": {"name": "ls_convit_nano"},
            "space": {"locality_strength": {"type": "uniform", "low": 0.5, "high": 2.0}},
            "objectives": [{"metric": "val_acc", "mode": "max"}], "budget": {"trials": 2, "max_epochs": 1},
            "train": {"cuda_graph": True}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert load_spec(path).train.cuda_graph is True
    path.write_text(yaml.safe_dump({**spec, "train": {"cuda_graph": "yes"}}))
    with pytest.raises(Exception, match=r"train\.cuda_graph: expected true or false"):
        load_spec(path)


def test_capture_needs_cuda_batches_and_a_capturable_optimizer():
    model = timm.create_model("ls_convit_nano")
    kwargs = dict(model=model, runner=model, criterion=nn.CrossEntropyLoss(), images=torch.zeros(2, 1, 28, 28),
                  labels=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="CUDA batches"):
        capture_train_step(optimizer=adamw(param_groups(model, 0.05), lr=1e-3, capturable=True), **kwargs)
    if torch.cuda.is_available():
        model.cuda()
        cuda_kwargs = {**kwargs, "images": kwargs["images"].cuda(), "labels": kwargs["labels"].cuda()}
        with pytest.raises(ValueError, match="capturable=True"):
            capture_train_step(optimizer=adamw(param_groups(model, 0.05), lr=1e-3), **cuda_kwargs)


def test_set_lr_scales_per_group_and_fills_tensor_lrs_in_place():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr_scale": 10.0}], lr=1.0)
    set_lr(optimizer, 0.5)
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 5.0]
    held = torch.tensor(1.0)
    optimizer.param_groups[1]["lr"] = held  # what a captured step's graph reads
    set_lr(optimizer, 0.25)
    assert optimizer.param_groups[0]["lr"] == 0.25
    assert optimizer.param_groups[1]["lr"] is held and held.item() == 2.5


def test_on_the_cpu_the_setting_changes_nothing(synthetic, monkeypatch):
    def no_capture(**kwargs):
        raise AssertionError("captured a training step on the CPU")

    monkeypatch.setattr(train_module, "capture_train_step", no_capture)
    assert not graphs_steps(TrainSettings(cuda_graph=True), torch.device("cpu"))
    eager = train_trial(_config(synthetic, epochs=1))
    graphed = train_trial(_config(synthetic, epochs=1, cuda_graph=True))
    assert graphed.history[0]["train_loss"] == eager.history[0]["train_loss"]
    assert graphed.history[0]["val_acc"] == eager.history[0]["val_acc"]


# ---- on a GPU ---------------------------------------------------------------------------------------

def _batches(n: int, shape: tuple[int, ...], classes: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, *shape, generator=gen).cuda(), torch.randint(0, classes, (16,), generator=gen).cuda())
            for _ in range(n)]


@pytest.mark.cuda
@pytest.mark.parametrize("grad_clip", [None, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name", ["ls_convit_nano", "ls_tcnn_nano"])  # attention; a CNN with BatchNorm
def test_replays_update_the_weights_as_eager_steps_do(name, grad_clip, monkeypatch):
    # cuDNN's default conv algorithms (TF32, split reductions) differ run to run in the last bits,
    # which AdamW's g / sqrt(v) blows up to lr-sized steps where a gradient is near 0
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = timm.create_model(name).cuda().train()
    reference = copy.deepcopy(model)
    optimizer = adamw(param_groups(model, 0.05), lr=1e-3, capturable=True)
    reference_optimizer = adamw(param_groups(reference, 0.05), lr=1e-3)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    batches = _batches(4, (model.in_chans if hasattr(model, "in_chans") else 1, 28, 28))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    step = capture_train_step(model=model, runner=model, criterion=criterion, optimizer=optimizer,
                              images=batches[0][0], labels=batches[0][1], grad_clip=grad_clip)
    # the warm-up's updates are undone: weights, BatchNorm's statistics, AdamW's moments and step
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in optimizer.state.values())

    for lr, (images, labels) in zip([1e-3, 5e-4, 2e-4, 1e-4], batches):  # the lr changes between replays
        set_lr(optimizer, lr)
        set_lr(reference_optimizer, lr)
        loss = step(images, labels).clone()
        reference_optimizer.zero_grad(set_to_none=True)
        expected = criterion(reference(images), labels)
        expected.backward()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(reference.parameters(), grad_clip)
        reference_optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-4, atol=1e-5)
    for (key, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5, msg=lambda message: f"{key}: {message}")
    with pytest.raises(ValueError, match="captured for batches of shape"):
        step(batches[0][0][:8], batches[0][1][:8])


@pytest.mark.cuda
def test_a_step_that_cannot_be_captured_trains_eagerly_and_says_so():
    model = _SyncsWithTheHost().cuda()
    before = [p.clone() for p in model.parameters()]
    optimizer = adamw(param_groups(model, 0.05), lr=1e-3, capturable=True)
    (images, labels), = _batches(1, (1, 28, 28))
    stream = torch.cuda.current_stream()
    with pytest.warns(UserWarning, match="cannot be captured.*trains eagerly"):
        assert capture_step(model=model, runner=model, criterion=nn.CrossEntropyLoss(), optimizer=optimizer,
                            images=images, labels=labels, settings=TrainSettings(cuda_graph=True)) is None
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # the process goes on as before: random ops, the same stream, an eager step
    assert torch.cuda.current_stream() == stream
    torch.randn(4, device="cuda").sum().item()
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.cuda
def test_fp16_trains_eagerly_and_says_so():
    with pytest.warns(UserWarning, match="fp16's loss scaling"):
        assert not graphs_steps(TrainSettings(cuda_graph=True, precision="fp16"), torch.device("cuda"))
    assert graphs_steps(TrainSettings(cuda_graph=True, precision="bf16"), torch.device("cuda"))


@pytest.mark.cuda
def test_a_graphed_trial_trains_like_the_eager_one_and_resumes(synthetic):
    eager = train_trial(_config(synthetic, device="cuda"))
    states = []
    graphed = train_trial(_config(synthetic, device="cuda", cuda_graph=True),
                          on_epoch=lambda metrics, get_state: states.append(copy.deepcopy(get_state())))
    for e, g in zip(eager.history, graphed.history, strict=True):
        assert g["train_loss"] == pytest.approx(e["train_loss"], rel=1e-2)
        assert g["val_acc"] == pytest.approx(e["val_acc"], abs=0.03)
    # its checkpoints hold the lr as numbers: they resume graphed, or eagerly
    assert all(isinstance(g["lr"], float) for g in states[0]["optimizer"]["param_groups"])
    for cuda_graph in (True, False):
        resumed = train_trial(_config(synthetic, device="cuda", cuda_graph=cuda_graph), resume=states[0])
        assert resumed.history[-1]["train_loss"] == pytest.approx(graphed.history[-1]["train_loss"], rel=1e-2)


@pytest.mark.cuda
def test_a_graphed_trial_runs_the_compiled_model(synthetic):
    """compile: true with cuda_graph: the captured step launches the compiled kernels."""
    eager = train_trial(_config(synthetic, device="cuda", epochs=1))
    torch._dynamo.reset()
    graphed = train_trial(dataclasses.replace(_config(synthetic, device="cuda", epochs=1, cuda_graph=True, compile=True)))
    torch._dynamo.reset()
    assert graphed.history[0]["train_loss"] == pytest.approx(eager.history[0]["train_loss"], rel=2e-2)
    assert graphed.history[0]["val_acc"] == pytest.approx(eager.history[0]["val_acc"], abs=0.05)


@pytest.mark.cuda
@pytest.mark.parametrize("reparam_optimizer", ["fresh", "keep"])
def test_a_graphed_t_cnn_is_captured_again_after_its_conversion(synthetic, reparam_optimizer):
    """The T-CNN recast as GPSA at epoch 1: another model and optimizer, so another captured step;
    it trains as the eager trial does, with AdamW's moments kept or fresh."""
    def config(cuda_graph: bool) -> TrialConfig:
        cfg = _config(synthetic, device="cuda", cuda_graph=cuda_graph, lr=2e-3)
        return dataclasses.replace(cfg, model="ls_tcnn_nano",
                                   model_args={"reparam_epoch": 1, "reparam_optimizer": reparam_optimizer})

    eager = train_trial(config(False)).history
    graphed = train_trial(config(True)).history
    assert [m["converted"] for m in graphed] == [False, True]
    for e, g in zip(eager, graphed, strict=True):
        assert g["train_loss"] == pytest.approx(e["train_loss"], rel=1e-2)
        assert g["val_acc"] == pytest.approx(e["val_acc"], abs=0.03)

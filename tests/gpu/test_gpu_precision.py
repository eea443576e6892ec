"""bf16 and fp16 on the GPU, on a one-rank NCCL group in this process (no Ray): the model wrapped
as the runtime wraps it (elastic._worker.wrap, DDP on cuda:0), the loop of the example through
elastic._worker.precision (autocast, ctx.backward's scaled backward, the optimizer's step through the
GradScaler), and fp16's scaler state through a checkpoint and back."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

import gpt
from checkpointing import CheckpointManager
from elastic import ScalingConfig
from elastic._worker import wrap as _wrap
from elastic._worker.precision import Precision
from elastic._worker.step_timer import StepTimer
from elastic._worker.train_state import _plain_steps

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

CUDA = torch.device("cuda", 0)
CFG = gpt.GPTConfig.named("tiny")
DATA = gpt.SyntheticTokens(4000, CFG.seq_len, CFG.vocab)


@functools.cache
def _batch(step: int, size: int = 16) -> torch.Tensor:
    return torch.stack([DATA[step * size + i] for i in range(size)])


def wrapped(precision_name: str, seed: int = 0, lr: float = 3e-2):
    """Model, optimizer and precision of one rank, built like TrainContext builds them."""
    torch.manual_seed(seed)
    scaling = ScalingConfig(use_gpu=True, precision=precision_name)
    model, _ = _wrap.wrap_model(gpt.GPT(CFG).to(CUDA), device=CUDA, world_size=1, scaling=scaling,
                                timer=StepTimer(), seed=0)
    precision = Precision(precision_name, "ddp", CUDA, Precision.new_scaler(precision_name, CUDA))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    precision.prepare_optimizer(optimizer)
    return model, optimizer, precision


def loss_of(model, precision, step: int) -> torch.Tensor:
    batch = _batch(step).to(CUDA)
    with precision.autocast():
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def train(model, optimizer, precision, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        loss = loss_of(model, precision, step)
        precision.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def learns(losses: list[float]) -> bool:
    return sum(losses[-5:]) / 5 < 0.95 * losses[0]


@pytest.mark.parametrize("precision_name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_trains_on_the_gpu_with_finite_losses(nccl_group, precision_name, dtype):
    model, optimizer, precision = wrapped(precision_name)
    with precision.autocast():
        assert model(_batch(0)[:2, :-1].to(CUDA)).dtype == dtype          # autocast is on for cuda
    losses = train(model, optimizer, precision, 30)
    assert all(math.isfinite(x) for x in losses), losses
    assert learns(losses), losses
    for p in model.parameters():       # master weights stay fp32, on the GPU, finite
        assert p.dtype == torch.float32 and p.device == CUDA and torch.isfinite(p).all()
    if precision_name == "fp16":
        scale = precision.scaler.get_scale()
        assert precision.scaler.is_enabled() and math.isfinite(scale) and scale > 0
    else:
        assert precision.scaler is None


def test_fp16_refuses_an_unscaled_backward_on_the_gpu(nccl_group):
    from elastic import ConfigError
    model, optimizer, precision = wrapped("fp16")
    loss_of(model, precision, 0).backward()
    with pytest.raises(ConfigError, match="ctx.backward"):
        optimizer.step()


def test_fp16_scaler_state_is_saved_and_restored_with_the_checkpoint(nccl_group, tmp_path):
    url = str(tmp_path / "run")
    model, optimizer, precision = wrapped("fp16")
    train(model, optimizer, precision, 12)
    scaler_state = precision.scaler.state_dict()
    # Not the state of a fresh scaler: 12 steps moved its growth tracker (or its scale, after an
    # overflow), so a restore that dropped it would show.
    assert scaler_state != Precision.new_scaler("fp16", CUDA).state_dict()

    # Shaped like the runtime's checkpoint: DCP state dicts, the scaler's state among the extras.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with CheckpointManager(url, async_save=True) as manager:
        manager.save(12, {"model": model_sd, "optim": optim_sd, "extra": {"step": 12, **precision.state()}},
                     generation=0)
        manager.wait()

    model2, optimizer2, precision2 = wrapped("fp16", seed=1)
    # The restore's target state, built from the fresh (fp16-prepared) optimizer as ctx.restore
    # builds it: DCP initialises the optimizer's state with a zero-gradient step(), which the
    # runtime (TrainState) lets reach the optimizer's own step(), not the fp16 one that refuses a
    # step without ctx.backward.
    with _plain_steps(optimizer2):
        model_sd2, optim_sd2 = get_state_dict(model2, optimizer2)
    state = {"model": model_sd2, "optim": optim_sd2, "extra": {"step": 0, **precision2.state()}}
    loaded = CheckpointManager(url).load_latest(state)
    assert loaded is not None and loaded.step == 12 and state["extra"]["step"] == 12
    with _plain_steps(optimizer2):
        set_state_dict(model2, (optimizer2,), model_state_dict=state["model"], optim_state_dict=state["optim"])
    precision2.load_state(state["extra"])

    assert precision2.scaler.state_dict() == scaler_state
    full, full2 = get_model_state_dict(model), get_model_state_dict(model2)
    assert full.keys() == full2.keys() and all(torch.equal(full[k], full2[k]) for k in full)
    moments, moments2 = get_state_dict(model, optimizer)[1]["state"], get_state_dict(model2, optimizer2)[1]["state"]
    assert moments.keys() == moments2.keys()
    for name in moments:
        for key, value in moments[name].items():
            assert torch.equal(value, moments2[name][key]), (name, key)
    assert torch.allclose(loss_of(model, precision, 12), loss_of(model2, precision2, 12), rtol=0, atol=1e-6)
    # Training goes on from the restored scale.
    more = train(model2, optimizer2, precision2, 3, start=12)
    assert all(math.isfinite(x) for x in more)
    assert math.isfinite(precision2.scaler.get_scale()) and precision2.scaler.get_scale() > 0

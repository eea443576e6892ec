"""Precision, gradient compression and FSDP memory options: config checks, and the wrapping on a
one-rank gloo group in this process (no Ray)."""
import functools

import pytest
import torch
import torch.nn.functional as F

import gpt
from elastic import ConfigError, ScalingConfig
from elastic._worker import wrap as _wrap
from elastic._worker.precision import Precision
from elastic._worker.step_timer import StepTimer

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("kwargs, words", [
    (dict(strategy="fsdp", grad_compression="bf16"), "grad_compression=None"),
    (dict(strategy="fsdp", grad_compression="powersgd"), "strategy='fsdp'"),
    (dict(precision="fp16"), "use_gpu=True"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(grad_compression="topk"), "grad_compression must be one of"),
    (dict(grad_compression="powersgd", powersgd_rank=0), "powersgd_rank"),
    (dict(grad_compression="powersgd", powersgd_warmup_steps=1), "powersgd_warmup_steps"),
    (dict(fsdp_cpu_offload=True), "strategy='fsdp'"),
    (dict(fsdp_reshard_after_forward=False), "strategy='fsdp'"),
])
def test_invalid_combinations_are_config_errors(kwargs, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        ScalingConfig(**kwargs)


def test_valid_combinations():
    ScalingConfig(precision="fp16", use_gpu=True, grad_compression="powersgd")
    ScalingConfig(strategy="fsdp", precision="bf16", fsdp_reshard_after_forward=False, fsdp_cpu_offload=True)
    ScalingConfig(precision="bf16", grad_compression="bf16")


CFG = gpt.GPTConfig.named("tiny")
DATA = gpt.SyntheticTokens(2000, CFG.seq_len, CFG.vocab)


@functools.cache
def _batch(step: int, size: int = 16) -> torch.Tensor:
    return torch.stack([DATA[step * size + i] for i in range(size)])


def _train(model, optimizer, steps, *, start=0, precision=None):
    precision = precision or Precision("fp32", "ddp", torch.device("cpu"), None)
    losses = []
    for s in range(start, start + steps):
        batch = _batch(s)
        with precision.autocast():
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        precision.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _wrapped(scaling, seed=0):
    torch.manual_seed(seed)
    model, compression = _wrap.wrap_model(gpt.GPT(CFG), device=torch.device("cpu"), world_size=1,
                                          scaling=scaling, timer=StepTimer(), seed=7)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), compression


def test_powersgd_state_restores_after_the_bucket_rebuild(one_rank_group):
    scaling = ScalingConfig(grad_compression="powersgd", powersgd_warmup_steps=3)
    model, opt, compression = _wrapped(scaling)
    _train(model, opt, 6)
    assert compression.compressing and compression.state.iter == 6 and compression.state.error_dict
    saved = compression.to_bytes()
    errors = {i: t.clone() for i, t in compression.state.error_dict.items()}

    model2, opt2, fresh = _wrapped(scaling)
    fresh.load_bytes(saved, torch.device("cpu"))
    assert not fresh.compressing                     # pending until DDP has rebuilt its buckets
    import io
    assert torch.load(io.BytesIO(fresh.to_bytes()), weights_only=False)["iter"] == 6   # a save keeps the pending state
    _train(model2, opt2, 1)                          # plain all-reduce; the restored state waits
    assert fresh.state.iter == 0 and not fresh.state.error_dict
    _train(model2, opt2, 1, start=1)                 # installed at the first bucket of step 2, then used
    assert fresh.state.iter == 7
    assert set(fresh.state.error_dict) == set(errors)
    assert all(fresh.state.error_dict[i].shape == errors[i].shape for i in errors)


def test_a_new_generation_starts_powersgd_afresh(one_rank_group):
    scaling = ScalingConfig(grad_compression="powersgd", powersgd_warmup_steps=4)
    model, opt, compression = _wrapped(scaling)
    _train(model, opt, 2)
    assert compression.state.iter == 2 and not compression.compressing   # still in its warm-up
    _train(model, opt, 3, start=2)
    assert compression.compressing


def test_compression_hooks_still_time_compute(one_rank_group):
    for scaling in (ScalingConfig(grad_compression="bf16"), ScalingConfig(grad_compression="powersgd")):
        timer = StepTimer()
        model, _ = _wrap.wrap_model(gpt.GPT(CFG), device=torch.device("cpu"), world_size=1, scaling=scaling,
                                    timer=timer, seed=0)
        timer.start()
        batch = torch.stack([DATA[i] for i in range(4)])
        model(batch[:, :-1]).sum().backward()
        assert timer._compute_done is not None, scaling.grad_compression   # the hook stamped the launch


def test_bf16_autocast_and_activation_checkpointing_train_on_cpu(one_rank_group):
    def run(precision_name, checkpointing):
        torch.manual_seed(0)
        model, _ = _wrap.wrap_model(gpt.GPT(CFG, activation_checkpointing=checkpointing), device=torch.device("cpu"),
                                    world_size=1, scaling=ScalingConfig(precision=precision_name), timer=StepTimer(),
                                    seed=0)
        precision = Precision(precision_name, "ddp", torch.device("cpu"), None)
        with precision.autocast():
            dtype = model(torch.zeros(2, 4, dtype=torch.long)).dtype
        return dtype, _train(model, torch.optim.AdamW(model.parameters(), lr=3e-2), 30, precision=precision)

    dtype, bf16 = run("bf16", True)
    ref_dtype, fp32 = run("fp32", False)
    assert dtype == torch.bfloat16 and ref_dtype == torch.float32
    tail, ref_tail = sum(bf16[-5:]) / 5, sum(fp32[-5:]) / 5
    assert tail < 0.95 * bf16[0]                       # it learns...
    assert abs(tail - ref_tail) < 0.02 * ref_tail      # ...like fp32 (bf16 rounding: within 2%)


def test_fp16_step_goes_through_the_scaler_and_refuses_an_unscaled_backward():
    # A CPU GradScaler stands in for the GPU one (the config allows fp16 only with use_gpu).
    model = torch.nn.Linear(4, 1)
    precision = Precision("fp16", "ddp", torch.device("cpu"), torch.amp.GradScaler("cpu", init_scale=1024.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.prepare_optimizer(opt)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(ConfigError, match="ctx.backward"):
        opt.step()
    opt.zero_grad()
    before = model.weight.detach().clone()
    precision.backward(model(torch.ones(2, 4)).sum())
    assert model.weight.grad.abs().max() > 100          # scaled by 1024
    opt.step()
    assert torch.allclose(model.weight, before - 0.1 * 2.0)   # unscaled gradient (2 per weight) applied
    state = precision.state()["grad_scaler"]
    other = Precision("fp16", "ddp", torch.device("cpu"), torch.amp.GradScaler("cpu"))
    other.load_state({"grad_scaler": state})
    assert other.scaler.get_scale() == precision.scaler.get_scale()
    assert Precision("fp16", "fsdp", torch.device("cpu"), None).autocast().__class__.__name__ == "nullcontext"

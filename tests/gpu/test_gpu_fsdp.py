"""FSDP2 on the GPU, on a one-rank NCCL group in this process (no Ray): the example's model
fully_shard-ed as the runtime shards it (elastic._worker.wrap: each block, then the root, on a cuda
device mesh), trained, checkpointed asynchronously (DTensor shards staged from the GPU) and
loaded into a freshly built model and optimizer."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import gpt
from checkpointing import CheckpointManager
from elastic import ScalingConfig
from elastic._worker import wrap as _wrap
from elastic._worker.step_timer import StepTimer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

CUDA = torch.device("cuda", 0)
CFG = gpt.GPTConfig.named("tiny")
DATA = gpt.SyntheticTokens(2000, CFG.seq_len, CFG.vocab)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)

OPTIONS = {
    "fp32": {},
    "bf16": {"precision": "bf16"},                     # MixedPrecisionPolicy(param_dtype=bf16)
    "zero2_cpu_offload": {"fsdp_reshard_after_forward": False, "fsdp_cpu_offload": True},   # pinned host shards
}


def sharded(options: dict, seed: int):
    torch.manual_seed(seed)
    scaling = ScalingConfig(strategy="fsdp", use_gpu=True, **options)
    model, compression = _wrap.wrap_model(gpt.GPT(CFG).to(CUDA), device=CUDA, world_size=1, scaling=scaling,
                                          timer=StepTimer(), seed=0)
    assert compression is None
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train(model, optimizer, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        batch = torch.stack([DATA[step * 8 + i] for i in range(8)]).to(CUDA)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def assert_same(a, b, path: str = "") -> None:
    """Nested state dicts hold equal values (tensors bitwise)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


@pytest.mark.parametrize("name", list(OPTIONS))
def test_fsdp2_on_cuda_trains_saves_and_loads_into_a_fresh_model(nccl_group, tmp_path, name):
    options = OPTIONS[name]
    url = str(tmp_path / "run")
    model, optimizer = sharded(options, seed=0)
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    shard_device = "cpu" if options.get("fsdp_cpu_offload") else "cuda"
    assert all(p.to_local().device.type == shard_device for p in params)
    assert all(p.device_mesh.device_type == "cuda" for p in params)
    losses = train(model, optimizer, 4)
    assert all(math.isfinite(x) for x in losses), losses
    assert all(p.dtype == torch.float32 for p in model.parameters())   # bf16 is for compute only

    model_sd, optim_sd = get_state_dict(model, optimizer)     # DTensor shards, as the runtime saves them
    with CheckpointManager(url, async_save=True) as manager:
        manager.save(4, {"model": model_sd, "optim": optim_sd, "extra": {"step": 4}}, generation=0)
        info = manager.wait()
    assert info is not None and info.step == 4
    expected = get_state_dict(model, optimizer, options=FULL)

    model2, optimizer2 = sharded(options, seed=1)
    model_sd2, optim_sd2 = get_state_dict(model2, optimizer2)
    state = {"model": model_sd2, "optim": optim_sd2, "extra": {"step": 0}}
    loaded = CheckpointManager(url).load_latest(state)
    assert loaded is not None and loaded.step == 4 and state["extra"]["step"] == 4
    set_state_dict(model2, (optimizer2,), model_state_dict=state["model"], optim_state_dict=state["optim"])

    got = get_state_dict(model2, optimizer2, options=FULL)
    assert_same(got[0], expected[0], "model")
    assert_same(got[1]["state"], expected[1]["state"], "optim")
    assert all(p.to_local().device.type == shard_device for p in model2.parameters())
    # Both go on alike from the loaded state (forward is deterministic; compare its loss).
    more, more2 = train(model, optimizer, 1, start=4), train(model2, optimizer2, 1, start=4)
    assert math.isfinite(more2[0]) and abs(more[0] - more2[0]) <= 1e-5 * abs(more[0])

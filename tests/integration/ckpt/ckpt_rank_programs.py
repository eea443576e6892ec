"""Programs run on every rank by `ranks.run_ranks` (gloo group already initialised)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from checkpointing import CheckpointManager

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 257), torch.nn.ReLU(), torch.nn.Linear(257, 31))


def _wrap(model: torch.nn.Module, strategy: str, world: int) -> torch.nn.Module:
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return torch.nn.parallel.DistributedDataParallel(model)


def _train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 128, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt, options=FULL)
    # Without FSDP these are views of the live parameters: snapshot them.
    return copy.deepcopy({"model": msd, "optim": osd})


def save_then_mutate(rank, world, url, strategy, out, step=7, async_save=True):
    """Train 2 steps, save, train one more (mutating params during the upload), commit."""
    model = _wrap(_model(0), strategy, world)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for s in range(2):
        _train_step(model, opt, s)
    full = _full(model, opt)  # collective: before save so every rank takes part
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": step, "samples": [1, 2, 3]}}
    mgr = CheckpointManager(url, async_save=async_save, keep=None)
    mgr.save(step, state, generation=1)
    _train_step(model, opt, 99)  # the staged copy must not see this
    info = mgr.wait()
    mgr.close()
    if rank == 0:
        torch.save(full, out)
    return {"committed": info is not None and info.step == step,
            "files": info.files if info else None, "world_size": info.world_size if info else None}


def load_and_dump(rank, world, url, strategy, out):
    """Fresh model (other seed) at this world size; load_latest; dump the full state on rank 0."""
    model = _wrap(_model(123), strategy, world)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    msd, osd = get_state_dict(model, opt)  # initialises optimizer state to load into
    state = {"model": msd, "optim": osd, "extra": {"step": -1, "samples": []}}
    mgr = CheckpointManager(url)
    result = mgr.load_latest(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full(model, opt)
    if rank == 0:
        torch.save(full, out)
    mgr.close()
    return {"step": result.step if result else None, "world_size": result.world_size if result else None,
            "extra": state["extra"], "skipped": result.skipped if result else None}


def async_rounds(rank, world, url, steps, fail_steps=()):
    """Several async saves while training on the default group; returns each wait() outcome."""
    model = _wrap(_model(0), "ddp", world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(url, keep=2)
    outcomes = []
    for step in steps:
        _train_step(model, opt, step)
        msd, osd = get_state_dict(model, opt)
        mgr.save(step, {"model": msd, "optim": osd}, generation=0)
        _train_step(model, opt, step + 1000)  # collectives on the default group during upload
        info = mgr.wait()
        outcomes.append(info.step if info else None)
    mgr.close()
    return {"outcomes": outcomes, "committed": [c.step for c in mgr.committed()]}


def failure_then_fallback(rank, world, url):
    """Rank 1's storage refuses step 2's writes; then a corrupt shard of step 3 (one that rank 1
    verifies) makes every rank fall back to step 1."""
    from ckpt_conformance import FlakyFS, flip_byte

    model = _wrap(_model(0), "ddp", world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(url, keep=None)
    fs = FlakyFS(mgr.storage.fs)
    mgr.storage.fs = fs
    outcomes, saved = [], {}
    for step in (1, 2, 3):
        fs.fail_writes = rank == 1 and step == 2
        _train_step(model, opt, step)
        msd, osd = get_state_dict(model, opt)
        saved[step] = copy.deepcopy(msd)
        mgr.save(step, {"model": msd, "optim": osd}, generation=0)
        info = mgr.wait()
        outcomes.append(info.step if info else None)
        if step == 2:
            error = type(mgr.last_error).__name__      # the failed save's (step 3's commit clears it)
    assert mgr.last_error is None
    dist.barrier()
    if rank == 0:
        flip_byte(mgr, 3, "__0_0.distcp")
    dist.barrier()
    fresh = _wrap(_model(5), "ddp", world)
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    msd, osd = get_state_dict(fresh, fopt)
    result = mgr.load_latest({"model": msd, "optim": osd})
    same = all(torch.equal(msd[k], saved[1][k]) for k in saved[1])
    mgr.close()
    return {"outcomes": outcomes, "error": error, "loaded": result.step,
            "skipped": [s["step"] for s in result.skipped], "equal_to_step1": same}


def save_replicated(rank, world, url, step=3):
    """Save a state of two replicated tensors (fewer items than ranks at world 4): DCP gives
    every item to one rank, so most ranks have nothing to write."""
    mgr = CheckpointManager(url, keep=None)
    mgr.save(step, {"w": torch.arange(64.0), "b": torch.ones(8)}, generation=1)
    info = mgr.wait()
    mgr.close()
    return {"committed": info is not None and info.step == step, "files": info.files if info else None}

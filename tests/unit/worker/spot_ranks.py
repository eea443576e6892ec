"""Rank programs of tests/unit/worker/test_spot_check.py and test_fingerprint.py, run by
`ckpt_ranks.run_ranks` (a gloo group of local processes, no Ray): real TrainContexts under DDP
with the compute spot check, clean and with one rank's gradient corrupted before the all-reduce
(fault_gate.BadGradientAt); and a flipped parameter bit that the next update rounds away."""
from __future__ import annotations

import os
import threading

import torch
from torch import nn

from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
from elastic._worker.fault_gate import BadGradientAt, BitFlipAt
from elastic._worker.state import WorkerState
from elastic.config import CheckpointConfig, FailureConfig, LRScalingConfig, ScalingConfig
from elastic.context import TrainContext
from elastic.errors import SilentCorruptionError

BATCH = 4


class Net(nn.Module):
    """Dropout and batch norm: the recompute must neither draw from the training RNG nor move
    the running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.norm(self.up(x)))))


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(8, generator=torch.Generator().manual_seed(i))


class CoarseSGD(torch.optim.Optimizer):
    """SGD whose update rounds each weight to bfloat16's precision: a flipped low bit of a weight
    is gone after the update (as a real update's rounding can lose one), while the step's
    forward and backward used it."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_((p - group["lr"] * p.grad).bfloat16().float())


def _run(rank: int, world: int, *, every: int | None, steps: int, loop_config: dict | None,
         coarse: bool = False, prepare_optimizer: bool = True) -> dict:
    os.environ["RANK"] = str(rank)          # the fault gate reads the rank as the worker sets it
    spec = RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy="ddp", min_workers=world),
                   checkpoint=CheckpointConfig(storage="memory://unused", keep=None, async_save=False,
                                               in_memory_every_n_steps=None),
                   failure=FailureConfig(collective_timeout_s=60.0, spot_check_every_n_steps=every),
                   lr=LRScalingConfig(base_world_size=1, warmup_steps=0, schedule="constant"))
    plan = GenerationPlan(generation=1, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=0,
                          restore=RestorePlan("fresh"), timeout_s=60.0)
    worker = WorkerState()
    ctx = TrainContext(plan=plan, spec=spec, worker=worker, loop_config=loop_config,
                       stop_requested=threading.Event(), preempted=threading.Event(), device=torch.device("cpu"))
    torch.manual_seed(1)
    model = ctx.prepare_model(Net())
    optimizer = CoarseSGD(model.parameters(), lr=1e-2) if coarse else torch.optim.AdamW(model.parameters(), lr=1e-2)
    if prepare_optimizer:
        ctx.prepare_optimizer(optimizer)
    ctx.restore(model=model, optimizer=optimizer)
    error = None
    try:
        for x in ctx.prepare_data(Points(), batch_size=BATCH):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ctx.report(loss=loss)
            if ctx.step == steps:
                break
    except SilentCorruptionError as e:
        error = {"step": e.step, "since": e.since, "ranks": list(e.ranks), "suspects": list(e.suspects),
                 "message": str(e)}
    ctx._abandon()
    return {"error": error, "step": ctx.step, "verified": worker.spot_verified,
            "params": [p.flatten().tolist() for p in model.module.parameters()],
            "buffers": [b.flatten().tolist() for b in model.module.buffers()]}


def cases(rank: int, world: int, marker: str) -> dict:
    """The same 6 steps with the spot check every 2 steps and without it; then a run whose rank
    1 computes a wrong gradient from the boundary after step 2 on."""
    bad = BadGradientAt(step=2, rank=1, marker_file=marker, param=2, element=3, bit=22)
    return {"checked": _run(rank, world, every=2, steps=6, loop_config=None),
            "unchecked": _run(rank, world, every=None, steps=6, loop_config=None),
            "bad": _run(rank, world, every=2, steps=6, loop_config=bad.as_config())}


def rounded_away(rank: int, world: int, marker: str) -> dict:
    """Bit 0 of a weight flipped on rank 1 after step 2, under CoarseSGD: the flip is gone after
    step 3's update, which used it. With the optimizer prepared (its step pre-hook fingerprints
    the parameters before the update) and without (only after the update: unseen)."""
    def flip(tag: str) -> dict:
        return BitFlipAt(step=2, rank=1, marker_file=f"{marker}.{tag}", param=0, element=5, bit=0).as_config()
    return {"prepared": _run(rank, world, every=None, steps=5, loop_config=flip("prepared"), coarse=True),
            "unprepared": _run(rank, world, every=None, steps=5, loop_config=flip("unprepared"), coarse=True,
                               prepare_optimizer=False)}

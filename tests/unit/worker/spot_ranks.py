"""Rank programs of tests/unit/worker/test_spot_check.py, run by `ckpt_ranks.run_ranks` (a gloo group of
local processes, no Ray): real TrainContexts under DDP with the compute spot check, clean and
with one rank's gradient corrupted before the all-reduce (fault_gate.BadGradientAt)."""
from __future__ import annotations

import os
import threading

import torch
from torch import nn

from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
from elastic._worker.fault_gate import BadGradientAt
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


def _run(rank: int, world: int, *, every: int | None, steps: int, loop_config: dict | None) -> dict:
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
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
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

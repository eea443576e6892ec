"""Rank programs of tests/unit/worker/test_worker_tensor_parallel.py, run by `ckpt_ranks.run_ranks` (a gloo
group of local processes, no Ray): real TrainContexts of a TP 2 x DP 2 layout (and HSDP: two shard
groups of 2), checked against one process training the unsharded model on the global batch, and
a generation whose second unit (replica, shard group) is new and restores warm from the first
unit's ranks, each position from its own."""
from __future__ import annotations

import hashlib
import threading

import torch
from torch import nn

from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
from elastic._worker.state import WorkerState
from elastic.config import CheckpointConfig, FailureConfig, LRScalingConfig, ScalingConfig
from elastic.context import TrainContext

BATCH = 3          # per replica
STEPS = 3
MAX_NORM = 0.05    # below the gradients' norm: every step clips (ctx.clip_grad_norm_ on two meshes under FSDP x TP)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def plan_tp(model: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    parallelize_module(model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(8, generator=torch.Generator().manual_seed(i))


def _context(rank: int, world: int, generation: int, restore: RestorePlan, worker: WorkerState, *,
             strategy: str, tp: int, shard: int | None = None) -> TrainContext:
    spec = RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy=strategy, min_workers=world, tensor_parallel_size=tp,
                                         hsdp_shard_size=shard),
                   checkpoint=CheckpointConfig(storage="memory://unused", keep=None, async_save=False),
                   failure=FailureConfig(collective_timeout_s=60.0),
                   lr=LRScalingConfig(base_world_size=1, warmup_steps=0, schedule="constant"))
    plan = GenerationPlan(generation=generation, rank=rank, world_size=world, master_addr="127.0.0.1",
                          master_port=0, restore=restore, timeout_s=60.0)
    return TrainContext(plan=plan, spec=spec, worker=worker, loop_config=None, stop_requested=threading.Event(),
                        preempted=threading.Event(), device=torch.device("cpu"))


def _objects(ctx: TrainContext, seed: int):
    torch.manual_seed(seed)
    model = ctx.prepare_model(MLP(), parallelize=plan_tp)
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _train(ctx: TrainContext, model, optimizer, steps: int, seen: list, norms: list | None = None) -> list[float]:
    losses = []
    for x in ctx.prepare_data(Points(), batch_size=BATCH):
        seen.append(x.sum().item())
        loss = model(x).square().mean()
        loss.backward()
        norm = ctx.clip_grad_norm_(MAX_NORM)
        if norms is not None:
            norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad()
        ctx.report(loss=loss)
        losses.append(loss.item())
        if len(losses) == steps:
            break
    return losses


def _full(model) -> dict[str, list]:
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).flatten().tolist()
            for k, v in model.state_dict().items()}


def _local_digest(ctx: TrainContext) -> str:
    """This rank's shard of the whole state (model, optimizer): what a warm source holds."""
    from torch.distributed.tensor import DTensor
    state = ctx._state
    assert state is not None
    digest = hashlib.sha256()

    def walk(tree, path=""):
        if isinstance(tree, torch.Tensor):
            t = tree.to_local() if isinstance(tree, DTensor) else tree
            digest.update(path.encode() + t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(tree, dict):
            for k in sorted(tree, key=str):
                walk(tree[k], f"{path}/{k}")
        elif isinstance(tree, (list, tuple)):
            for i, v in enumerate(tree):
                walk(v, f"{path}/{i}")
    full = state.state_dict()
    walk({k: v for k, v in full.items() if k != "extra"})
    return digest.hexdigest()


def reference(steps: int, dp: int) -> dict:
    """The unsharded model trained in one process on each step's global batch (every replica's
    samples, in DP rank order): what the layouts must reproduce."""
    torch.manual_seed(1)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2 * dp)    # the linear rule: base_world_size 1
    data = Points()
    losses: list[float] = []
    norms: list[float] = []
    for step in range(steps):
        # The loader's order: a shuffled epoch, each step's global batch cut in DP-rank order.
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(_epoch_seed()))
        ids = order[step * BATCH * dp:(step + 1) * BATCH * dp].tolist()
        x = torch.stack([data[i] for i in ids])
        loss = model(x).square().mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"params": {k: v.flatten().tolist() for k, v in model.state_dict().items()}, "losses": losses,
            "norms": norms}


def _epoch_seed() -> int:
    from elastic._determinism import mix_seed
    return mix_seed(0, "epoch", 0)


def layouts(rank: int, world: int, strategy: str, tp: int = 2, shard: int | None = None) -> dict:
    """DP x TP `tp` under `strategy` (hsdp: shard groups of `shard` replicas): STEPS steps, then
    (ddp, hsdp) generation 2 on the same ranks in which the second unit (replica 1; under hsdp
    shard group 1) is new (fresh workers, other initial weights) and restores warm from the first
    unit's ranks, each position in the unit from its own."""
    worker = WorkerState()
    ctx = _context(rank, world, 1, RestorePlan("fresh"), worker, strategy=strategy, tp=tp, shard=shard)
    model, optimizer = _objects(ctx, seed=1)
    ctx.restore(model=model, optimizer=optimizer)
    place = {"dp_rank": ctx.dp_rank, "dp_size": ctx.dp_size, "tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size,
             "mesh": list(ctx.mesh.mesh_dim_names or ())}
    seen: list[float] = []
    norms: list[float] = []
    losses = _train(ctx, model, optimizer, STEPS, seen, norms)
    out = {"place": place, "seen": seen, "losses": losses, "norms": norms, "params": _full(model),
           "lr": optimizer.param_groups[0]["lr"], "samples": ctx.samples_seen,
           "records": [[r.step, r.loss] for r in ctx._worker.outbox.records if r.kind == "step"]}
    if strategy == "fsdp":
        return out
    out["before"] = _local_digest(ctx)
    unit = tp * (shard or 1)
    if rank // unit == 1:
        worker = WorkerState()                   # the second unit is replaced: nothing in memory
    sources = tuple(range(unit))
    plan = RestorePlan("broadcast", source_rank=0, sources=sources, step=STEPS)
    ctx = _context(rank, world, 2, plan, worker, strategy=strategy, tp=tp, shard=shard)
    model, optimizer = _objects(ctx, seed=2 + rank)
    out["restored"] = ctx.restore(model=model, optimizer=optimizer)
    out["after"] = _local_digest(ctx)
    more: list[float] = []
    out["next_losses"] = _train(ctx, model, optimizer, 1, more)
    out["next_params"] = _full(model)
    return out


def each_layout(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """`layouts` for each case in turn, on the same group (one start of the processes for all)."""
    return [layouts(rank, world, **case) for case in cases]

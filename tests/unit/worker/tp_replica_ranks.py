"""Rank programs of tests/unit/worker/test_tp_replicas.py, run by `ckpt_ranks.run_ranks` (a gloo group
of local processes, no Ray): real TrainContexts of FSDP x TP (TP 2 x DP 2) take copies in memory at
every step through the StateKeeper, and a later group at another data-parallel degree (same TP
degree) rebuilds its 2-D shards from them."""
from __future__ import annotations

import hashlib
import threading

import torch
from tp_ranks import MLP, Points, plan_tp

from elastic._controller.forming import memory_source
from elastic._protocol import GenerationPlan, RestorePlan, RunSpec, WorkerPhase, WorkerReport
from elastic._worker.replicas import Copy, ShardPiece
from elastic._worker.state import WorkerState
from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
from elastic.context import TrainContext

TP = 2


def _context(rank: int, world: int, generation: int, restore: RestorePlan, worker: WorkerState) -> TrainContext:
    spec = RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy="fsdp", min_workers=world, tensor_parallel_size=TP),
                   checkpoint=CheckpointConfig(storage="memory://unused", keep=None, async_save=False,
                                               in_memory_every_n_steps=1),
                   failure=FailureConfig(collective_timeout_s=60.0))
    assert spec.in_memory_every == 1, "FSDP x TP takes its copies in memory"
    plan = GenerationPlan(generation=generation, rank=rank, world_size=world, master_addr="127.0.0.1",
                          master_port=0, restore=restore, timeout_s=60.0)
    return TrainContext(plan=plan, spec=spec, worker=worker, loop_config=None, stop_requested=threading.Event(),
                        preempted=threading.Event(), device=torch.device("cpu"))


def _objects(ctx: TrainContext, seed: int):
    torch.manual_seed(seed)
    model = ctx.prepare_model(MLP(), parallelize=plan_tp)
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _train(ctx: TrainContext, model, optimizer, steps: int) -> None:
    done = 0
    for x in ctx.prepare_data(Points(), batch_size=3):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.report(loss=0.0)      # the step boundary: the StateKeeper takes the copies here
        done += 1
        if done == steps:
            break


def _full(ctx: TrainContext) -> dict[str, list]:
    """Every tensor of the state (model and optimizer) whole: DTensors gathered (a collective,
    in the same order on every rank)."""
    from torch.distributed.tensor import DTensor
    state = ctx._state
    assert state is not None
    flat: dict[str, list] = {}

    def walk(prefix: str, tree) -> None:
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(f"{prefix}.{key}", value)
        elif isinstance(tree, torch.Tensor):
            whole = tree.full_tensor() if isinstance(tree, DTensor) else tree
            flat[prefix] = [list(whole.shape), whole.flatten().tolist()]
    for name, value in state.state_dict().items():
        if name != "extra":
            walk(name, value)
    return flat


def _digest(kept: Copy) -> str:
    """The pieces of a copy (blocks and their bytes), to tell whose copy a rank holds."""
    digest = hashlib.sha256()

    def walk(path: str, tree) -> None:
        if isinstance(tree, ShardPiece):
            digest.update(f"{path}{tree.offset}{tree.shape}".encode())
            digest.update(tree.local.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(tree, dict):
            for key in sorted(tree, key=str):
                walk(f"{path}/{key}", tree[key])
    walk("", {k: v for k, v in kept.state.items() if k != "extra"})
    return digest.hexdigest()


def train_and_copy(rank: int, world: int, out: str, steps: int) -> dict:
    """Generation 1, TP 2 x DP 2: `steps` steps with a copy at each; the pair each rank holds is
    saved to `out` (what a survivor keeps in memory), with the full state as the truth."""
    worker = WorkerState()
    ctx = _context(rank, world, 1, RestorePlan("fresh"), worker)
    model, optimizer = _objects(ctx, seed=1)
    ctx.restore(model=model, optimizer=optimizer)
    _train(ctx, model, optimizer, steps)
    pair = worker.replicas._pair
    torch.save(pair, f"{out}/pair{rank}.pt")
    held = worker.replicas.held()
    assert held is not None
    two_d = sorted({str(piece.offset) for piece in _pieces(pair[0].state) if len(piece.offset) == 2})
    return {"full": _full(ctx), "held": [held.generation, held.world_size, held.step, list(held.ranks)],
            "digests": [_digest(c) for c in pair], "step": ctx.step, "two_d_offsets": two_d}


def _pieces(tree) -> list[ShardPiece]:
    if isinstance(tree, ShardPiece):
        return [tree]
    if isinstance(tree, dict):
        return [p for v in tree.values() for p in _pieces(v)]
    return []


def rebuild(rank: int, world: int, out: str, survivors: list[int]) -> dict:
    """Generation 2 at `world` ranks (TP 2): new rank i is old rank survivors[i] (its saved pair in
    memory) or, past them, a new worker with nothing. The controller's choice of holders plans the
    restore (the survivors sit at their old TP rank); one more step proves the state trains."""
    worker = WorkerState()
    if rank < len(survivors):
        worker.replicas._pair = torch.load(f"{out}/pair{survivors[rank]}.pt", weights_only=False)
    reports = {}
    for new_rank, old_rank in enumerate(survivors):
        store = WorkerState().replicas
        store._pair = torch.load(f"{out}/pair{old_rank}.pt", weights_only=False)
        reports[new_rank] = WorkerReport(phase=WorkerPhase.INTERRUPTED, generation=1, rank=old_rank, step=0,
                                         has_state=False, records=[], replicas=store.held())
    plan = memory_source(list(range(world)), reports)
    assert isinstance(plan, RestorePlan) and plan.replica is not None, plan
    ctx = _context(rank, world, 2, plan, worker)
    model, optimizer = _objects(ctx, seed=2 + rank)       # other weights: the rebuild must overwrite them
    step = ctx.restore(model=model, optimizer=optimizer)
    full = _full(ctx)
    _train(ctx, model, optimizer, 1)
    return {"full": full, "step": step, "holders": list(plan.replica.holders), "dp_size": ctx.dp_size}

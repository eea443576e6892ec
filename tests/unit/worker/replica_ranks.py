"""Rank programs of tests/unit/worker/test_replicas.py, run by `ckpt_ranks.run_ranks` (a gloo group of
N local processes, no Ray): a real TrainContext per rank takes FSDP copies in memory, and a later
group at another world size rebuilds its shards from them."""
from __future__ import annotations

import threading

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from elastic._controller.forming import memory_source
from elastic._protocol import GenerationPlan, RestorePlan, RunSpec, WorkerPhase, WorkerReport
from elastic._worker.state import WorkerState
from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
from elastic.context import TrainContext


def _context(rank: int, world: int, generation: int, restore: RestorePlan, worker: WorkerState,
             shift: int = 1) -> TrainContext:
    spec = RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy="fsdp", use_gpu=False),
                   checkpoint=CheckpointConfig(storage="memory://unused", keep=None,
                                               async_save=False, max_consecutive_failures=3, in_memory_every_n_steps=1),
                   failure=FailureConfig(collective_timeout_s=60.0))
    plan = GenerationPlan(generation=generation, rank=rank, world_size=world, master_addr="127.0.0.1",
                          master_port=0, restore=restore, timeout_s=60.0, copy_shift=shift)
    return TrainContext(plan=plan, spec=spec, worker=worker, loop_config=None, stop_requested=threading.Event(),
                        preempted=threading.Event(), device=torch.device("cpu"))


def _objects(ctx: TrainContext):
    torch.manual_seed(0)
    # Row counts that split unevenly, and into empty pieces at 4 ranks (5 rows: 2, 2, 1, 0).
    model = nn.Sequential(nn.ModuleList([nn.Linear(16, 37), nn.Linear(37, 5)]))
    model = ctx.prepare_model(model)
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _step(ctx: TrainContext, model, optimizer) -> None:
    g = torch.Generator().manual_seed(1000 * ctx.step + ctx.rank)
    x = torch.randn(4, 16, generator=g)
    layers = model[0]
    layers[1](torch.relu(layers[0](x))).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    ctx.report(loss=0.0)


def _full(model, optimizer) -> dict[str, list]:
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, tree) -> None:
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(f"{prefix}.{key}", value)
        elif isinstance(tree, torch.Tensor):
            flat[prefix] = tree
    walk("model", msd)
    walk("optim", osd)
    return {k: torch.as_tensor(v).flatten().tolist() for k, v in sorted(flat.items())}


def train_and_copy(rank: int, world: int, out: str, steps: int, shift: int = 1) -> dict:
    """Generation 1 at `world` ranks: `steps` steps, copies at every step, each sent `shift`
    ranks on; the pair each rank holds is saved to `out` (the memory a survivor keeps), with the
    full state as the truth."""
    worker = WorkerState()
    ctx = _context(rank, world, 1, RestorePlan("fresh"), worker, shift)
    model, optimizer = _objects(ctx)
    ctx.restore()
    for _ in range(steps):
        _step(ctx, model, optimizer)
    torch.save(worker.replicas._pair, f"{out}/pair{rank}.pt")
    held = worker.replicas.held()
    assert held is not None
    return {"full": _full(model, optimizer), "held": [held.generation, held.world_size, held.step, list(held.ranks)],
            "step": ctx.step}


def rebuild(rank: int, world: int, out: str, survivors: list[int]) -> dict:
    """Generation 2 at `world` ranks: new rank i is old rank survivors[i] (its saved pair in
    memory) or, past them, a new worker with nothing. The controller's own choice of holders
    plans the restore; one more step proves the state trains."""
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
    assert isinstance(plan, RestorePlan), plan
    ctx = _context(rank, world, 2, plan, worker)
    model, optimizer = _objects(ctx)
    step = ctx.restore()
    full = _full(model, optimizer)
    _step(ctx, model, optimizer)
    return {"full": full, "step": step, "holders": list(plan.replica.holders) if plan.replica else None,
            "samples": ctx.samples_seen}

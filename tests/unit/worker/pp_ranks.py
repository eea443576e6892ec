"""Rank programs of tests/unit/worker/test_worker_pipeline.py, run by `ckpt_ranks.run_ranks` (a gloo group
of local processes, no Ray): real TrainContexts of PP 2 x DP 2 (and PP 2 x TP 2 on 4 ranks),
each schedule, checked against one process training the whole model on the global batch; a
generation whose second pipeline is new and restores warm, each stage from the same stage of the
first pipeline; the full-model hash gathered over the stages."""
from __future__ import annotations

import threading

import torch
from torch import nn

from elastic._protocol import GenerationPlan, RestorePlan, RunSpec, ThreadPlace
from elastic._worker.state import WorkerState
from elastic._worker.thread_position import ThreadPosition
from elastic.config import CheckpointConfig, FailureConfig, LRScalingConfig, ScalingConfig
from elastic.context import TrainContext

BATCH = 4          # per replica
STEPS = 3
MAX_NORM = 0.05    # below the gradients' norm: every step clips (ctx.clip_grad_norm_ sums the stages' norms)
MICRO = 2
WIDTH = 8


class Stack(nn.Module):
    """Units: inp, blocks.0 .. blocks.3, out (a None unit is skipped: another stage holds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(16, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for block in self.blocks if self.blocks is not None else ():
            x = x + block(x)
        return self.out(x) if self.out is not None else x


def plan_tp(stage: nn.Module, tp_mesh) -> None:
    """Each kept block's Linear column-wise, its output gathered back (a stage's activations are
    whole between stages)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    for block in stage.blocks if stage.blocks is not None else ():
        parallelize_module(block, tp_mesh, {"1": ColwiseParallel(use_local_output=True)})
        block[1].register_forward_hook(lambda _m, _i, out: _gather(out, tp_mesh))


def _gather(out: torch.Tensor, tp_mesh) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    return DTensor.from_local(out, tp_mesh, [Shard(-1)]).redistribute(tp_mesh, [Replicate()]).to_local()


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def _context(rank: int, world: int, generation: int, restore: RestorePlan, worker: WorkerState, *,
             strategy: str, pp: int, tp: int, storage: str = "memory://unused",
             in_memory_every: int | None = None) -> TrainContext:
    spec = RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy=strategy, min_workers=world, tensor_parallel_size=tp,
                                         pipeline_parallel_size=pp),
                   checkpoint=CheckpointConfig(storage=storage, keep=None, async_save=False,
                                               in_memory_every_n_steps=in_memory_every),
                   failure=FailureConfig(collective_timeout_s=60.0),
                   lr=LRScalingConfig(base_world_size=1, warmup_steps=0, schedule="constant"))
    plan = GenerationPlan(generation=generation, rank=rank, world_size=world, master_addr="127.0.0.1",
                          master_port=0, restore=restore, timeout_s=60.0)
    return TrainContext(plan=plan, spec=spec, worker=worker, loop_config=None, stop_requested=threading.Event(),
                        preempted=threading.Event(), device=torch.device("cpu"))


def _split(schedule: str, pp: int) -> list[str]:
    """Two stages (blocks 0-1 with inp, blocks 2-3 with out), or four under an interleaved schedule."""
    return ["blocks.1", "blocks.2", "blocks.3"] if schedule == "interleaved1f1b" else ["blocks.2"]


def _objects(ctx: TrainContext, seed: int, schedule: str):
    torch.manual_seed(seed)
    pipeline = ctx.prepare_pipeline(Stack(), split_points=_split(schedule, ctx.pp_size), loss_fn=loss_fn,
                                    microbatches=MICRO, schedule=schedule,
                                    parallelize=plan_tp if ctx.tp_size > 1 else None)
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(pipeline.parameters(), lr=1e-2))
    return pipeline, optimizer


def _train(ctx: TrainContext, pipeline, optimizer, steps: int, norms: list | None = None) -> list[float]:
    losses = []
    for x in ctx.prepare_data(Points(), batch_size=BATCH):
        loss = pipeline.step(x, x.roll(1, dims=1))
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


class Places(ThreadPosition):
    """The training thread's position as the worker binds it, keeping every place marked (the
    hang judge's view of a pipeline step)."""

    def __init__(self) -> None:
        super().__init__(completed=lambda: 0, news=threading.Event())
        self.seen: list[str] = []
        self.enter(generation=1)

    def mark(self, place: ThreadPlace) -> None:
        self.seen.append(place.value)
        super().mark(place)

    def wait_begins(self, place: ThreadPlace) -> ThreadPlace:
        self.seen.append(place.value)
        return super().wait_begins(place)


def _params(pipeline) -> dict[str, list]:
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).flatten().tolist()
            for k, v in pipeline.state_dict().items()}


def _hash(ctx: TrainContext, pipeline) -> str | None:
    """The whole model's hash as the run's end computes it (StateKeeper.finish): on rank 0."""
    from elastic._determinism import state_sha256
    from elastic._worker.checkpoint_io import full_model_state
    full = full_model_state(pipeline, ctx._mesh.pp_group())
    return state_sha256(full) if ctx.rank == 0 else None


def reference(steps: int, dp: int) -> dict:
    """The whole model trained in one process on each step's global batch (every replica's
    samples, in DP rank order): what the layouts must reproduce."""
    from elastic._determinism import mix_seed
    torch.manual_seed(1)
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2 * dp)    # the linear rule: base_world_size 1
    data = Points()
    losses: list[float] = []
    norms: list[float] = []
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(mix_seed(0, "epoch", 0)))
    for step in range(steps):
        x = torch.stack([data[i] for i in order[step * BATCH * dp:(step + 1) * BATCH * dp].tolist()])
        loss = loss_fn(model(x), x.roll(1, dims=1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"params": {k: v.flatten().tolist() for k, v in model.state_dict().items()}, "losses": losses,
            "norms": norms}


def layout(rank: int, world: int, strategy: str, schedule: str, pp: int = 2, tp: int = 1,
           warm: bool = False) -> dict:
    """STEPS steps of DP x PP `pp` x TP `tp` under `strategy` and `schedule`; with `warm`, then
    generation 2 on the same ranks in which the second pipeline is new (fresh workers, other
    initial weights) and restores warm, each stage from the first pipeline's same stage."""
    worker = WorkerState()
    places = Places()
    ctx = _context(rank, world, 1, RestorePlan("fresh"), worker, strategy=strategy, pp=pp, tp=tp)
    pipeline, optimizer = _objects(ctx, 1, schedule)
    ctx.restore(model=pipeline, optimizer=optimizer)
    norms: list[float] = []
    out = {"places": places.seen, "norms": norms,
           "place": {"dp_rank": ctx.dp_rank, "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank,
                     "mesh": list(ctx.mesh.mesh_dim_names or ())},
           "names": sorted(n for n, _ in pipeline.named_parameters()),
           "losses": _train(ctx, pipeline, optimizer, STEPS, norms), "params": _params(pipeline),
           "lr": optimizer.param_groups[0]["lr"],
           "records": [[r.step, r.loss] for r in ctx._worker.outbox.records if r.kind == "step"]}
    if not warm:
        out["hash"] = _hash(ctx, pipeline)
        return out
    unit = pp * tp
    if rank // unit == 1:
        worker = WorkerState()                   # the second pipeline is replaced: nothing in memory
    plan = RestorePlan("broadcast", source_rank=0, sources=tuple(range(unit)), step=STEPS)
    ctx = _context(rank, world, 2, plan, worker, strategy=strategy, pp=pp, tp=tp)
    pipeline, optimizer = _objects(ctx, 2 + rank, schedule)
    out["restored"] = ctx.restore(model=pipeline, optimizer=optimizer)
    out["restored_params"] = _params(pipeline)
    out["next_losses"] = _train(ctx, pipeline, optimizer, 1)
    out["next_params"] = _params(pipeline)
    out["hash"] = _hash(ctx, pipeline)
    return out


def each_layout(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """`layout` for each case in turn, on the same group (one start of the processes for all)."""
    return [layout(rank, world, **case) for case in cases]


def _groups(model: nn.Module) -> list[dict]:
    """Two param groups, told apart by their values: the blocks, and the rest (with weight decay)."""
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return [{"params": blocks, "lr": 0.05}, {"params": rest, "lr": 0.1, "weight_decay": 0.01}]


def _optimizer_view(model: nn.Module, optimizer) -> dict[str, list]:
    """Each parameter's group values (its LR relative to group 0's) and momentum buffer, by name."""
    from torch.distributed.tensor import DTensor
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    view = {}
    for name, p in model.named_parameters():
        buffer = optimizer.state[p]["momentum_buffer"]
        buffer = buffer.full_tensor() if isinstance(buffer, DTensor) else buffer
        g = group_of[id(p)]
        # The LR as a ratio to the first group's: the LR rule scales every group with the DP degree.
        view[name] = [g["lr"] / optimizer.param_groups[0]["lr"], g["weight_decay"], g["momentum"],
                      *buffer.flatten().tolist()]
    return view


def repartition(rank: int, world: int, storage: str) -> list[dict]:
    """Checkpoints across P, through the checkpoint rung (CheckpointConfig storage on file): 2 SGD
    steps with momentum and two param groups at P 1 (the whole model on each rank, DP 4), saved;
    restored at P 2 (DP 2), one step, saved; again at P 2; restored at P 1. Each phase's view of
    every parameter's group values and momentum buffer, after its restore and after its steps."""
    phases = []
    for generation, (pp, steps) in enumerate(((1, 2), (2, 1), (2, 1), (1, 0)), start=1):
        plan = RestorePlan("fresh") if generation == 1 else RestorePlan("checkpoint")
        ctx = _context(rank, world, generation, plan, WorkerState(), strategy="ddp", pp=pp, tp=1, storage=storage)
        torch.manual_seed(generation)          # other initial weights each time: only the checkpoint carries them
        if pp == 1:
            model = ctx.prepare_model(Stack())
            raw = model.module
        else:
            model = raw = ctx.prepare_pipeline(Stack(), split_points=["blocks.2"], loss_fn=loss_fn,
                                               microbatches=MICRO)
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(_groups(raw), momentum=0.9))
        ctx.restore(model=model, optimizer=optimizer)
        restored = _optimizer_view(raw, optimizer) if generation > 1 else {}
        done = 0
        for x in ctx.prepare_data(Points(), batch_size=BATCH):
            if done == steps:
                break
            if pp == 1:
                loss_fn(model(x), x.roll(1, dims=1)).backward()
            else:
                model.step(x, x.roll(1, dims=1))
            optimizer.step()
            optimizer.zero_grad()
            ctx.report()
            done += 1
        if steps:
            ctx.save_checkpoint(wait=True)
        phases.append({"restored": restored, "trained": _optimizer_view(raw, optimizer), "step": ctx.step})
    return phases


def memory_rung(rank: int, world: int) -> dict:
    """FSDP x PP 2 x DP 2 with a copy in host memory at every step (each rank's ring runs within
    its stage: rank r keeps r - 2's); then generation 2 on the same ranks in which the second
    pipeline is new (nothing in memory), planned as the controller plans it from the survivors'
    reports: every stage's shards rebuilt from the copies. One more step proves it trains."""
    from elastic._controller.forming import memory_source
    from elastic._protocol import WorkerPhase, WorkerReport
    worker = WorkerState()
    ctx = _context(rank, world, 1, RestorePlan("fresh"), worker, strategy="fsdp", pp=2, tp=1, in_memory_every=1)
    pipeline, optimizer = _objects(ctx, 1, "1f1b")
    ctx.restore(model=pipeline, optimizer=optimizer)
    _train(ctx, pipeline, optimizer, 2)
    held = worker.replicas.held()
    assert held is not None
    out: dict = {"before": _params(pipeline), "held": list(held.ranks)}
    # Ranks 0 and 1 (the first pipeline) survive with their copies; the second pipeline is new.
    own = WorkerReport(phase=WorkerPhase.INTERRUPTED, generation=1, rank=rank, step=0, has_state=False,
                       records=[], replicas=held)
    if rank >= 2:
        worker = WorkerState()
    everyone: list = [None] * world
    torch.distributed.all_gather_object(everyone, own if rank < 2 else None)
    plan = memory_source(list(range(world)), {r: w for r, w in enumerate(everyone) if w is not None})
    assert isinstance(plan, RestorePlan) and plan.replica is not None, plan
    ctx = _context(rank, world, 2, plan, worker, strategy="fsdp", pp=2, tp=1, in_memory_every=1)
    pipeline, optimizer = _objects(ctx, 2 + rank, "1f1b")
    out["restored"] = ctx.restore(model=pipeline, optimizer=optimizer)
    out["after"] = _params(pipeline)
    out["holders"] = list(plan.replica.holders)
    _train(ctx, pipeline, optimizer, 1)
    out["next"] = _params(pipeline)
    return out


def all_programs(rank: int, world: int, cases: list[dict], storage: str) -> dict:
    """Every program of test_worker_pipeline.py in turn, on one start of the processes."""
    return {"layouts": each_layout(rank, world, cases), "repartition": repartition(rank, world, storage),
            "memory": memory_rung(rank, world)}

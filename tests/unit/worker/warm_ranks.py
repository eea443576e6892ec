"""Rank programs of tests/unit/worker/test_warm_sources.py, run by `ckpt_ranks.run_ranks` (a gloo group of
N local processes, no Ray): the many-source warm transfer (elastic._worker.warm_slices) on a
state tree, and a real DDP TrainContext whose next generation restores from several survivors."""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import torch
from torch import nn

from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
from elastic._worker.state import WorkerState
from elastic._worker.warm_slices import _leaves, send_slices
from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
from elastic.context import TrainContext
from elastic.errors import StateError


@dataclass
class Record:
    """A dataclass inside the tree: its fields are walked like a dict's values."""

    weights: torch.Tensor
    note: str


def _tree(seed: int, big: int) -> dict:
    """A state of every shape the warm path meets: several dtypes, a 0-d tensor, an empty one, a
    bool, a non-contiguous view, plain values, nesting, and one tensor of `big` floats."""
    g = torch.Generator().manual_seed(seed)
    return {"extra": {"step": seed, "order": f"s{seed}"},
            "model": {"big": torch.randn(big, generator=g), "bias": torch.randn(3, generator=g),
                      "half": torch.randn(5, 7, generator=g).to(torch.bfloat16)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(seed)),
                                        "exp_avg": torch.randn(4, 6, generator=g).t()}},     # not contiguous
                          "param_groups": [{"lr": 0.1 * seed, "params": [0]}]},
            "counter": [torch.randint(0, 100, (9,), generator=g), torch.zeros(0), torch.rand(6, generator=g) > 0.5],
            "record": Record(torch.randn(2, 2, generator=g, dtype=torch.float64), f"n{seed}")}


def _digest(tree) -> dict[str, str]:
    return {str(path): hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                                      + str((tuple(t.shape), t.dtype)).encode()).hexdigest()
            for path, t in _leaves(tree)}


def _plain(tree) -> str:
    if isinstance(tree, torch.Tensor):
        return "T"
    if isinstance(tree, Record):
        return f"Record({_plain(tree.weights)}, {tree.note})"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_plain(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, (list, tuple)):
        return "[" + ", ".join(_plain(v) for v in tree) + "]"
    return repr(tree)


def transfer(rank: int, world: int, sources: list[int], big: int, partial_template: bool = False) -> dict:
    """Sources hold the state of seed 7; every other rank passes a template of zeros (without the
    counter's tensors when `partial_template`), which must come back filled with the state."""
    source_set = tuple(sources)
    truth = _tree(7, big)
    if rank in source_set:
        held = _tree(7, big)
        before = _digest(held)
        result = send_slices(held, source_set, torch.device("cpu"))
        return {"digest": _digest(result.state), "plain": _plain(result.state), "same_object": result.state is held,
                "untouched": _digest(held) == before, "extra_bytes": result.extra_bytes, "truth": _digest(truth)}
    template = _tree(8, big)
    for _, t in _leaves(template):
        t.zero_()
    if partial_template:
        del template["counter"]
    pointers = {str(p): t.data_ptr() for p, t in _leaves(template)}
    result = send_slices(None, source_set, torch.device("cpu"), into=template)
    in_place = sorted(str(p) for p, t in _leaves(result.state) if pointers.get(str(p)) == t.data_ptr())
    return {"digest": _digest(result.state), "plain": _plain(result.state), "in_place": in_place,
            "extra_bytes": result.extra_bytes, "truth": _digest(truth), "truth_plain": _plain(truth),
            "nbytes": {str(p): t.numel() * t.element_size() for p, t in _leaves(truth)}}


def transfers(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """`transfer` for each case in turn on the same group (one start of the processes for all),
    then `mismatch`."""
    return [*(transfer(rank, world, **case) for case in cases), mismatch(rank, world)]


def mismatch(rank: int, world: int) -> dict:
    """Source 1 holds a tensor of another shape than source 0's: every rank raises, none hangs."""
    held = _tree(7, 10) if rank in (0, 1) else None
    if rank == 1:
        assert held is not None
        held["model"]["bias"] = torch.zeros(4)
    try:
        send_slices(held, (0, 1), torch.device("cpu"), into=None if held is not None else _tree(8, 10))
    except StateError as error:   # on every rank
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


# ---- a real DDP TrainContext: generation 1 trains, generation 2 restores warm ------------------

def _context(rank: int, world: int, generation: int, restore: RestorePlan, worker: WorkerState) -> TrainContext:
    spec = RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy="ddp", use_gpu=False),
                   checkpoint=CheckpointConfig(storage="memory://unused", keep=None,
                                               async_save=False, max_consecutive_failures=3),
                   failure=FailureConfig(collective_timeout_s=60.0))
    plan = GenerationPlan(generation=generation, rank=rank, world_size=world, master_addr="127.0.0.1",
                          master_port=0, restore=restore, timeout_s=60.0)
    return TrainContext(plan=plan, spec=spec, worker=worker, loop_config=None, stop_requested=threading.Event(),
                        preempted=threading.Event(), device=torch.device("cpu"))


class Tied(nn.Module):
    """An embedding tied to the output layer (one tensor under two names), as GPTs often are."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))


def _objects(ctx: TrainContext, seed: int):
    torch.manual_seed(seed)
    model = ctx.prepare_model(Tied())
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, sched


def _step(ctx: TrainContext, model, optimizer, sched) -> None:
    g = torch.Generator().manual_seed(1000 * ctx.step + ctx.rank)
    x = torch.randint(0, 11, (4, 5), generator=g)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    sched.step()
    ctx.report(loss=0.0)


def _state_digest(ctx: TrainContext) -> dict[str, str]:
    state = ctx._state
    assert state is not None
    full = state.state_dict()
    return {**_digest(full), "plain": _plain({k: v for k, v in full.items()})}


def warm_restores(rank: int, world: int, cases: list[list[int]], steps: int) -> list[dict]:
    """`warm_restore` for each list of sources in turn, on the same group."""
    return [warm_restore(rank, world, sources, steps) for sources in cases]


def warm_restore(rank: int, world: int, sources: list[int], steps: int) -> dict:
    """Generation 1: `steps` DDP steps on every rank. Generation 2 (same group): ranks in
    `sources` keep their worker (survivors with the state), the others start with a new one (a
    replacement), and every rank builds other initial weights before ctx.restore. Then one more
    step on every rank."""
    worker = WorkerState()
    ctx = _context(rank, world, 1, RestorePlan("fresh"), worker)
    objects = _objects(ctx, seed=1)
    ctx.restore(model=objects[0], optimizer=objects[1], sched=objects[2])
    for _ in range(steps):
        _step(ctx, *objects)
    before = _state_digest(ctx)
    if rank not in sources:
        worker = WorkerState()
    plan = RestorePlan("broadcast", source_rank=sources[0], sources=tuple(sources), step=steps)
    ctx = _context(rank, world, 2, plan, worker)
    objects = _objects(ctx, seed=2 + rank)
    restored = ctx.restore(model=objects[0], optimizer=objects[1], sched=objects[2])
    after = _state_digest(ctx)
    _step(ctx, *objects)
    return {"before": before, "after": after, "restored": restored, "next": _state_digest(ctx),
            "samples": ctx.samples_seen, "lr": objects[1].param_groups[0]["lr"]}

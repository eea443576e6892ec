"""O2: the per-step work of the step boundary that grows with the group, before and after issue 18.

Every rank computes the whole group's sample ids of a step (they feed the data-order hash,
which must not depend on the world size) and extends the hash by them: work that grows with the
global batch, on every rank, at every step. This times one step of it with the framework's
loader and `DataOrder` (what a step costs now) against the implementation before issue 18's
data-order change (one tensor read per id, one sha256 per id in Python), kept here as the
reference, side by side in one process, alternating, for global batches from 16 (the tests) to
80,000 (10,000 ranks of 8). No Ray, no process group: the loader is given a stand-in context.

Second part, against the world size: the host side of the step's exchange (elastic._worker.
step_exchange: the buffers a rank gathers every rank's values into) and of rank 0's record (the
per-rank compute times it reads off the gathered table). Before: a list of one tensor per rank,
stacked, and a float() per rank's time; now: one (world x slots) tensor and one read of its
column. The collective itself is not timed (no group of 10,000 ranks here): these are the same
expressions as the code's, on a table of the size it would get.

Third part, the framework's whole per-step cost on one rank: a tiny model (no compute to speak
of) trained through `TrainContext` (prepare_model/optimizer/data, restore, report) on a one-rank
gloo group in this process, against the same loop written bare (the same DDP model, optimizer
and per-step seeding, reading the batches by index). The difference per step is what the
framework's loader, step boundary and hooks cost the training thread (`--loop-steps`, CPU time
of this process; alternating, the median of `--reps`).

    python benchmarks/step_overhead.py [--global-batches 16,1024,16384,80000] [--world-sizes 2,1000,10000]
                                       [--loop-steps 2000] [--reps 7] [--out o2.json]

One JSON line: per global batch and per world size, the median ms per step of each and their ratio.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic._determinism import DATA_ORDER_START, DataOrder
from elastic._worker.loader import ElasticLoader
from elastic._worker.step_boundary import _HEADER, MAX_METRICS

SLOTS = _HEADER + MAX_METRICS      # one rank's values in a step's exchange


def before(loader: ElasticLoader, seen: int, global_batch: int, digest: str) -> str:
    """The step's ids and hash as the framework computed them before (the reference)."""
    order = loader._epoch_order(seen // len(loader._dataset))
    n = len(loader._dataset)
    ids = [int(order[g % n]) for g in range(seen, seen + global_batch)]
    h = bytes.fromhex(digest)
    for sample in ids:
        h = hashlib.sha256(h + int(sample).to_bytes(8, "little", signed=True)).digest()
    return h.hex()


def now(loader: ElasticLoader, seen: int, global_batch: int, order: DataOrder) -> str:
    """The same step with the framework's code: the loader's ids, DataOrder, the record's digest."""
    order.extend(loader._dataset_indices(seen, seen + global_batch))
    return order.hexdigest()


def exchange_before(world_size: int) -> tuple:
    """The exchange's buffers and rank 0's compute times, as before: dist.all_gather's list."""
    mine = torch.zeros(SLOTS, dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    table = torch.stack(gathered)
    return tuple(round(float(c), 6) for c in table[:, 3])


def exchange_now(world_size: int) -> tuple:
    """The same with the framework's expressions now: dist.all_gather_single's one tensor."""
    mine = torch.zeros(SLOTS, dtype=torch.float64)
    table = torch.empty((world_size, mine.numel()), dtype=mine.dtype, device=mine.device)
    return tuple(table[:, 3].tolist())


class _Rows:
    """A map-style dataset of fixed rows (its reads cost next to nothing)."""

    def __init__(self, n: int):
        self._rows = torch.randn(n, 8)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._rows[i]


def _one_rank_group() -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def loop_framework(steps: int, dataset: _Rows, storage: str) -> float:
    """CPU seconds of `steps` steps through TrainContext (a generation as a worker runs it)."""
    import threading

    from elastic._protocol import GenerationPlan, RestoreKind, RestorePlan, RunSpec
    from elastic._worker.state import WorkerState
    from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
    from elastic.context import TrainContext
    spec = RunSpec(user_code=b"", total_steps=steps, seed=0,
                   scaling=ScalingConfig(strategy="ddp", use_gpu=False),
                   checkpoint=CheckpointConfig(storage=storage, keep=None,
                                               async_save=False, max_consecutive_failures=3),
                   failure=FailureConfig(collective_timeout_s=60.0))
    plan = GenerationPlan(generation=1, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                          restore=RestorePlan(RestoreKind.FRESH), timeout_s=60.0)
    ctx = TrainContext(plan=plan, spec=spec, worker=WorkerState(), loop_config=None,
                       stop_requested=threading.Event(), preempted=threading.Event(), device=torch.device("cpu"))
    torch.manual_seed(0)
    model = ctx.prepare_model(torch.nn.Linear(8, 1))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    loader = ctx.prepare_data(dataset, batch_size=8)
    ctx.restore(model=model, optimizer=optimizer)
    start = time.process_time()
    for batch in loader:
        loss = model(batch).square().mean()
        ctx.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.report(loss=loss, lr=optimizer.param_groups[0]["lr"])
    return time.process_time() - start


def loop_bare(steps: int, dataset: _Rows) -> float:
    """CPU seconds of the same steps written without the framework."""
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    start = time.process_time()
    for step in range(steps):
        torch.default_generator.manual_seed(step)      # per-step seeding, as a reproducible loop does
        batch = torch.stack([dataset[i] for i in order[step * 8:(step + 1) * 8]])
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
    return time.process_time() - start


def side_by_side(before_fn, now_fn, reps: int) -> dict:
    """Median ms of each, alternating which goes first."""
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(reps):
        for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            (before_fn, now_fn)[which](rep)
            times[which].append(1000 * (time.perf_counter() - t))
    old, new = statistics.median(times[0]), statistics.median(times[1])
    return {"before_ms": round(old, 3), "now_ms": round(new, 3), "before_over_now": round(old / new, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--global-batches", default="16,1024,16384,80000")
    p.add_argument("--world-sizes", default="2,1000,10000")
    p.add_argument("--loop-steps", type=int, default=2000, help="steps of each loop in the third part (0: skip it)")
    p.add_argument("--reps", type=int, default=7, help="timed steps of each, alternating")
    p.add_argument("--dataset", type=int, default=1_000_000, help="samples in the (index-only) dataset")
    p.add_argument("--out")
    args = p.parse_args(argv)
    ctx = SimpleNamespace(seed=0, dp_size=1, dp_rank=0, total_steps=1)
    loader = ElasticLoader(ctx, range(args.dataset), batch_size=1)
    result: dict = {"benchmark": "O2", "machine": f"{os.uname().machine} {os.cpu_count()} cores",
                    "dataset": args.dataset, "reps": args.reps, "per_global_batch": {}}
    for gb in (int(x) for x in args.global_batches.split(",")):
        state = {"digest": DATA_ORDER_START, "order": DataOrder()}

        def old_step(rep: int, gb: int = gb, state: dict = state) -> None:
            state["digest"] = before(loader, rep * gb, gb, state["digest"])

        def new_step(rep: int, gb: int = gb, state: dict = state) -> None:
            now(loader, rep * gb, gb, state["order"])
        row = result["per_global_batch"][str(gb)] = side_by_side(old_step, new_step, args.reps)
        print(f"global batch {gb}: {row}", file=sys.stderr, flush=True)
    result["per_world_size"] = {}
    for world in (int(x) for x in args.world_sizes.split(",")):
        row = result["per_world_size"][str(world)] = side_by_side(
            lambda _, w=world: exchange_before(w), lambda _, w=world: exchange_now(w), args.reps)
        print(f"world size {world}: {row}", file=sys.stderr, flush=True)
    if args.loop_steps:
        import tempfile
        _one_rank_group()
        dataset = _Rows(8 * args.loop_steps)
        times: dict[str, list[float]] = {"bare": [], "framework": []}
        with tempfile.TemporaryDirectory(prefix="o2-") as d:
            for rep in range(args.reps):
                for which in (("bare", "framework") if rep % 2 == 0 else ("framework", "bare")):
                    seconds = loop_bare(args.loop_steps, dataset) if which == "bare" else \
                        loop_framework(args.loop_steps, dataset, f"{d}/run{rep}")
                    times[which].append(1e6 * seconds / args.loop_steps)
        bare, ours = statistics.median(times["bare"]), statistics.median(times["framework"])
        result["per_step_loop_us"] = {"bare": round(bare, 1), "framework": round(ours, 1),
                                      "framework_extra_us": round(ours - bare, 1), "steps": args.loop_steps}
        print(f"loop: {result['per_step_loop_us']}", file=sys.stderr, flush=True)
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

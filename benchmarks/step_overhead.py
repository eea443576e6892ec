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

    python benchmarks/step_overhead.py [--global-batches 16,1024,16384,80000] [--world-sizes 2,1000,10000]
                                       [--reps 7] [--out o2.json]

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

from elastic._data import ElasticLoader
from elastic._determinism import DATA_ORDER_START, DataOrder
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
    p.add_argument("--reps", type=int, default=7, help="timed steps of each, alternating")
    p.add_argument("--dataset", type=int, default=1_000_000, help="samples in the (index-only) dataset")
    p.add_argument("--out")
    args = p.parse_args(argv)
    ctx = SimpleNamespace(seed=0, world_size=1, rank=0, total_steps=1)
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
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

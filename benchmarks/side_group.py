"""The checkpoint side group at re-form (issue 15, part 3): a gloo full mesh against gloo's lazy
connections (checkpointing._groups.new_lazy_gloo_group), at N local ranks.

Every rank forms the default gloo group on a TCPStore (all ranks released together, so a slow
process start is not counted), then creates the side group: `create_ms` is what a re-form pays
(the slowest rank's). Then a gather to rank 0 and a broadcast from it, the collectives of a save
(`first_ops_ms`: the lazy group connects its pairs here, in the upload's thread), and the TCP
connections the side group added (`side_connections`, both ends counted, from /proc/net/tcp).
Prints one JSON line per (mode, ranks), medians over reps, modes alternating.

    python benchmarks/side_group.py --ranks 2 4 8 --reps 5
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _established() -> int:
    with open("/proc/self/net/tcp") as table:
        return sum(1 for line in table.read().splitlines()[1:] if line.split()[3] == "01")


def _rank(rank: int, world: int, port: int, lazy: bool, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from checkpointing._groups import new_lazy_gloo_group
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dist.barrier()
    before = _established()
    dist.barrier()
    timeout = datetime.timedelta(seconds=60)
    started = time.monotonic()
    side = new_lazy_gloo_group(timeout) if lazy else dist.new_group(backend="gloo", timeout=timeout)
    created = time.monotonic()
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(rank, gathered, dst=0, group=side)
    box = [rank]
    dist.broadcast_object_list(box, src=0, group=side)
    done = time.monotonic()
    dist.barrier()
    after = _established()
    out.put((rank, created - started, done - created, after - before))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, lazy: bool) -> tuple[float, float, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, lazy, out)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=300) for _ in range(world)]
    for p in procs:
        p.join(60)
    return max(r[1] for r in rows), max(r[2] for r in rows), rows[0][3]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    for world in args.ranks:
        samples: dict[str, list[tuple[float, float, int]]] = {"full_mesh": [], "lazy": []}
        for _ in range(args.reps):
            for mode in samples:
                samples[mode].append(measure(world, lazy=mode == "lazy"))
        for mode, rows in samples.items():
            print(json.dumps({
                "benchmark": "side_group", "mode": mode, "ranks": world, "reps": args.reps,
                "create_ms": round(statistics.median(r[0] for r in rows) * 1000, 2),
                "first_ops_ms": round(statistics.median(r[1] for r in rows) * 1000, 2),
                "side_connections": statistics.median(r[2] for r in rows),
                "machine": f"{platform.machine()} {os.cpu_count()} cores"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""D1: step time with DataLoader worker processes (num_workers=N) against loading in the training
process (num_workers=0), when reading a sample is slow.

A dataset whose `__getitem__` costs 5 ms (a sleep, standing for storage or decoding, then a
tensor), a small MLP trained with DDP on a one-rank gloo group (no Ray) through a real
TrainContext: prepare_model, prepare_optimizer, prepare_data(..., num_workers=N), restore, and
ctx.report every step. Each repeat is a fresh generation; the configurations alternate (0, N, 0,
N, ...) so that a drift in the machine's speed hits both. A run's step time is its mean over the
steps after the first (which starts the workers); the mean, because N workers deliver their
batches in bursts of N (step times alternate ~0 and the load time). Prints one JSON line: the
median over runs of each configuration's step time, their ratio, and the first step's time.

    python benchmarks/dataloader.py [--workers 2] [--steps 40] [--repeats 5] [--batch-size 8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch import nn

from chaos.services import free_port


class SlowSamples(torch.utils.data.Dataset):
    """Sample i: a vector of `dim` floats, after `cost_s` of waiting (I/O, decoding)."""

    def __init__(self, n: int, dim: int, cost_s: float):
        self.n, self.dim, self.cost_s = n, dim, cost_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.cost_s)
        return torch.full((self.dim,), float(i % 97) / 97)


def one_rank_group() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def context(storage: str, steps: int, generation: int):
    """A fresh generation's TrainContext over the one-rank group, as a worker builds it."""
    from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
    from elastic._worker.state import WorkerState
    from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
    from elastic.context import TrainContext
    spec = RunSpec(user_code=b"", total_steps=steps, seed=0,
                   scaling=ScalingConfig(strategy="ddp", use_gpu=False),
                   checkpoint=CheckpointConfig(storage=storage, keep=None,
                                               async_save=False, max_consecutive_failures=3),
                   failure=FailureConfig(collective_timeout_s=60.0))
    plan = GenerationPlan(generation=generation, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                          restore=RestorePlan("fresh"), timeout_s=60.0)
    return TrainContext(plan=plan, spec=spec, worker=WorkerState(), loop_config=None,
                        stop_requested=threading.Event(), preempted=threading.Event(), device=torch.device("cpu"))


def train(ctx, args: argparse.Namespace, num_workers: int) -> list[float]:
    """The user's loop; returns the wall time of each step (batch wait + compute + report)."""
    model = ctx.prepare_model(nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    loader = ctx.prepare_data(SlowSamples(100_000, args.dim, args.sample_ms / 1000), args.batch_size,
                              num_workers=num_workers)
    ctx.restore()
    times, last = [], time.perf_counter()
    for batch in loader:
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.report(loss=loss)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="num_workers compared with 0")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each configuration")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sample-ms", type=float, default=5.0, help="cost of one __getitem__")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(1)
    one_rank_group()
    storage = tempfile.mkdtemp(prefix="dataloader-bench-")
    per_config: dict[int, list[float]] = {0: [], args.workers: []}
    first: dict[int, list[float]] = {0: [], args.workers: []}
    generation = 0
    try:
        for _ in range(args.repeats):
            for num_workers in (0, args.workers):
                generation += 1
                times = train(context(storage, args.steps, generation), args, num_workers)
                first[num_workers].append(times[0])
                per_config[num_workers].append(statistics.fmean(times[1:]))
    finally:
        dist.destroy_process_group()
    serial, parallel = statistics.median(per_config[0]), statistics.median(per_config[args.workers])
    print(json.dumps({
        "benchmark": "dataloader", "sample_ms": args.sample_ms, "batch_size": args.batch_size,
        "steps": args.steps, "repeats": args.repeats, "num_workers": args.workers,
        "step_ms_workers_0": round(serial * 1000, 2),
        f"step_ms_workers_{args.workers}": round(parallel * 1000, 2),
        "speedup": round(serial / parallel, 2),
        "step_ms_per_run": {str(k): [round(t * 1000, 2) for t in v] for k, v in per_config.items()},
        "first_step_ms": {str(k): round(statistics.median(v) * 1000, 1) for k, v in first.items()},
        "loading_floor_ms": round(args.batch_size * args.sample_ms, 1),
    }))


if __name__ == "__main__":
    main()

"""D2: steps/s of a Ray Dataset against elastic.ParquetTokens, on the same tokens.

One corpus written with elastic.write_token_shards (S shards of R rows of seq_len + 1 int32 tokens,
row groups of G rows) is read two ways through ctx.prepare_data: as
`ray.data.read_parquet(corpus)` (materialized once into the object store by its data source, rows
fetched by index from there; elastic._worker.ray_data) and as `elastic.ParquetTokens(corpus,
seq_len)` (row groups read on demand from the files, kept in its LRU cache). Both feed the same
loop through a real TrainContext on a one-rank gloo group in this process, named as a run's worker
is (RunNames: the Ray Dataset's source is the run's detached actor, found again by every generation
and removed at the end, as the controller does), shuffled (the loader's default), batch B: with
`--model small` the example's GPT (examples/gpt.py) forward, backward and AdamW step; with
`--model none` a one-weight linear layer, so that the step is the data path and the step boundary
alone. Each repeat is a fresh generation; the two sources alternate (ray, parquet, ray, ...) so
that a drift in the machine's speed hits both. A run's rate is its steps after the first over
their time; the first step (prepare_data, the materialization or the index, and the first batch)
is reported apart: the Ray Dataset is materialized in the first generation only. Prints one JSON
line: the median rates, their ratio (Ray Data / ParquetTokens) and the first steps.

    python benchmarks/ray_data_source.py [--model small|none] [--steps 60] [--repeats 3]
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

SOURCES = ("ray_data", "parquet_tokens")


class StandInController:
    """Named as the run's controller (elastic._run_names), so that the run's data source stays."""


def one_rank_group() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def context(storage: str, steps: int, generation: int, names):
    """A fresh generation's TrainContext over the one-rank group, as a worker of the run `names` builds it."""
    from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
    from elastic._worker.state import WorkerState
    from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
    from elastic.context import TrainContext
    spec = RunSpec(user_code=b"", total_steps=steps, seed=0, scaling=ScalingConfig(strategy="ddp", use_gpu=False),
                   checkpoint=CheckpointConfig(storage=storage, keep=None, async_save=False),
                   failure=FailureConfig(collective_timeout_s=60.0, sdc_check=False))
    plan = GenerationPlan(generation=generation, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                          restore=RestorePlan("fresh"), timeout_s=60.0)
    return TrainContext(plan=plan, spec=spec, worker=WorkerState(run_names=names), loop_config=None,
                        stop_requested=threading.Event(), preempted=threading.Event(), device=torch.device("cpu"))


def write_corpus(url: str, args: argparse.Namespace, seq_len: int, vocab: int) -> None:
    from elastic import write_token_shards
    rng = np.random.default_rng(0)
    write_token_shards(url, (rng.integers(0, vocab, (args.rows, seq_len + 1), dtype=np.int32)
                             for _ in range(args.shards)), row_group_size=args.row_group)


def dataset(source: str, corpus: str, seq_len: int):
    """A new dataset object of `source`, as each generation's loop builds it."""
    if source == "ray_data":
        import ray.data
        return ray.data.read_parquet(corpus, file_extensions=["parquet"])
    from elastic import ParquetTokens
    return ParquetTokens(corpus, seq_len)


def train(ctx, args: argparse.Namespace, source: str, corpus: str, seq_len: int) -> tuple[float, list[float]]:
    """The user's loop; returns the first step's time (from before prepare_data) and the others'."""
    import gpt
    started = time.perf_counter()
    if args.model == "none":
        model = ctx.prepare_model(nn.Linear(1, 1))
    else:
        model = ctx.prepare_model(gpt.GPT(gpt.GPTConfig.named(args.model)))
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = ctx.prepare_data(dataset(source, corpus, seq_len), batch_size=args.batch_size)
    ctx.restore(model=model, optimizer=optimizer)
    times, last = [], started
    for batch in loader:
        tokens = (batch["tokens"] if isinstance(batch, dict) else batch).long()   # Ray Data rows are dicts
        if args.model == "none":
            loss = model(tokens[:, :1].float()).mean()
        else:
            loss = gpt.lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.report(loss=loss)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[0], times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=["small", "tiny", "none"],
                        help="the example's GPT size, or none: the data path and the step boundary alone")
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each source")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2048, help="rows per shard")
    parser.add_argument("--row-group", type=int, default=256, help="rows per Parquet row group")
    parser.add_argument("--cpus", type=int, default=2, help="the local Ray's CPUs (Ray Data's tasks need free ones)")
    args = parser.parse_args()
    import uuid

    import ray

    import gpt
    from elastic._run_names import NAMESPACE, RunNames, remove_data_sources
    names = RunNames(f"bench-{uuid.uuid4().hex[:12]}")
    cfg = gpt.GPTConfig.named("small" if args.model == "none" else args.model)
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="ray-data-bench-")
    corpus = os.path.join(work, "corpus")
    write_corpus(corpus, args, cfg.seq_len, cfg.vocab)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING")
    one_rank_group()
    # The run's controller, standing in: a run's data source ends itself once its controller is gone.
    controller = ray.remote(num_cpus=0)(StandInController).options(name=names.controller(),
                                                                   namespace=NAMESPACE).remote()
    rates: dict[str, list[float]] = {s: [] for s in SOURCES}
    first: dict[str, list[float]] = {s: [] for s in SOURCES}
    generation = 0
    try:
        for _ in range(args.repeats):
            for source in SOURCES:
                generation += 1
                ctx = context(os.path.join(work, f"run-{source}"), args.steps, generation, names)
                first_s, times = train(ctx, args, source, corpus, cfg.seq_len)
                first[source].append(first_s)
                rates[source].append(len(times) / sum(times))
    finally:
        dist.destroy_process_group()
        remove_data_sources(names.run_id)
        ray.kill(controller)
        ray.shutdown()
    ray_rate, parquet_rate = statistics.median(rates["ray_data"]), statistics.median(rates["parquet_tokens"])
    print(json.dumps({
        "benchmark": "ray_data_source", "model": args.model, "batch_size": args.batch_size, "steps": args.steps,
        "repeats": args.repeats, "rows": args.shards * args.rows, "seq_len": cfg.seq_len,
        "row_group": args.row_group, "cpus": args.cpus,
        "steps_per_s_ray_data": round(ray_rate, 2), "steps_per_s_parquet_tokens": round(parquet_rate, 2),
        "ratio_ray_data_over_parquet_tokens": round(ray_rate / parquet_rate, 3),
        "steps_per_s_per_run": {s: [round(r, 2) for r in v] for s, v in rates.items()},
        "first_step_s": {s: [round(t, 2) for t in v] for s, v in first.items()},
    }))


if __name__ == "__main__":
    main()

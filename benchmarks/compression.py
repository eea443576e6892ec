"""Gradient compression benchmark: bytes communicated per step and step time, for
grad_compression None / "bf16" / "powersgd", on the same model and world size; prints one JSON line.

Each mode runs in its own gloo group of --workers processes on this machine (CPU), with the
model wrapped by elastic._worker.wrap exactly as the runtime wraps it. Bytes are what the DDP hook hands
to all-reduce per step on one rank (every `dist.all_reduce` the hook issues is counted: the
bucket buffer uncompressed, its bf16 copy, or PowerSGD's P and Q matrices plus the tensors it
leaves uncompressed), averaged over the measured steps after the warm-up (PowerSGD's plain
all-reduce steps are not measured). `ratio` is bytes over the uncompressed mode's bytes.

    .venv/bin/python benchmarks/compression.py [--workers 2] [--model-size small] [--steps 20] [--plot out.png]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import gpt  # noqa: E402
from chaos.services import free_port  # noqa: E402
from elastic import ScalingConfig  # noqa: E402
from elastic._worker import wrap as _wrap  # noqa: E402
from elastic._worker.step_timer import StepTimer  # noqa: E402

MODES = {"none": {}, "bf16": {"grad_compression": "bf16"}, "powersgd": {"grad_compression": "powersgd"}}


def _worker(rank: int, world: int, port: int, mode: str, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        scaling = ScalingConfig(powersgd_rank=args.powersgd_rank, powersgd_warmup_steps=args.warmup,
                                **MODES[mode])
        cfg = gpt.GPTConfig.named(args.model_size)
        torch.manual_seed(0)
        model, _ = _wrap.wrap_model(gpt.GPT(cfg), device=torch.device("cpu"), world_size=world, scaling=scaling,
                                    timer=StepTimer(), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = gpt.SyntheticTokens(100_000, cfg.seq_len, cfg.vocab)
        total = args.warmup + args.steps
        batches = [torch.stack([data[(s * world + rank) * args.batch_size + i] for i in range(args.batch_size)])
                   for s in range(total)]
        sent = [0]
        real_all_reduce = dist.all_reduce

        def counting_all_reduce(tensor, *a, **kw):
            sent[0] += tensor.numel() * tensor.element_size()
            return real_all_reduce(tensor, *a, **kw)

        dist.all_reduce = counting_all_reduce   # the hooks look it up on the module at call time
        times, bytes_per_step, loss = [], [], 0.0
        for s in range(total):
            sent[0] = 0
            dist.barrier()
            t0 = time.perf_counter()
            batch = batches[s]
            logits = model(batch[:, :-1])
            loss_t = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss_t.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if s >= args.warmup:
                times.append(time.perf_counter() - t0)
                bytes_per_step.append(sent[0])
            loss = float(loss_t.detach())
        dist.all_reduce = real_all_reduce
        if rank == 0:
            out[mode] = {"bytes_per_step": statistics.mean(bytes_per_step), "step_s_median": statistics.median(times),
                         "loss_last": round(loss, 4), "params": sum(p.numel() for p in model.parameters())}
    finally:
        dist.destroy_process_group()


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(result["modes"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(modes, [result["modes"][m]["ratio"] for m in modes])
    a.set_title("bytes per step (ratio to uncompressed)")
    b.bar(modes, [result["modes"][m]["step_s_median"] for m in modes])
    b.set_title("median step time (s)")
    fig.suptitle(f"{result['model_size']} model, {result['workers']} workers, gloo CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model-size", choices=sorted(gpt.MODEL_SIZES), default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (PowerSGD's plain all-reduce)")
    p.add_argument("--powersgd-rank", type=int, default=1)
    p.add_argument("--plot", metavar="PNG", help="also write a bar chart here")
    args = p.parse_args(argv)
    args.warmup = max(args.warmup, 2)
    with mp.Manager() as manager:
        out = manager.dict()
        for mode in MODES:
            mp.spawn(_worker, args=(args.workers, free_port(), mode, args, out), nprocs=args.workers, join=True)
        modes = dict(out)
    base = modes["none"]["bytes_per_step"]
    for m in modes.values():
        m["ratio"] = round(m["bytes_per_step"] / base, 4)
        m["step_s_median"] = round(m["step_s_median"], 4)
    result = {"benchmark": "grad_compression", "workers": args.workers, "model_size": args.model_size,
              "batch_size": args.batch_size, "steps": args.steps, "powersgd_rank": args.powersgd_rank,
              "backend": "gloo", "device": "cpu", "modes": {m: modes[m] for m in MODES}}
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

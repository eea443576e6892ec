"""PP2/PP3: pipeline throughput against data parallelism, and the measured bubble against the
schedule's, on real TrainContexts of a gloo group of local processes (no Ray; one torch thread a
rank, as a worker with 1 CPU; benchmarks/_rank_group.py).

`--part throughput` (PP2), 4 ranks: PP 2 x DP 2 (`--schedules`, `--microbatches`) against PP 1 x
DP 4, the same global batch (`--global-batch`: DP 4 reads global/4 a rank, a pipeline global/2),
the same model (`--model`: examples/gpt.py's GPT of that size) and loop: `pipe.step`, AdamW,
`ctx.report` (at P = 1 `prepare_pipeline` is DDP's whole model, so one loop serves both). The
layouts alternate within one start of the processes (`--reps` rounds, each `--steps` steps of
every layout, the first `--warmup` left out); steps/s is the timed steps over their wall time on
rank 0; the ratio is paired per round. Also the CPU seconds a step, summed over the 4 ranks.

`--part bubble` (PP3), 2 ranks, PP 2 x DP 1, for M in `--bubble-microbatches` and each schedule:
T_pipeline, the wall time of `pipe.step` (forward and backward over M micro-batches; the ranks
start it together after a barrier, the time is the slower rank's), against T_whole, rank 0
running the whole (unwrapped) model's forward and backward on the same batch while rank 1 waits.
Measured bubble = 1 - (T_whole / P) / T_pipeline, against the schedule's (P - 1) / (M + P - 1)
(interleaved with V = 2 stages a rank: (P - 1) / (V M + P - 1)). Also T_whole_micro, the whole
model over the same M micro-batches one after the other: 1 - T_whole / T_whole_micro is what
the smaller matmuls of micro-batches cost alone, which the measured bubble includes. And each
rank's CPU time in the call: `idle_share` = 1 - (the busier rank's CPU time) / T_pipeline, the
share of the step that rank waited (the bubble, plus waiting for a core on a shared machine),
and `overhead_cpu_ms`, the work the pipeline adds to that rank beyond T_whole_micro's CPU / P
(the schedule, the P2P sends, FSDP2's hooks on each stage). Medians over `--bubble-reps` rounds,
measurements interleaved. One JSON line.

    python benchmarks/pipeline_throughput.py --part throughput --model small --global-batch 32 \
        --microbatches 4 --schedules 1f1b --reps 4 --steps 30
    python benchmarks/pipeline_throughput.py --part bubble --model small --bubble-batch 16 \
        --bubble-microbatches 2,4,8 --schedules gpipe,1f1b,interleaved1f1b --bubble-reps 5
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def _context(rank: int, world: int, generation: int, pp: int, total_steps: int):
    import torch

    from elastic._protocol import GenerationPlan, RestoreKind, RestorePlan, RunSpec
    from elastic._worker.state import WorkerState
    from elastic.config import CheckpointConfig, FailureConfig, LRScalingConfig, ScalingConfig
    from elastic.context import TrainContext
    spec = RunSpec(user_code=b"", total_steps=total_steps, seed=0,
                   scaling=ScalingConfig(strategy="ddp", min_workers=world, pipeline_parallel_size=pp),
                   checkpoint=CheckpointConfig(storage="memory://unused", keep=None, async_save=False),
                   failure=FailureConfig(collective_timeout_s=120.0),
                   lr=LRScalingConfig(base_world_size=1, warmup_steps=0, schedule="constant"))
    plan = GenerationPlan(generation=generation, rank=rank, world_size=world, master_addr="127.0.0.1",
                          master_port=0, restore=RestorePlan(RestoreKind.FRESH), timeout_s=120.0)
    return TrainContext(plan=plan, spec=spec, worker=WorkerState(), loop_config=None,
                        stop_requested=threading.Event(), preempted=threading.Event(), device=torch.device("cpu"))


def _split(model_cfg, pp: int, schedule: str) -> list[str]:
    import gpt
    return gpt.pipeline_split_points(model_cfg, pp * (2 if schedule == "interleaved1f1b" else 1))


def _prepare(ctx, model_cfg, schedule: str, microbatches: int):
    import torch

    import gpt
    torch.manual_seed(0)
    per_rank = 2 if schedule == "interleaved1f1b" else 1
    return ctx.prepare_pipeline(gpt.GPT(model_cfg), split_points=_split(model_cfg, ctx.pp_size, schedule),
                                loss_fn=gpt.lm_loss, microbatches=microbatches if ctx.pp_size > 1 else 1,
                                schedule=schedule, stages_per_rank=per_rank if ctx.pp_size > 1 else None)


def compare(rank: int, world: int, progress, model: str, global_batch: int, microbatches: int,
            schedules: list[str], reps: int, steps: int) -> list[dict]:
    """Rank program of --part throughput: per round, each layout for `steps` steps; this rank's
    end time of every step."""
    import torch

    import gpt
    model_cfg = gpt.GPTConfig.named(model)
    layouts = [("dp4", 1, "1f1b")] + [(f"pp2xdp2-{s}", 2, s) for s in schedules]
    rounds, generation = [], 0
    for rep in range(reps):
        row = {}
        for name, pp, schedule in layouts if rep % 2 == 0 else layouts[::-1]:     # ABBA
            generation += 1
            ctx = _context(rank, world, generation, pp, total_steps=10 ** 6)
            pipe = _prepare(ctx, model_cfg, schedule, microbatches)
            optimizer = ctx.prepare_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
            ctx.restore(model=pipe, optimizer=optimizer)
            data = gpt.SyntheticTokens(10 ** 6, model_cfg.seq_len, model_cfg.vocab, seed=0)
            ends, cpu = [time.perf_counter()], [time.process_time()]
            for batch in ctx.prepare_data(data, batch_size=global_batch // (world // pp)):
                loss = pipe.step(batch[:, :-1], batch[:, 1:])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ctx.report(loss=loss)
                ends.append(time.perf_counter())
                cpu.append(time.process_time())
                if len(ends) > steps:
                    break
            row[name] = {"ends": ends, "cpu": cpu}
            progress(generation)
        rounds.append(row)
    return rounds


def bubble(rank: int, world: int, progress, model: str, batch: int, microbatches: list[int], schedules: list[str],
           reps: int, steps: int) -> dict:
    """Rank program of --part bubble: every measurement `steps` times per round, rounds
    interleaving them; each time as this rank saw it (after a barrier)."""
    import torch
    import torch.distributed as dist

    import gpt
    model_cfg = gpt.GPTConfig.named(model)
    data = gpt.SyntheticTokens(batch, model_cfg.seq_len, model_cfg.vocab, seed=0)
    x = torch.stack([data[i] for i in range(batch)])
    inputs, targets = x[:, :-1], x[:, 1:]
    pipes, generation = {}, 0
    for m in microbatches:
        for schedule in schedules:
            generation += 1
            pipes[f"{schedule}-m{m}"] = _prepare(_context(rank, world, generation, 2, 10 ** 6), model_cfg,
                                                 schedule, m)
    torch.manual_seed(0)
    whole = gpt.GPT(model_cfg)

    def time_it(fn) -> list[list[float]]:
        """[wall, this process's CPU seconds] of each call."""
        out = []
        for _ in range(steps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            out.append([time.perf_counter() - t0, time.process_time() - c0])
        return out

    def run_whole(m: int) -> None:
        if rank == 0:
            for xi, ti in zip(inputs.chunk(m), targets.chunk(m), strict=True):
                (gpt.lm_loss(whole(xi), ti) / m).backward()
            whole.zero_grad(set_to_none=True)

    def run_pipe(pipe) -> None:
        pipe.step(inputs, targets)
        pipe.zero_grad(set_to_none=True)

    times: dict[str, list[list[float]]] = {}
    for rep in range(reps):
        names = list(pipes) if rep % 2 == 0 else list(pipes)[::-1]
        for name in ["whole", *names, *(f"whole-m{m}" for m in microbatches)]:
            if name.startswith("whole"):
                fn = functools.partial(run_whole, int(name[7:]) if name != "whole" else 1)
            else:
                fn = functools.partial(run_pipe, pipes[name])
            fn()          # untimed: the first call builds the schedule's buffers
            times.setdefault(name, []).extend(time_it(fn))
        progress(rep + 1)
    return times


def _rate(ends: list[float], warmup: int) -> float:
    """Steps per second over the steps after the warm-up."""
    timed = ends[warmup:]
    return (len(timed) - 1) / (timed[-1] - timed[0])


def throughput_result(args: argparse.Namespace, run_group) -> dict:
    schedules = args.schedules.split(",")
    group = run_group("pipeline_throughput:compare", 4,
                      {"model": args.model, "global_batch": args.global_batch, "microbatches": args.microbatches,
                       "schedules": schedules, "reps": args.reps, "steps": args.steps},
                      collective_timeout_s=120.0, stall_s=600.0)
    if not group.ok:
        raise SystemExit(f"throughput run failed: {group.errors} stalled={group.stalled}\n" + "\n".join(group.logs))
    rounds = group.results[0]
    rates = {name: [_rate(r[name]["ends"], args.warmup) for r in rounds] for name in rounds[0]}
    # CPU seconds a step, summed over the 4 ranks: steadier than the wall time on a shared machine.
    cpu = {name: [sum((ranks[i][name]["cpu"][-1] - ranks[i][name]["cpu"][args.warmup])
                      / (len(ranks[i][name]["cpu"]) - 1 - args.warmup) for i in range(4))
                  for ranks in zip(*group.results, strict=True)] for name in rounds[0]}
    out: dict = {"steps_per_s_median": {n: round(statistics.median(v), 3) for n, v in rates.items()},
                 "steps_per_s_per_round": {n: [round(x, 3) for x in v] for n, v in rates.items()},
                 "cpu_ms_per_step_all_ranks_median": {n: round(1000 * statistics.median(v), 1) for n, v in cpu.items()}}
    for name in rates:
        if name != "dp4":
            paired = [a / b for a, b in zip(rates[name], rates["dp4"], strict=True)]
            out[f"ratio_{name}_to_dp4"] = {"median": round(statistics.median(paired), 3),
                                           "min": round(min(paired), 3), "max": round(max(paired), 3)}
    return out


def theory(schedule: str, m: int, p: int = 2) -> float:
    v = 2 if schedule == "interleaved1f1b" else 1
    return (p - 1) / (v * m + p - 1)


def bubble_result(args: argparse.Namespace, run_group) -> dict:
    schedules = args.schedules.split(",")
    ms = [int(m) for m in args.bubble_microbatches.split(",")]
    group = run_group("pipeline_throughput:bubble", 2,
                      {"model": args.model, "batch": args.bubble_batch, "microbatches": ms, "schedules": schedules,
                       "reps": args.bubble_reps, "steps": args.bubble_steps},
                      collective_timeout_s=120.0, stall_s=600.0)
    if not group.ok:
        raise SystemExit(f"bubble run failed: {group.errors} stalled={group.stalled}\n" + "\n".join(group.logs))
    t0, t1 = group.results
    # Each timed call: the slower rank's time (they start together after the barrier).
    med = {name: statistics.median(max(a[0], b[0]) for a, b in zip(t0[name], t1[name], strict=True)) for name in t0}
    cpu = {name: [round(1000 * statistics.median(c[1] for c in t[name]), 1) for t in (t0, t1)] for name in t0}
    t_whole = med["whole"]
    rows = []
    for m in ms:
        for schedule in schedules:
            t_pipe = med[f"{schedule}-m{m}"]
            rows.append({"schedule": schedule, "microbatches": m, "t_pipeline_ms": round(1000 * t_pipe, 2),
                         "t_whole_ms": round(1000 * t_whole, 2),
                         "t_whole_micro_ms": round(1000 * med[f"whole-m{m}"], 2),
                         "bubble_measured": round(1 - (t_whole / 2) / t_pipe, 3),
                         "bubble_theory": round(theory(schedule, m), 3),
                         "microbatching_cost": round(1 - t_whole / med[f"whole-m{m}"], 3),
                         # The bubble with the micro-batches' own cost taken out: the ideal is the
                         # whole model over the same micro-batches, halved.
                         "bubble_vs_micro": round(1 - (med[f"whole-m{m}"] / 2) / t_pipe, 3),
                         "speedup_vs_whole": round(t_whole / t_pipe, 3),
                         # Each rank's CPU time in the call (its process, gloo's threads included):
                         # against T_whole_micro / 2, what the pipeline adds as work, not as waiting.
                         "cpu_ms_per_rank": cpu[f"{schedule}-m{m}"], "cpu_ms_whole_micro": cpu[f"whole-m{m}"][0],
                         # What the busier rank's CPU time says: the share of T_pipeline it spent off
                         # the CPU (the bubble, and any wait for a core on a shared machine), and the
                         # work the pipeline added to it beyond half the whole model's micro-batches.
                         "idle_share": round(1 - max(cpu[f"{schedule}-m{m}"]) / (1000 * t_pipe), 3),
                         "overhead_cpu_ms": round(max(cpu[f"{schedule}-m{m}"]) - cpu[f"whole-m{m}"][0] / 2, 1)})
    return {"t_whole_ms": round(1000 * t_whole, 2), "cpu_ms_whole": cpu["whole"][0], "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("throughput", "bubble", "both"), default="both")
    p.add_argument("--model", default="small", help="examples/gpt.py MODEL_SIZES name")
    p.add_argument("--schedules", default="1f1b")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4, help="throughput: M of the PP 2 x DP 2 pipelines")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bubble-batch", type=int, default=16)
    p.add_argument("--bubble-microbatches", default="2,4,8")
    p.add_argument("--bubble-reps", type=int, default=5)
    p.add_argument("--bubble-steps", type=int, default=5, help="timed calls of each measurement per round")
    p.add_argument("--quick", action="store_true", help="2 rounds of few steps")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup, args.bubble_reps, args.bubble_steps = 2, 8, 2, 2, 2

    from _rank_group import run_group
    result: dict = {"benchmark": "PP2/PP3", "model": args.model, "schedules": args.schedules,
                    "load_before": round(os.getloadavg()[0], 1)}
    if args.part in ("throughput", "both"):
        result["throughput"] = {"global_batch": args.global_batch, "microbatches": args.microbatches,
                                "reps": args.reps, "steps": args.steps, "warmup": args.warmup,
                                **throughput_result(args, run_group)}
        print(json.dumps(result["throughput"]), file=sys.stderr, flush=True)
    if args.part in ("bubble", "both"):
        result["bubble"] = {"batch": args.bubble_batch, "reps": args.bubble_reps, "steps": args.bubble_steps,
                            **bubble_result(args, run_group)}
    result["machine"] = f"{platform.machine()} {os.cpu_count()} cores, load after {os.getloadavg()[0]:.1f}"
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

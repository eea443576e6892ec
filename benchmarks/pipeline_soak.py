"""PP1: a soak of each pipeline schedule (gpipe, 1f1b, interleaved1f1b), 1,000 steps each, on real
TrainContexts of a gloo group of local processes (no Ray, no controller).

Layouts (`--layouts`): `pp2` (2 ranks, one pipeline of 2 stages), `pp4` (4 ranks, one pipeline of
4 stages) and `pp2xdp2` (4 ranks, 2 pipelines of 2 stages, FSDP2 `replicate` over them). Under
interleaved1f1b each rank runs 2 stages, so the model (a stack of `inp`, 8 residual MLP blocks
and `out`: 10 units, ~10k parameters) is cut into 2P stages. Each layout's schedules run in turn
on one start of its processes (benchmarks/_rank_group.py), every step a whole loop step:
`pipeline.step`, AdamW, `ctx.report`. The group's collective timeout is
FailureConfig(collective_timeout_s) (`--collective-timeout`, default 20 s), set on the process
group as a worker sets it; a watch kills the ranks when none moves for 3 x that.

Per layout and schedule: steps done, median / p99 / max step time (the slowest rank's time of
each step), `slow_steps` (a step over 10 x the median: on this shared machine a scheduling blip
can make one; each listed with its seconds) and `hangs` (a collective timeout, an error, or the
ranks killed by the watch; each described). Target: 0 hangs. One JSON line.

    python benchmarks/pipeline_soak.py [--steps 1000] [--layouts pp2,pp4,pp2xdp2] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
LAYOUTS = {"pp2": (2, 2, 1), "pp4": (4, 4, 1), "pp2xdp2": (4, 2, 2)}    # name: (world, pp, dp)
WIDTH, HIDDEN, BLOCKS = 16, 32, 8
BATCH, MICRO = 8, 4          # per pipeline; 1f1b needs MICRO >= P
SLOW_FACTOR = 10.0


def _stack():
    import torch
    from torch import nn

    class Stack(nn.Module):
        """Units: inp, blocks.0 .. blocks.7, out (a None unit: another stage holds it)."""

        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(WIDTH, HIDDEN)
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                                      nn.Linear(HIDDEN, HIDDEN)) for _ in range(BLOCKS))
            self.out = nn.Linear(HIDDEN, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.inp is not None:
                x = self.inp(x)
            for block in self.blocks if self.blocks is not None else ():
                x = x + block(x)
            return self.out(x) if self.out is not None else x

    return Stack()


class Points:
    """A dataset of random vectors, sample i a pure function of i."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        import torch
        return torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))


def _loss(output, target):
    return (output - target).square().mean()


def split_points(stages: int) -> list[str]:
    return [f"blocks.{k * BLOCKS // stages}" for k in range(1, stages)]


def _context(rank: int, world: int, generation: int, pp: int, steps: int, collective_timeout_s: float):
    import torch

    from elastic._protocol import GenerationPlan, RestoreKind, RestorePlan, RunSpec
    from elastic._worker.state import WorkerState
    from elastic.config import CheckpointConfig, FailureConfig, LRScalingConfig, ScalingConfig
    from elastic.context import TrainContext
    spec = RunSpec(user_code=b"", total_steps=steps, seed=0,
                   scaling=ScalingConfig(strategy="ddp", min_workers=world, pipeline_parallel_size=pp),
                   checkpoint=CheckpointConfig(storage="memory://unused", keep=None, async_save=False),
                   failure=FailureConfig(collective_timeout_s=collective_timeout_s),
                   lr=LRScalingConfig(base_world_size=1, warmup_steps=0, schedule="constant"))
    plan = GenerationPlan(generation=generation, rank=rank, world_size=world, master_addr="127.0.0.1",
                          master_port=0, restore=RestorePlan(RestoreKind.FRESH), timeout_s=collective_timeout_s)
    return TrainContext(plan=plan, spec=spec, worker=WorkerState(), loop_config=None,
                        stop_requested=threading.Event(), preempted=threading.Event(), device=torch.device("cpu"))


def soak(rank: int, world: int, progress, pp: int, steps: int, schedules: list[str],
         collective_timeout_s: float) -> dict:
    """Rank program: each schedule in turn for `steps` steps; per schedule the end time of every
    step, or the error that ended it (the rest of the schedules are then not run: the group is
    broken)."""
    import torch
    out: dict = {}
    done_before = 0
    for i, schedule in enumerate(schedules):
        per_rank = 2 if schedule == "interleaved1f1b" else 1
        ctx = _context(rank, world, i + 1, pp, steps, collective_timeout_s)
        torch.manual_seed(0)      # the same model for every schedule and layout: the same losses
        pipeline = ctx.prepare_pipeline(_stack(), split_points=split_points(pp * per_rank), loss_fn=_loss,
                                        microbatches=MICRO, schedule=schedule, stages_per_rank=per_rank)
        optimizer = ctx.prepare_optimizer(torch.optim.AdamW(pipeline.parameters(), lr=1e-3))
        ctx.restore(model=pipeline, optimizer=optimizer)
        ends: list[float] = []
        start = time.perf_counter()
        record: dict = {"ends": ends, "start": start, "stages": [m for m in pipeline._modules if
                                                                  pipeline._modules[m] is not None]}
        out[schedule] = record
        try:
            for x in ctx.prepare_data(Points(), batch_size=BATCH):
                loss = pipeline.step(x, x.roll(1, dims=1))
                optimizer.step()
                optimizer.zero_grad()
                ctx.report(loss=loss)
                ends.append(time.perf_counter())
                if len(ends) % 10 == 0:
                    progress(done_before + len(ends))
                if len(ends) == steps:
                    break
            record["loss_last"] = float(loss)
        except Exception as error:  # noqa: BLE001 - a hang or failure is the result
            import traceback
            record["error"] = f"{type(error).__name__}: {error}"[:1500]
            record["traceback"] = traceback.format_exc()[-4000:]
            record["failed_after_s"] = round(time.perf_counter() - (ends[-1] if ends else start), 2)
            return out
        done_before += steps
        progress(done_before)
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(layout: str, schedule: str, per_rank: list[dict | None], group, expected: int) -> dict:
    records = [r.get(schedule) if r else None for r in per_rank]
    present = [r for r in records if r]
    steps_done = min((len(r["ends"]) for r in present), default=0) if len(present) == len(records) else 0
    # A step's time: the slowest rank's (ranks of a pipeline wait on each other anyway).
    step_s = []
    for k in range(steps_done):
        step_s.append(max(r["ends"][k] - (r["ends"][k - 1] if k else r["start"]) for r in present))
    timed = step_s[1:] if len(step_s) > 1 else step_s     # the first step builds the schedule's buffers
    median = statistics.median(timed) if timed else None
    slow = [[k + 2, round(s, 4)] for k, s in enumerate(timed) if median and s > SLOW_FACTOR * median]
    # One incident per schedule that did not finish: what each rank saw.
    details = []
    for rank, r in enumerate(records):
        if r and "error" in r:
            details.append({"rank": rank, "after_step": len(r["ends"]), "error": r["error"],
                            "waited_s": r["failed_after_s"], "traceback_tail": r["traceback"][-800:]})
        elif r is None:
            error = group.errors.get(rank, {})
            details.append({"rank": rank, "error": error.get("error", "no result"),
                            "progress": group.progress[rank], "killed_by_watch": group.stalled,
                            "traceback_tail": error.get("traceback", "")[-800:]})
    hangs = 1 if details or steps_done < expected else 0
    return {"layout": layout, "schedule": schedule, "steps_done": steps_done, "hangs": hangs,
            "median_step_s": round(median, 5) if median else None,
            "p99_step_s": round(_quantile(timed, 0.99), 5) if timed else None,
            "max_step_s": round(max(timed), 4) if timed else None,
            "first_step_s": round(step_s[0], 4) if step_s else None,
            "slow_steps": len(slow), "slow_list": slow[:20], "hang_details": details,
            # The last stage's loss at the last step (rank 0's is a zero): equal across schedules, and
            # between pp2 and pp4 (the same model and batches), up to float rounding.
            "loss_last": present[-1].get("loss_last") if present else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--layouts", default="pp2,pp4,pp2xdp2", help=f"comma-separated, of {sorted(LAYOUTS)}")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--collective-timeout", type=float, default=20.0, help="FailureConfig.collective_timeout_s")
    p.add_argument("--quick", action="store_true", help="50 steps")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    steps = 50 if args.quick else args.steps
    schedules = args.schedules.split(",")

    from _rank_group import run_group
    rows, walls = [], {}
    for layout in args.layouts.split(","):
        world, pp, _dp = LAYOUTS[layout]
        group = run_group("pipeline_soak:soak", world,
                          {"pp": pp, "steps": steps, "schedules": schedules,
                           "collective_timeout_s": args.collective_timeout},
                          collective_timeout_s=args.collective_timeout, stall_s=3 * args.collective_timeout,
                          deadline_s=3600)
        walls[layout] = group.wall_s
        for schedule in schedules:
            row = summarize(layout, schedule, group.results, group, steps)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("slow_list", "hang_details")}),
                  file=sys.stderr, flush=True)
        if not group.ok:
            print(f"{layout}: group failed: errors={group.errors} stalled={group.stalled}\n"
                  + "\n".join(f"--- rank {r}\n{log}" for r, log in enumerate(group.logs)), file=sys.stderr)
    result = {"benchmark": "PP1", "steps": steps, "collective_timeout_s": args.collective_timeout,
              "microbatches": MICRO, "batch_per_pipeline": BATCH,
              "total_hangs": sum(r["hangs"] for r in rows), "wall_s": walls,
              "machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
              "rows": rows}
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0 if result["total_hangs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

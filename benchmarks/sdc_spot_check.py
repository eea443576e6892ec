"""SDC5: the compute spot check (elastic._worker.spot_check): what a check costs, and does it find
a persistent wrong gradient on DDP with 3 replicas within spot_check_every_n_steps steps, name the
right rank, commit nothing corrupt, and end on the fault-free model?

Cost (`--cost-only`, or first in a full run): one process, a gloo group of 1, the example GPT
(`--model-size`, default small, batch `--batch`) under DDP; training steps (forward, backward,
AdamW) and spot checks (the broadcast of the kept input, the recompute with `autograd.grad`, the
statistics, the all-gather) timed alternately, `--reps` of each. The overhead at K is the median
check over K median steps. It leaves out what a larger group adds to the two collectives (an input
of one micro-batch, one row of 2 + 3 x tensors floats a rank).

Detection (`--trials N`): each trial runs the example GPT (`tiny`, batch 4) on 3 workers with the
default FailureConfig (spot check every K steps) and checkpoints every `--checkpoint-every` steps;
the fault gate's BadGradientAt flips one bit (mantissa or sign) of one element of one parameter's
gradient on one rank, in every backward from a drawn step on (before the all-reduce: every
replica trains on it, their parameters agree). A fault-free run of the same configuration is the
reference. Per trial:
- detected_within: the verdict's step minus the step the fault was armed after (at most K);
- named_right: the recovery's failures entry names exactly that rank;
- model_equal: summary.json's model_sha256 equals the reference's;
- corrupt_commits: committed checkpoints written by generation 0 after the fault began: none.

    python benchmarks/sdc_spot_check.py --trials 10 --out sdc5.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import _peer_common as pc  # noqa: E402
import gpt  # noqa: E402
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig  # noqa: E402
from elastic._worker.fault_gate import SILENT_BITS, BadGradientAt  # noqa: E402
from sdc_bitflip import corrupt_commits  # noqa: E402

CONFIG = {"model_size": "tiny", "batch_size": 4}
K = FailureConfig().spot_check_every_n_steps


def cost(model_size: str, batch: int, reps: int) -> dict:
    """Median seconds of a training step and of a spot check, timed alternately in one process."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic._worker.spot_check import SpotCheck
    from elastic._worker.state import WorkerState
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        cfg = gpt.GPTConfig.named(model_size)
        torch.manual_seed(0)
        model = DistributedDataParallel(gpt.GPT(cfg))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))
        y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))
        worker = WorkerState()
        spot = SpotCheck(model.module, every=1, checkpoint_every=None, total_steps=10**9, worker=worker, rank=0,
                         world_size=1, device=torch.device("cpu"), exact=True, seed=0, autocast=contextlib.nullcontext,
                         verified_through=0)

        def step() -> None:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            worker.progress.step += 1

        steps, checks = [], []
        for _ in range(3):
            step()
            spot.check(worker.progress.step)
        for _ in range(reps):
            started = time.perf_counter()
            step()                                   # keeps its input: every step is due at K = 1
            steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            spot.check(worker.progress.step)
            checks.append(time.perf_counter() - started)
        step_s, check_s = statistics.median(steps), statistics.median(checks)
        return {"model_size": model_size, "parameters": sum(p.numel() for p in model.parameters()), "batch": batch,
                "reps": reps, "step_ms": round(1e3 * step_s, 3), "check_ms": round(1e3 * check_s, 3),
                "check_per_step": round(check_s / step_s, 3),
                "overhead_at_k": {k: round(check_s / (k * step_s), 4) for k in (10, 25, 50, 100)}}
    finally:
        dist.destroy_process_group()


def run(run_dir: str, steps: int, checkpoint_every: int, bad: BadGradientAt | None = None) -> dict:
    """The run's summary.json (its `error` says how a failed one ended)."""
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config={**CONFIG, **(bad.as_config() if bad else {})}, total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=3, max_workers=3, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=checkpoint_every),
        failure=FailureConfig(max_failures=3)).fit()
    if not result.ok and bad is None:
        raise SystemExit(f"the reference run {run_dir} failed: {result.error}")
    return result.summary


def detection(trials: int, steps: int, checkpoint_every: int, seed: int) -> dict:
    import ray
    rng = random.Random(seed)
    shapes = [t.numel() for t in gpt.GPT(gpt.GPTConfig.named(CONFIG["model_size"])).parameters()]
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)   # logical CPUs: 1 per worker
    out = []
    try:
        with tempfile.TemporaryDirectory(prefix="sdc5-") as d:
            reference = run(os.path.join(d, "clean", "run"), steps, checkpoint_every)["model_sha256"]
            for n in range(trials):
                param = rng.randrange(len(shapes))
                bad = BadGradientAt(step=rng.randrange(5, steps - K - 5), rank=rng.randrange(3),
                                    marker_file=os.path.join(d, f"bad-{n}"), param=param,
                                    element=rng.randrange(shapes[param]), bit=rng.choice(SILENT_BITS))
                run_dir = os.path.join(d, f"t{n}", "run")
                started = time.monotonic()
                summary = run(run_dir, steps, checkpoint_every, bad)
                sdc = [r for r in summary["recoveries"] if r["cause"] == "sdc"]
                failure = sdc[0]["failures"][0] if sdc else {}
                verdict = failure.get("step")
                trial = {"fault": {"after_step": bad.step, "rank": bad.rank, "param": bad.param,
                                   "element": bad.element, "bit": bad.bit},
                         "armed": os.path.exists(bad.marker_file),
                         "status": summary["status"], "error": (summary.get("error") or {}).get("type"),
                         "recoveries": [(r["cause"], r["rung"], r["step"], r["lost_steps"])
                                        for r in summary["recoveries"]],
                         "detected_within": None if verdict is None else verdict - bad.step,
                         "named_right": failure.get("ranks") == [bad.rank],
                         "model_equal": summary.get("model_sha256") == reference,
                         "corrupt_commits": corrupt_commits(run_dir, bad.step + 1),
                         "wall_s": round(time.monotonic() - started, 1)}
                out.append(trial)
                print(json.dumps(trial), file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    ok = [t for t in out if t["armed"] and t["detected_within"] is not None and t["detected_within"] <= K
          and t["named_right"] and t["model_equal"] and not t["corrupt_commits"]]
    within = [t["detected_within"] for t in out if t["detected_within"] is not None]
    return {"trials": len(out), "all_checks_passed": len(ok), "k": K, "steps": steps,
            "checkpoint_every": checkpoint_every, "seed": seed,
            "detected": len(within), "detected_within_max": max(within, default=None),
            "named_right": sum(t["named_right"] for t in out), "model_equal": sum(t["model_equal"] for t in out),
            "corrupt_commits": sum(len(t["corrupt_commits"]) for t in out), "per_trial": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steps", type=int, default=2 * K + 20)
    p.add_argument("--checkpoint-every", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-size", default="small", choices=sorted(gpt.MODEL_SIZES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--cost-only", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    out: dict = {"benchmark": "SDC5", "cost": cost(args.model_size, args.batch, args.reps)}
    print(json.dumps(out["cost"]), file=sys.stderr, flush=True)
    if not args.cost_only:
        out["detection"] = detection(args.trials, args.steps, args.checkpoint_every, args.seed)
    pc.emit(out, None, None, args.out)


if __name__ == "__main__":
    main()

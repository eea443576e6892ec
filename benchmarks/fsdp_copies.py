"""F2: the steady-state cost of the copies in host memory (CheckpointConfig.in_memory_every_n_steps,
and the nodes' keepers, CheckpointConfig.node_copies).

Runs the example loop (FSDP, or DDP, whose copies come with FailureConfig.sdc_check, on by
default) with the copies off and at each K given, alternating the configurations rep by rep (so a
change in the machine's load hits them alike), and prints one JSON line: per configuration the
mean step time (from metrics.jsonl, over the steps after the first `--skip`: a mean, since with
K > 1 only every K-th step pays for the copy), and its ratio to the run without copies, paired
by rep. `--keepers both` runs each K with and without the node keepers' copy ("K" and
"K-no-keeper"); `on` (the default, as CheckpointConfig's) or `off` runs one of them.

    python benchmarks/fsdp_copies.py --workers 2 --model-size base --steps 60 --reps 6 --every 1 10
    python benchmarks/fsdp_copies.py --strategy ddp --workers 2 --model-size small --steps 80 --reps 3 \
        --every 10 --keepers both
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from itertools import pairwise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import gpt  # noqa: E402
from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig  # noqa: E402


def step_time(args: argparse.Namespace, every: int | None, keepers: bool) -> float:
    """Mean seconds per step of one run (steps past the first `skip`)."""
    with tempfile.TemporaryDirectory(prefix="f2-") as run_dir:
        result = ElasticTrainer(
            gpt.train_loop, train_loop_config={"model_size": args.model_size, "batch_size": args.batch_size},
            scaling=ScalingConfig(min_workers=args.workers, max_workers=args.workers, strategy=args.strategy),
            checkpoint=CheckpointConfig(storage=run_dir, in_memory_every_n_steps=every, node_copies=keepers),
            total_steps=args.steps, seed=0).fit()
        if not result.ok:
            raise SystemExit(f"run failed: {result.error!r}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            times = [json.loads(line)["time"] for line in f if line.strip()][args.skip:]
    return statistics.mean(b - a for a, b in pairwise(times))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model-size", default="base", choices=sorted(gpt.MODEL_SIZES))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the median (start-up)")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--every", type=int, nargs="+", default=[1, 10], help="the K values to measure")
    p.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"])
    p.add_argument("--keepers", default="on", choices=["on", "off", "both"],
                   help="the nodes' keepers (CheckpointConfig.node_copies) with each K: on, off or both")
    args = p.parse_args()

    import ray
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.workers + 2), include_dashboard=False,
             logging_level="WARNING", log_to_driver=False)
    keeper_arms = {"on": [True], "off": [False], "both": [True, False]}[args.keepers]
    # (label, K, keepers); the label of a K without the keepers' copy says so when both are run.
    configs: list[tuple[str, int | None, bool]] = [("None", None, False)] + [
        (str(k) if keepers or args.keepers == "off" else f"{k}-no-keeper", k, keepers)
        for k in args.every for keepers in keeper_arms]
    runs: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    try:
        for rep in range(args.reps):
            order = configs if rep % 2 == 0 else list(reversed(configs))
            for label, every, keepers in order:
                runs[label].append(step_time(args, every, keepers))
                print(f"rep {rep} {label}: {runs[label][-1]:.4f} s/step", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    off = runs["None"]
    print(json.dumps({
        "benchmark": "F2", "strategy": args.strategy, "keepers": args.keepers, "workers": args.workers,
        "model_size": args.model_size, "batch_size": args.batch_size,
        "steps": args.steps, "reps": args.reps, "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "step_s_mean_median_of_reps": {k: round(statistics.median(v), 4) for k, v in runs.items()},
        # Paired by rep: each K against the run without copies of the same rep.
        "ratio_to_off_median": {k: round(statistics.median(x / y for x, y in zip(v, off, strict=True)), 4)
                                for k, v in runs.items() if k != "None"},
        "ratio_to_off_per_rep": {k: [round(x / y, 3) for x, y in zip(v, off, strict=True)]
                                 for k, v in runs.items() if k != "None"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

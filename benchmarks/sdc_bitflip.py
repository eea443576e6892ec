"""SDC2: one flipped bit on DDP with 3 replicas, N trials: is it found within one step, is the right
rank named, does the run end on the fault-free model, and was nothing corrupt committed?

Each trial runs the example GPT (`tiny`, batch 4) on 3 workers for `--steps` steps with
checkpoints every 8 steps and copies in memory every 10 (DDP keeps them under
FailureConfig.sdc_check), and the fault gate's BitFlipAt flips one bit of one parameter on one
rank after a step: rank, step, parameter, element and bit drawn from a seeded generator. `--bits
silent` (the default) draws from the mantissa (bits 0-22) and the sign (31): the flips that leave
a plausible number that trains on. `--bits all` adds the exponent (23-30), whose high bits turn a
weight into inf or NaN: the next step's loss is then non-finite, its gradient NaN on every replica
after the all-reduce, and the run fails loudly with NonFiniteLossError (recorded as such) unless
the fingerprint saw it first. A fault-free run of the same configuration is the reference. Per
trial it records:
- detected_within: the verdict's step minus the step the bit was flipped after (1: the next step);
- named_right: the recovery's failures entry names exactly the flipped rank;
- model_equal: summary.json's model_sha256 equals the reference's;
- corrupt_commits: committed checkpoints written by the corrupt generation (a data folder of
  generation 0) at the verdict's step or later: must be none.

    python benchmarks/sdc_bitflip.py --trials 20 --out sdc.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import ray  # noqa: E402

import _peer_common as pc  # noqa: E402
import gpt  # noqa: E402
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig  # noqa: E402
from elastic._worker.fault_gate import BitFlipAt  # noqa: E402

CONFIG = {"model_size": "tiny", "batch_size": 4}


def run(run_dir: str, steps: int, flip: BitFlipAt | None = None) -> dict:
    """The run's summary.json (its `error` says how a failed one ended)."""
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config={**CONFIG, **(flip.as_config() if flip else {})}, total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=3, max_workers=3, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=8, in_memory_every_n_steps=10),
        failure=FailureConfig(max_failures=3)).fit()
    if not result.ok and flip is None:
        raise SystemExit(f"the reference run {run_dir} failed: {result.error}")
    return result.summary


def corrupt_commits(run_dir: str, from_step: int) -> list[int]:
    """Steps >= from_step whose committed checkpoint holds data written by generation 0."""
    found = []
    for committed in glob.glob(os.path.join(run_dir, "checkpoints", "step_*", "COMMITTED")):
        doc = json.load(open(committed))
        if doc["step"] >= from_step and doc["generation"] == 0:
            found.append(doc["step"])
    return sorted(found)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", choices=("silent", "all"), default="silent")
    p.add_argument("--out")
    args = p.parse_args()
    rng = random.Random(args.seed)
    bits = [*range(23), 31] if args.bits == "silent" else list(range(32))
    shapes = [t.numel() for t in gpt.GPT(gpt.GPTConfig.named(CONFIG["model_size"])).parameters()]
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)   # logical CPUs: 1 per worker
    trials = []
    try:
        with tempfile.TemporaryDirectory(prefix="sdc-") as d:
            reference = run(os.path.join(d, "clean", "run"), args.steps)["model_sha256"]
            for n in range(args.trials):
                param = rng.randrange(len(shapes))
                flip = BitFlipAt(step=rng.randrange(11, args.steps - 3), rank=rng.randrange(3),
                                 marker_file=os.path.join(d, f"flip-{n}"), param=param,
                                 element=rng.randrange(shapes[param]), bit=rng.choice(bits))
                run_dir = os.path.join(d, f"t{n}", "run")
                started = time.monotonic()
                summary = run(run_dir, args.steps, flip)
                sdc = [r for r in summary["recoveries"] if r["cause"] == "sdc"]
                failure = sdc[0]["failures"][0] if sdc else {}
                verdict = failure.get("step")
                trial = {"flip": {"step": flip.step, "rank": flip.rank, "param": flip.param, "element": flip.element,
                                  "bit": flip.bit},
                         "flipped": os.path.exists(flip.marker_file),
                         "status": summary["status"], "error": (summary.get("error") or {}).get("type"),
                         "recoveries": [(r["cause"], r["rung"], r["step"], r["lost_steps"])
                                        for r in summary["recoveries"]],
                         "detected_within": None if verdict is None else verdict - flip.step,
                         "named_right": failure.get("ranks") == [flip.rank],
                         "model_equal": summary.get("model_sha256") == reference,
                         "corrupt_commits": corrupt_commits(run_dir, verdict if verdict is not None else flip.step + 1),
                         "wall_s": round(time.monotonic() - started, 1)}
                trials.append(trial)
                print(json.dumps(trial), file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    ok = [t for t in trials if t["flipped"] and t["detected_within"] == 1 and t["named_right"] and t["model_equal"]
          and not t["corrupt_commits"]]
    out = {"benchmark": "SDC2", "trials": len(trials), "all_checks_passed": len(ok),
           "detected_within_1": sum(t["detected_within"] == 1 for t in trials),
           "named_right": sum(t["named_right"] for t in trials), "model_equal": sum(t["model_equal"] for t in trials),
           "corrupt_commits": sum(len(t["corrupt_commits"]) for t in trials), "seed": args.seed,
           "steps": args.steps, "bits": args.bits,
           "failed_loud": sum(t["status"] == "failed" for t in trials), "per_trial": trials}
    pc.emit(out, None, None, args.out)


if __name__ == "__main__":
    main()

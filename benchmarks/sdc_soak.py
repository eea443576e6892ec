"""SDC3: false alarms of the silent-corruption check in clean runs: every step's fingerprints compared
over thousands of fault-free steps on each layout, counting any `sdc` recovery (there must be none).

Layouts (the example GPT, `tiny`, FailureConfig.sdc_check on, as by default):
- ddp3: DDP on 3 workers (every rank compared with the two others);
- tp2xdp2: TP 2 x DP 2 under DDP (each TP rank's shard compared with the other replica's);
- pp2xdp2: PP 2 x DP 2, 1F1B with 2 micro-batches (each stage compared with the other pipeline's);
- fsdp2: FSDP on 2 workers, where nothing is compared (no replicas): the run shows what FSDP pays
  (nothing) and that the check stays quiet there.

    python benchmarks/sdc_soak.py --steps 3400 --out soak.json      # ~10,000 compared steps in all
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import ray  # noqa: E402

import _peer_common as pc  # noqa: E402
import gpt  # noqa: E402
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig  # noqa: E402

LAYOUTS = {
    "ddp3": ({"min_workers": 3, "max_workers": 3}, {}),
    "tp2xdp2": ({"min_workers": 4, "max_workers": 4, "tensor_parallel_size": 2}, {}),
    "pp2xdp2": ({"min_workers": 4, "max_workers": 4, "pipeline_parallel_size": 2},
                {"pp_schedule": "1f1b", "microbatches": 2}),
    "fsdp2": ({"min_workers": 2, "max_workers": 2, "strategy": "fsdp"}, {}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3400, help="steps per layout")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out")
    args = p.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)   # logical CPUs: 1 per worker
    runs = {}
    try:
        with tempfile.TemporaryDirectory(prefix="sdc-soak-") as d:
            for name in args.layouts.split(","):
                scaling, extra = LAYOUTS[name]
                started = time.monotonic()
                result = ElasticTrainer(
                    gpt.train_loop, train_loop_config={"model_size": "tiny", "batch_size": 4, **extra},
                    total_steps=args.steps, seed=0, scaling=ScalingConfig(startup_wait_s=120, **scaling),
                    checkpoint=CheckpointConfig(storage=os.path.join(d, name), every_n_steps=500),
                    failure=FailureConfig(sdc_check=True)).fit()
                summary = result.summary
                recoveries = summary.get("recoveries") or []
                runs[name] = {"status": summary.get("status"), "final_step": result.final_step,
                              "sdc_recoveries": sum(r["cause"] == "sdc" for r in recoveries),
                              "other_recoveries": [r["cause"] for r in recoveries if r["cause"] != "sdc"],
                              "compared": name != "fsdp2", "wall_s": round(time.monotonic() - started, 1)}
                print(name, json.dumps(runs[name]), file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    compared = sum(r["final_step"] for r in runs.values() if r["compared"] and r["status"] == "finished")
    out = {"benchmark": "SDC3", "steps_per_layout": args.steps, "compared_steps": compared,
           "false_mismatches": sum(r["sdc_recoveries"] for r in runs.values()), "runs": runs}
    pc.emit(out, None, None, args.out)


if __name__ == "__main__":
    main()

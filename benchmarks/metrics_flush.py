"""M1: cost of one metrics.jsonl flush late in a long run (the controller flushes about once a second).

Records N-10 steps, flushes, records 10 more (a second at 10 steps/s), and times that last flush:
the run record's cost per flush at step N. Prints one JSON line.

    python benchmarks/metrics_flush.py --steps 100000 [--storage DIR_OR_URL]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic._controller.run_record import RunRecorder
from elastic._protocol import StepRecord


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--storage", default=None, help="default: a fresh temporary directory")
    args = parser.parse_args()
    storage = args.storage or tempfile.mkdtemp(prefix="metrics-flush-")
    recorder = RunRecorder(storage, None, total_steps=args.steps, config={})
    recorder.on_generation_start(0, 4)

    def record(step: int) -> StepRecord:
        return StepRecord(step=step, loss=1.0, world_size=4, time=float(step), samples_seen=32 * step,
                          global_batch=32, metrics={"lr": 3e-4}, compute_s=(0.1, 0.1, 0.1, 0.1))

    for step in range(1, args.steps - 10 + 1):
        recorder.on_step(record(step))
    recorder.flush_metrics()
    for step in range(args.steps - 10 + 1, args.steps + 1):
        recorder.on_step(record(step))
    started = time.perf_counter()
    recorder.flush_metrics()
    flush_ms = (time.perf_counter() - started) * 1000
    print(json.dumps({"bench": "metrics_flush", "steps": args.steps, "flush_ms": round(flush_ms, 1),
                      "storage": storage}))


if __name__ == "__main__":
    main()

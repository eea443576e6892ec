"""R5: how long a run has no controller after a SIGKILL of the controller's process, and what it
costs the run.

Each trial runs the example GPT (`tiny`, batch 8) on 2 workers (DDP, or FSDP with 3 workers) on
an embedded local Ray. The ranks hold after a drawn step (the fault gate's HoldAt); this script
SIGKILLs the controller's process (status.json names it), releases the ranks at once, so they
train on while no controller is there, and waits for the run's Result. Per trial:
- kill_to_adopted_s: from the SIGKILL (this process's clock) to the replacement's adoption's end
  (summary.json controller_restarts[0].adopted_at: same machine, same clock);
- without_controller_s: the run's own record (from the lost controller's last sign of life);
- workers_kept: the workers' pids after the run are those before the kill;
- steps_once: metrics.jsonl has each step 1..total once; recoveries: none.

    python benchmarks/controller_restart.py --trials 5 --out r5.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import gpt  # noqa: E402
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig  # noqa: E402
from elastic._worker.fault_gate import HoldAt  # noqa: E402


def read_json(run_dir: str, name: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def trial(run_dir: str, strategy: str, at_step: int, steps: int) -> dict:
    gate = run_dir + ".released"
    seen: dict = {}

    def kill() -> None:
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                status = read_json(run_dir, "status.json") or {}
                if status.get("state") == "running" and status.get("step", 0) >= at_step \
                        and status.get("controller") and status.get("workers"):
                    seen["workers"] = sorted(w["pid"] for w in status["workers"])
                    seen["pid"] = status["controller"]["pid"]
                    seen["killed_at"] = time.time()
                    os.kill(seen["pid"], signal.SIGKILL)
                    while alive(seen["pid"]):
                        time.sleep(0.01)
                    return
                time.sleep(0.02)
        finally:
            open(gate, "w").close()

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    workers = (2, 2) if strategy == "ddp" else (3, 3)
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config={"model_size": "tiny", "batch_size": 8,
                                           **HoldAt(at_step, gate).as_config()},
        total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=workers[0], max_workers=workers[1], strategy=strategy, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=50),
        failure=FailureConfig(heartbeat_timeout_s=10.0, rendezvous_timeout_s=60.0)).fit()
    killer.join(timeout=5)
    s = result.summary
    restart = (s.get("controller_restarts") or [{}])[0]
    status = read_json(run_dir, "status.json") or {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metric_steps = [json.loads(line)["step"] for line in f]
    return {"strategy": strategy, "ok": result.ok, "at_step": at_step, "kind": restart.get("kind"),
            "kill_to_adopted_s": round(restart["adopted_at"] - seen["killed_at"], 3) if restart else None,
            "without_controller_s": restart.get("without_controller_s"),
            "workers_kept": sorted(w["pid"] for w in status.get("workers") or []) == seen.get("workers"),
            "steps_once": metric_steps == list(range(1, steps + 1)), "recoveries": len(s.get("recoveries") or [])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    import ray
    ray.init(address="local", num_cpus=6, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            for i in range(args.trials):
                row = trial(os.path.join(tmp, f"{strategy}-{i}"), strategy, rng.randint(20, 60), args.steps)
                print(json.dumps(row), flush=True)
                rows.append(row)
    report = {"trials": rows}
    for strategy in args.strategies.split(","):
        mine = [r for r in rows if r["strategy"] == strategy]
        report[strategy] = {
            "median_kill_to_adopted_s": statistics.median(r["kill_to_adopted_s"] for r in mine),
            "max_kill_to_adopted_s": max(r["kill_to_adopted_s"] for r in mine),
            "median_without_controller_s": statistics.median(r["without_controller_s"] for r in mine),
            "all_ok": all(r["ok"] and r["workers_kept"] and r["steps_once"] and r["recoveries"] == 0
                          and r["kind"] == "running" for r in mine)}
    print(json.dumps({k: v for k, v in report.items() if k != "trials"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()

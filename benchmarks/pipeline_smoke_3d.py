"""PP4: a 3-D smoke: PP 2 x TP 2 x DP 2 = 8 ranks of the main job (examples/pretrain.py, the `tiny`
GPT) that trains, survives one SIGKILL of a rank, and finishes.

Runs `examples/pretrain.py --pp 2 --tp 2 --workers 4:8 --hold-at STEP:FILE ...` as a subprocess
on a local Ray of its own (pretrain.py's elastic.local_ray with 8 logical CPUs, stopped at the
end whatever happened; any RAY_ADDRESS is removed from its environment). When status.json shows
the run at STEP with its 8 workers, the rank `--rank` (default 5: pipeline 1, stage 0, TP rank 1) is sent SIGKILL from
outside, by its pid in status.json, then FILE is created and the ranks go on. Reports the exit
code, the summary's status, final step, recoveries (cause, rung, detect_s, recover_s, lost steps,
worlds), layout and world-size history (`regrown`: the lost pipeline back, DP 2 again, before the
end), the seconds from the kill to the next completed step (metrics.jsonl) and the loss's first
and last values. One JSON line.

    python benchmarks/pipeline_smoke_3d.py [--steps 100 --hold-step 15 --checkpoint-every 10 --rank 5]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

from elastic.local_ray import LocalRay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--hold-step", type=int, default=15)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--rank", type=int, default=5, help="rank killed (status.json's pid)")
    p.add_argument("--pp-schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds for the whole run")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="pp3d-") as tmp:
        storage, release = os.path.join(tmp, "run"), os.path.join(tmp, "release")
        cmd = [sys.executable, os.path.join(ROOT, "examples", "pretrain.py"), "--storage", storage,
               "--workers", "4:8", "--pp", "2", "--tp", "2", "--pp-schedule", args.pp_schedule,
               "--microbatches", str(args.microbatches), "--model-size", "tiny", "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
               "--hold-at", f"{args.hold_step}:{release}", "--quiet"]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
        started = time.time()
        log_path = os.path.join(tmp, "pretrain.log")
        fault: dict = {}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                deadline = time.monotonic() + args.timeout
                while proc.poll() is None and time.monotonic() < deadline:
                    status = _json(os.path.join(storage, "status.json")) or {}
                    if (not fault and status.get("state") == "running" and status.get("step", 0) >= args.hold_step
                            and len(status.get("workers", [])) == 8):
                        worker = next(w for w in status["workers"] if w["rank"] == args.rank)
                        fault = {"signal_time": time.time(), "pid": worker["pid"], "rank": args.rank,
                                 "place": {k: worker.get(k) for k in ("replica", "pp_rank", "tp_rank")},
                                 "layout_before": status.get("layout"), "step": status.get("step")}
                        os.kill(worker["pid"], signal.SIGKILL)
                        with open(release, "w"):
                            pass
                    time.sleep(0.05)
                if proc.poll() is None:
                    fault["timed_out"] = True
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                LocalRay(storage).stop()        # the run's own Ray outlives a killed driver
        summary = _json(os.path.join(storage, "summary.json")) or {}
        metrics = []
        if os.path.exists(os.path.join(storage, "metrics.jsonl")):
            with open(os.path.join(storage, "metrics.jsonl")) as f:
                metrics = [json.loads(line) for line in f if line.strip()]
        steps = [m for m in metrics if "loss" in m and m.get("step") is not None]
        recoveries = summary.get("recoveries", [])
        failure = next((r for r in recoveries if r.get("cause") != "scale_up"), None)
        next_step = None
        if failure and "signal_time" in fault:
            after = [m for m in steps if m["step"] == failure["step"] + 1 and m["time"] > fault["signal_time"]]
            next_step = round(after[0]["time"] - fault["signal_time"], 3) if after else None
        with open(log_path, errors="replace") as f:
            log_tail = f.read()[-3000:]
    result = {"benchmark": "PP4", "command": " ".join(cmd[1:]), "exit_code": proc.returncode,
              "status": summary.get("status"), "final_step": summary.get("final_step"), "fault": fault,
              "kill_to_next_step_s": next_step,
              "recoveries": [{k: r.get(k) for k in ("cause", "rung", "step", "detect_s", "recover_s", "lost_steps",
                                                    "from_world", "to_world")} for r in recoveries],
              "world_size_history": summary.get("world_size_history"),
              # The lost pipeline back (a new worker completing it) before the run ended.
              "regrown": bool(failure) and any(step > failure["step"] and world == 8
                                                for step, world in summary.get("world_size_history") or []),
              "layout_history": summary.get("layout_history"),
              "loss_first": summary.get("loss_first"), "loss_last": summary.get("loss_last"),
              "wall_s": summary.get("wall_s"), "goodput": summary.get("goodput"),
              "step_s_median_before_kill": None, "run_s": round(time.time() - started, 1),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"}
    before = [m["time"] for m in steps if "signal_time" in fault and m["time"] < fault["signal_time"]]
    if len(before) > 2:
        gaps = sorted(b - a for a, b in zip(before, before[1:], strict=False))
        result["step_s_median_before_kill"] = round(gaps[len(gaps) // 2], 3)
    if proc.returncode != 0 or summary.get("status") != "finished":
        result["log_tail"] = log_tail
    print(json.dumps(result))
    return 0 if result["status"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())

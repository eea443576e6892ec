"""R1/R2 side by side: recovery after SIGKILL (R1) or SIGSTOP (R2) of one of N workers, ours
against Ray Train's `TorchTrainer` (Train v2 API, the default in Ray 2.60) with
`FailureConfig(max_failures=...)`, the same GPT, batch, checkpoint interval and kill step.

Per trial and system: seconds from the signal to the next completed step (`recovery_s`), to the
first step past the last one completed before the signal (`catchup_s`, includes redoing lost
steps) and the steps lost. A system that has not completed a step `--cap-s` seconds after the
signal is recorded as not recovered (`recovered: false`), and the run is ended (the stopped
process is killed). Prints one JSON line.

    python benchmarks/peer_raytrain.py --workers 4 --trials 3 [--signal STOP] [--plot r1.png]

Ray Train keeps checkpoints the way its docs show: rank 0 `torch.save`s model + optimizer into a
temporary directory and every rank calls `ray.train.report(..., checkpoint=...)` (synchronous
upload) every `--checkpoint-every` steps to a local `storage_path`. Its step times come from a
line rank 0 appends after each step (no `report` per step: that is a barrier through Ray).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peer_common as pc

HEALTH_ENV = "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"


# ---- Ray Train ------------------------------------------------------------------------------
def raytrain_loop(config: dict) -> None:
    """train_loop_per_worker for TorchTrainer: the same model, data and step as gpt.train_loop."""
    import ray.train
    import ray.train.torch
    import torch

    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir, attempt = config["run_dir"], time.time()
    with open(os.path.join(run_dir, "pids", f"{rank}.json.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "attempt": attempt}, f)
    os.replace(os.path.join(run_dir, "pids", f"{rank}.json.tmp"), os.path.join(run_dir, "pids", f"{rank}.json"))
    if os.path.exists(os.path.join(run_dir, "ABORT")):
        return   # the benchmark gave up on this trial (cap reached): end the run quickly
    model = ray.train.torch.prepare_model(pc.build_model(config["model_size"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = int(state["step"])
    batches = pc.Batches(config["model_size"], config["batch_size"])
    metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a") if rank == 0 else None
    for step in range(start, config["steps"]):
        loss = pc.train_step(model, optimizer, batches.batch(step, rank, world))
        done = step + 1
        if metrics is not None:
            metrics.write(json.dumps({"step": done, "time": time.time(), "loss": loss.item(),
                                      "world_size": world, "attempt": attempt}) + "\n")
            metrics.flush()
        if done % config["checkpoint_every"] == 0 and done < config["steps"]:
            if rank == 0:
                with tempfile.TemporaryDirectory() as d:
                    torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(), "step": done},
                               os.path.join(d, "state.pt"))
                    ray.train.report({"step": done}, checkpoint=ray.train.Checkpoint.from_directory(d))
            else:
                ray.train.report({"step": done}, checkpoint=None)


def _inject(metrics: str, pid_of, at_step: int, sig: int, cap_s: float, out: dict, recovered,
            abort_file: str, stop: threading.Event) -> None:
    """Signal the rank's pid once `metrics` shows `at_step`; with SIGSTOP or a peer that does not
    come back, give up after `cap_s`: write `abort_file` and SIGKILL the target so the run ends."""
    reached = pc.wait_for(lambda: stop.is_set() or (pc.read_jsonl(metrics) or [{}])[-1].get("step", 0) >= at_step, 900)
    if not reached or stop.is_set():
        return
    pid = pid_of()
    out.update(pid=pid, signal_time=time.time())
    os.kill(pid, sig)
    if pc.wait_for(lambda: recovered(out["signal_time"]), cap_s, poll_s=0.05):
        if sig == signal.SIGSTOP:
            _kill(pid)
        return
    out["capped"] = True
    open(abort_file, "w").close()
    _kill(pid)


def _kill(pid: int) -> None:
    for s in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(pid, s)
        except ProcessLookupError:
            return


def outcome(lines: list[dict], fault: dict, after: list[dict], cap_s: float) -> dict:
    """recovery_s, catchup_s, steps lost, from completion times and the post-fault lines `after`."""
    t0 = fault["signal_time"]
    before = [m for m in lines if m["time"] < t0]
    last_before = max((m["step"] for m in before), default=0)
    res = {"step_s": pc.median_interval([m["time"] for m in before][-21:]), "last_step_before": last_before}
    if fault.get("capped") or not after:
        return {**res, "recovered": False, "recovery_s": None, "catchup_s": None, "lost_steps": None,
                "capped_at_s": cap_s}
    first = after[0]
    catch = next((m for m in after if m["step"] > last_before), None)
    return {**res, "recovered": True, "recovery_s": round(first["time"] - t0, 3),
            "catchup_s": round(catch["time"] - t0, 3) if catch else None,
            "restored_step": first["step"] - 1, "lost_steps": max(0, last_before - (first["step"] - 1))}


def raytrain_trial(args: argparse.Namespace, run_dir: str) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    os.makedirs(os.path.join(run_dir, "pids"))
    if args.raytrain_health_timeout is not None:
        os.environ[HEALTH_ENV] = str(args.raytrain_health_timeout)
    else:
        os.environ.pop(HEALTH_ENV, None)
    sig = getattr(signal, f"SIG{args.signal}")
    metrics = os.path.join(run_dir, "metrics.jsonl")

    def pid_of() -> int:
        with open(os.path.join(run_dir, "pids", f"{args.rank}.json")) as f:
            return json.load(f)["pid"]

    def recovered(t0: float) -> bool:
        return any(m["attempt"] > t0 for m in pc.read_jsonl(metrics))

    fault: dict = {}
    stop = threading.Event()
    injector = threading.Thread(target=_inject, daemon=True, args=(
        metrics, pid_of, args.kill_step, sig, args.cap_s, fault, recovered, os.path.join(run_dir, "ABORT"), stop))
    injector.start()
    trainer = TorchTrainer(
        raytrain_loop,
        train_loop_config={"run_dir": run_dir, "model_size": args.model_size, "batch_size": args.batch_size,
                           "lr": 3e-3, "steps": args.steps, "checkpoint_every": args.checkpoint_every,
                           "threads": 1},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="peer", storage_path=os.path.join(run_dir, "storage"),
                             failure_config=FailureConfig(max_failures=args.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    error = None
    try:
        trainer.fit()
    except Exception as e:   # noqa: BLE001 - reported in the JSON, not raised
        error = f"{type(e).__name__}: {str(e)[:300]}"
    stop.set()
    injector.join(timeout=5)
    if "pid" in fault and sig == signal.SIGSTOP:
        _kill(fault["pid"])   # never leave a stopped process behind
    if "signal_time" not in fault:
        raise SystemExit(f"Ray Train trial never reached step {args.kill_step}: {error}")
    lines = pc.read_jsonl(metrics)
    after = [m for m in lines if m["attempt"] > fault["signal_time"]]
    res = outcome(lines, fault, after, args.cap_s)
    res.update(error=error, times=_times(lines, fault["signal_time"]))
    return res


# ---- ours (benchmarks/recovery.py's trial) -----------------------------------------------------
def elastic_trial(args: argparse.Namespace, run_dir: str) -> dict:
    import recovery
    res = recovery.trial(args, run_dir)
    lines = pc.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    t0 = res.pop("signal_time")
    last_before = max((m["step"] for m in lines if m["time"] < t0), default=0)
    catch = next((m for m in lines if m["time"] > t0 and m["step"] > last_before), None)
    res.update(recovered=True, catchup_s=round(catch["time"] - t0, 3) if catch else None,
               last_step_before=last_before, times=_times(lines, t0))
    return res


def _times(lines: list[dict], t0: float) -> list[list[float]]:
    return [[round(m["time"] - t0, 3), m["step"]] for m in sorted(lines, key=lambda m: m["time"])]


def _summary(trials: list[dict]) -> dict:
    ok = [t for t in trials if t["recovered"]]
    rec = [t["recovery_s"] for t in ok]
    catch = [t["catchup_s"] for t in ok if t["catchup_s"] is not None]
    return {"trials": len(trials), "recovered": len(ok),
            "recovery_s_median": round(statistics.median(rec), 3) if rec else None,
            "recovery_s_max": max(rec) if rec else None,
            "catchup_s_median": round(statistics.median(catch), 3) if catch else None,
            "lost_steps_max": max((t["lost_steps"] for t in ok), default=None),
            "step_s_median": round(statistics.median(t["step_s"] for t in trials if t["step_s"]), 4),
            "per_trial": [{k: v for k, v in t.items() if k != "times"} for t in trials]}


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(1, 1, 1)
    for name, times in result.pop("_times").items():
        xs, ys = [], []
        for t, s in times:   # a gap (NaN) where a restart went back to an earlier step
            if ys and s <= ys[-1]:
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append(t)
            ys.append(s)
        ax.plot(xs, ys, ".-", ms=3, label=name)
    ax.axvline(0, color="red", ls="--", lw=1, label=f"{result['signal']} of rank {result['rank']}")
    if any(result[s]["recovered"] < result[s]["trials"] for s in ("elastic", "raytrain") if s in result):
        ax.axvline(result["cap_s"], color="grey", ls=":", lw=1, label=f"cap {result['cap_s']:.0f} s (no recovery)")
    ax.set_xlabel("seconds since the signal (first trial)")
    ax.set_ylabel("completed step")
    ax.set_title(f"{result['benchmark']}: recovery of 1 of {result['workers']} workers, {result['model_size']} GPT")
    ax.legend()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    p.add_argument("--rank", type=int, default=1, help="rank that receives the signal")
    p.add_argument("--model-size", default="small", choices=sorted(pc.gpt.MODEL_SIZES))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kill-step", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, help="ours: FailureConfig.heartbeat_timeout_s")
    p.add_argument("--raytrain-health-timeout", type=float, default=None,
                   help=f"Ray Train: {HEALTH_ENV} (default: Ray's own, 600 s)")
    p.add_argument("--max-failures", type=int, default=3, help="Ray Train FailureConfig.max_failures")
    p.add_argument("--cap-s", type=float, default=120.0, help="give up on a recovery after this many seconds")
    p.add_argument("--systems", default="elastic,raytrain")
    p.add_argument("--plot", help="write a PNG of steps over time around the fault")
    p.add_argument("--out", help="also write the JSON line to this file")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    systems = args.systems.split(",")

    import ray
    pc.ship_by_value(sys.modules[__name__])
    start = pc.machine()
    # address="local": a new instance even when another Ray runs on this (shared) machine.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.workers + 2), include_dashboard=False,
             logging_level="WARNING", log_to_driver=args.verbose)
    trials: dict[str, list[dict]] = {s: [] for s in systems}
    try:
        for i in range(args.trials):
            for system in systems:
                with tempfile.TemporaryDirectory(prefix=f"peer-{system}-") as d:
                    run = elastic_trial if system == "elastic" else raytrain_trial
                    trials[system].append(run(args, os.path.join(d, "run")))
                t = {k: v for k, v in trials[system][-1].items() if k != "times"}
                print(f"trial {i} {system}: {t}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    result = {"benchmark": "R1" if args.signal == "KILL" else "R2", "signal": f"SIG{args.signal}",
              "workers": args.workers, "rank": args.rank, "model_size": args.model_size, "batch_size": args.batch_size,
              "kill_step": args.kill_step, "checkpoint_every": args.checkpoint_every, "cap_s": args.cap_s,
              "elastic_heartbeat_timeout_s": args.heartbeat_timeout,
              "raytrain_health_check_timeout_s": args.raytrain_health_timeout or "default (600)",
              "raytrain_max_failures": args.max_failures, **start}
    for system in systems:
        result[system] = _summary(trials[system])
    if {"elastic", "raytrain"} <= set(systems):
        ours, peer = result["elastic"]["recovery_s_median"], result["raytrain"]["recovery_s_median"]
        result["raytrain_over_elastic_recovery"] = round(peer / ours, 2) if ours and peer else None
    result["_times"] = {s: trials[s][0]["times"] for s in systems if trials[s]}
    if not args.plot:
        result.pop("_times")
    pc.emit(result, args.plot, plot, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

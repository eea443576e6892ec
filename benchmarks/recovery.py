"""R1/R2/R3: recovery after SIGKILL (R1), SIGSTOP (R2) or a preemption notice (SIGTERM, R3)
of one of N workers.

Measures, per trial, the seconds from the signal to the next completed step (the first step past
the restored one, from metrics.jsonl), the steps lost and the seconds the recovery's time ledger
says it cost (`lost_s`: detection + redone + re-form + restore), then prints one JSON line.

    python benchmarks/recovery.py --workers 4 --trials 3 [--signal STOP --heartbeat-timeout 3]
    python benchmarks/recovery.py --workers 4 --trials 5 --signal TERM
    python benchmarks/recovery.py --strategy fsdp --model-size base --workers 3 --in-memory-every 1 \
        [--storage s3]     # FSDP from memory; --in-memory-every none: from the checkpoint
    python benchmarks/recovery.py --workers 3 --min-workers 3 --spare-workers 1 --trials 5
                           # a hot spare takes the lost rank's place (the mixed campaign's shape)
    python benchmarks/recovery.py --tp 2 --workers 6 --min-workers 4 --trials 5 [--whole-group]
                           # R1-TP: TP 2 x DP 3; --whole-group: every rank killed, the group
                           # restarted from the newest checkpoint (the peers' way)
    python benchmarks/recovery.py --kill-all --workers 2 --min-workers 2 --trials 3 [--strategy fsdp]
                           # R6: every rank killed at once, each trial twice: restored from the
                           # nodes' keepers (CheckpointConfig.node_copies) and from the checkpoint

`--storage s3` runs against moto's S3 server on loopback (started here), `file` (the default) on
a local temporary folder.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from itertools import pairwise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import gpt  # noqa: E402
from chaos.services import MOTO_CREDENTIALS, MotoServer, ensure_bucket  # noqa: E402
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig  # noqa: E402


def run_file(url: str, name: str) -> str | None:
    """A file of the run's storage (a local folder or an s3:// URL); None while it is missing."""
    from checkpointing import CheckpointError
    from checkpointing.storage import Storage
    storage = Storage(url)
    try:
        return storage.read_bytes(storage.path(name)).decode()
    except (CheckpointError, FileNotFoundError):
        return None


def read_status(url: str) -> dict:
    try:
        return json.loads(run_file(url, "status.json") or "{}")
    except json.JSONDecodeError:      # half-written: read again
        return {}


def inject(run_dir: str, at_step: int, sig: int, rank: int | None, out: dict) -> None:
    """From outside, like an operator: the pid from status.json, then os.kill (rank None: every
    rank, the whole group lost at once)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = read_status(run_dir)
        if status.get("state") == "running" and status.get("step", 0) >= at_step:
            pids = [w["pid"] for w in status["workers"] if rank is None or w["rank"] == rank]
            out["signal_time"] = time.time()
            for pid in pids:
                os.kill(pid, sig)
            pid = pids[0]
            out["pid"] = pid
            if sig == signal.SIGSTOP:
                out["stopped_pid"] = pid
            return
        time.sleep(0.01)


def trial(args: argparse.Namespace, run_dir: str, whole_group: bool = False, node_copies: bool = True) -> dict:
    sig = getattr(signal, f"SIG{args.signal}")
    fault: dict = {}
    rank = None if whole_group else args.rank
    injector = threading.Thread(target=inject, args=(run_dir, args.kill_step, sig, rank, fault), daemon=True)
    injector.start()
    loop_config: dict = {"model_size": args.model_size, "batch_size": args.batch_size}
    if args.pp > 1:
        loop_config |= {"pp_schedule": args.pp_schedule, "microbatches": args.microbatches or args.pp}
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config=loop_config,
        scaling=ScalingConfig(min_workers=args.min_workers or max(1, args.workers // 2), max_workers=args.workers,
                              spare_workers=args.spare_workers, strategy=args.strategy,
                              tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=args.checkpoint_every,
                                    in_memory_every_n_steps=args.in_memory_every, node_copies=node_copies),
        failure=FailureConfig(heartbeat_timeout_s=args.heartbeat_timeout),
        total_steps=args.steps, seed=0).fit()
    if "stopped_pid" in fault:
        try:
            os.kill(fault["stopped_pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    summary = result.summary
    failures = [r for r in summary["recoveries"] if r["cause"] != "scale_up"]
    if not result.ok or "signal_time" not in fault or not failures:
        raise SystemExit(f"trial did not produce a recovery: status={result.status} fault={fault} "
                         f"recoveries={summary['recoveries']} error={result.error!r}")
    recovery = failures[0]
    metrics = [json.loads(line) for line in (run_file(run_dir, "metrics.jsonl") or "").splitlines() if line.strip()]
    next_step = next((m for m in metrics if m["step"] == recovery["step"] + 1), None)
    if next_step is None:
        raise SystemExit(f"no completed step after the restored step {recovery['step']}: recoveries="
                         f"{summary['recoveries']} steps in metrics.jsonl={[m['step'] for m in metrics]} "
                         f"final_step={summary.get('final_step')} fault={fault}")
    before = [m for m in metrics if m["time"] < fault["signal_time"]]
    step_s = statistics.median(b["time"] - a["time"] for a, b in pairwise(before[-21:]))
    return {"recovery_s": round(next_step["time"] - fault["signal_time"], 3), "recover_s": recovery["recover_s"],
            "lost_steps": recovery["lost_steps"], "detect_s": recovery["detect_s"], "rung": recovery["rung"],
            "cause": recovery["cause"], "from_world": recovery["from_world"], "to_world": recovery["to_world"],
            "step_s": round(step_s, 4), "restored_step": recovery["step"], "signal_time": fault["signal_time"],
            "time_ledger": recovery.get("time_ledger"),
            "why": "; ".join(f.get("why") or str(f["cause"]) for f in recovery.get("failures", [])),
            "reason": recovery.get("reason"),      # why this rung (the re-form's restore plan)
            "lost_s": round(sum((recovery.get("time_ledger") or {}).values()), 3)}


@contextlib.contextmanager
def storage(kind: str):
    """None: a local folder per trial; else the s3:// URL of a bucket on moto's server, with this
    process's AWS variables (which the run hands its workers) pointing at it."""
    if kind == "file":
        yield None
        return
    with MotoServer(os.devnull) as moto:
        os.environ.update(AWS_ENDPOINT_URL=moto.endpoint, **MOTO_CREDENTIALS)
        ensure_bucket("s3://bench", moto.endpoint)
        yield "s3://bench"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--min-workers", type=int, default=None, help="default: half of --workers")
    p.add_argument("--spare-workers", type=int, default=0,
                   help="hot spares (the mixed chaos campaign runs 3:3 workers and 1 spare)")
    p.add_argument("--signal", choices=("KILL", "STOP", "TERM"), default="KILL")
    p.add_argument("--rank", type=int, default=1, help="rank that receives the signal")
    p.add_argument("--model-size", default="small", choices=sorted(gpt.MODEL_SIZES))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-step", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--heartbeat-timeout", type=float, default=10.0)
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--in-memory-every", type=lambda v: None if v == "none" else int(v), default=10,
                   help="FSDP: CheckpointConfig.in_memory_every_n_steps ('none': recover from the checkpoint)")
    p.add_argument("--storage", choices=("file", "s3"), default="file")
    p.add_argument("--tp", type=int, default=1, help="ScalingConfig.tensor_parallel_size (workers count ranks)")
    p.add_argument("--pp", type=int, default=1,
                   help="ScalingConfig.pipeline_parallel_size (workers count ranks, in multiples of --tp x --pp)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved1f1b"), default="1f1b",
                   help="with --pp: the example's pipeline schedule")
    p.add_argument("--microbatches", type=int, default=None, help="with --pp: micro-batches per batch (default P)")
    p.add_argument("--whole-group", action="store_true",
                   help="alternate each trial with one whose signal goes to every rank: the group restarts from "
                        "the newest checkpoint (the peers' way of recovering a TP replica group), in the same run")
    p.add_argument("--kill-all", action="store_true",
                   help="every trial's signal goes to every rank, each trial twice: restored from the nodes' keepers "
                        "(CheckpointConfig.node_copies) and without them (the checkpoint), in the same run")
    p.add_argument("--verbose", action="store_true", help="show the workers' and controller's logs")
    args = p.parse_args()
    if args.pp == 1 and (args.microbatches is not None or args.pp_schedule != "1f1b"):
        p.error("--microbatches and --pp-schedule shape a pipeline: add --pp P (P > 1)")

    import ray
    # address="local": a new instance even when another Ray runs on this (shared) machine.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.workers + args.spare_workers + 2),
             include_dashboard=False, logging_level="WARNING", log_to_driver=args.verbose)
    trials: list[dict] = []
    restarts: list[dict] = []       # --whole-group: the peers' way, alternating with ours
    try:
        with storage(args.storage) as base:
            for i in range(args.trials):
                # --whole-group: ours (one rank) then the peers' (every rank, from the checkpoint);
                # --kill-all: every rank, from the keepers then from the checkpoint.
                for other in (False, True) if args.whole_group or args.kill_all else (False,):
                    with tempfile.TemporaryDirectory(prefix="r1-") as run_dir:
                        url = os.path.join(run_dir, "run") if base is None else f"{base}/trial{i}{'g' * other}"
                        (restarts if other else trials).append(
                            trial(args, url, whole_group=other or args.kill_all, node_copies=not other))
                        print(f"trial {i}{' (whole group, no node copies)' * other}: "
                              f"{(restarts if other else trials)[-1]}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    recovery = [t["recovery_s"] for t in trials]
    peers_way = {}
    if restarts:
        again = [t["recovery_s"] for t in restarts]
        peers_way = {"whole_group_recovery_s_median": statistics.median(again),
                     "whole_group_lost_steps_max": max(t["lost_steps"] for t in restarts),
                     "whole_group_rungs": sorted({t["rung"] for t in restarts}),
                     "ratio_whole_group_to_ours": round(statistics.median(again) / statistics.median(recovery), 2),
                     "whole_group_per_trial": restarts}
    print(json.dumps({
        "benchmark": "R6" if args.kill_all else {"KILL": "R1", "STOP": "R2", "TERM": "R3"}[args.signal],
        "system": "elastic",
        "signal": f"SIG{args.signal}",
        "workers": args.workers, "spare_workers": args.spare_workers, "model_size": args.model_size,
        "tp": args.tp, **({"pp": args.pp, "pp_schedule": args.pp_schedule,
                           "microbatches": args.microbatches or args.pp} if args.pp > 1 else {}),
        "trials": len(trials),
        "strategy": args.strategy, "in_memory_every": args.in_memory_every, "storage": args.storage,
        "recover_s_median": statistics.median(t["recover_s"] for t in trials),
        "recovery_s_median": statistics.median(recovery), "recovery_s_max": max(recovery),
        "lost_s_median": statistics.median(t["lost_s"] for t in trials),
        "lost_steps_max": max(t["lost_steps"] for t in trials),
        "heartbeat_timeout_s": args.heartbeat_timeout, "step_s_median": statistics.median(t["step_s"] for t in trials),
        "rungs": sorted({t["rung"] for t in trials}), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "per_trial": trials, **peers_way}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""O1: steady-state throughput, ours against a plain DDP loop in Ray actors without the framework.

Same GPT, world size, per-worker batch, gloo, one torch thread per worker (ours: 1 CPU per worker,
which sets torch.set_num_threads(1); the plain loop calls it itself), same data and per-step
seeding. Ours checkpoints only at the end (outside the timed window). Steps/s are taken from the
completion time of each step on rank 0 after `--warmup` steps; the systems alternate (ABBA) over
`--reps` repetitions so drift on a shared machine hits both. CPU seconds per step (from /proc,
sampled every 0.2 s) are reported by process group: the training workers, our controller, and the
rest of the Ray instance; on a loaded machine they are the steadier comparison, as are the low
quantiles of the step time (`ratio_uncontended_p10/p25`: plain step / our step). One JSON line.
Ratios are paired per rep (each system against the bare loop of the same rep) and given with their
spread (`vs_plain_ddp`: median, min, max, quartiles).

With --gpu each rank runs on one GPU with NCCL (ours: ScalingConfig(use_gpu=True)). The plain loop
is then the best plain loop a user writes on a GPU: batches pinned and copied without blocking, and
no host-device synchronisation at the step (no `loss.item()`): it reads the step before's loss
behind a CUDA event, so its host runs at most one step ahead of the device, as ours does
(elastic._worker.step_boundary). Step times are then the host's times at the end of each step on
both sides, and the rate over many steps is the device's.

With --breakdown the bare loop also runs with each of the framework's former per-step costs added
alone (EXTRAS: DDP's find_unused_parameters, a Python comm hook stamping every bucket, a blocking
all-gather with its host copy per step): the difference to the bare loop is that part's cost
(`extra_step_ms_median`, `extra_worker_cpu_ms_per_rank_per_step_median`).

    python benchmarks/peer_ddp.py --workers 2 --steps 150 --reps 6 [--breakdown] [--plot o1.png] [--profile DIR]
    python benchmarks/peer_ddp.py --workers 4 --tp 2 [--strategy fsdp] --steps 150 --reps 6    # O1-TP

With --profile, py-spy samples rank 0 of each system for a few seconds of the steady state and
writes collapsed stacks (DIR/<system>-rep<i>.txt, `py-spy record --format raw`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peer_common as pc


class PlainWorker:
    """One rank of a hand-written DDP loop: what a user writes without a framework."""

    def __init__(self, threads: int):
        import torch
        torch.set_num_threads(threads)

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        import ray
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def run(self, rank: int, world: int, addr: str, port: int, cfg: dict) -> list[float]:
        """The loop; `cfg["extras"]` adds one of the framework's per-step costs at a time (see
        EXTRAS), so the difference to the bare loop is that part's cost."""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        extras = set(cfg.get("extras", ()))
        gpu = bool(cfg.get("gpu"))
        # Ray's num_gpus=1 leaves this actor its one GPU, as cuda:0.
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        tp = int(cfg.get("tp", 1))
        if tp > 1:
            model = _tensor_parallel(pc.build_model(cfg["model_size"]).to(device), device, world, tp,
                                     cfg.get("strategy", "ddp"))
        else:
            model = DistributedDataParallel(pc.build_model(cfg["model_size"]).to(device),
                                            device_ids=[device.index] if gpu else None,
                                            find_unused_parameters="find_unused" in extras)
        stamps: list[float] = []
        if "py_hook" in extras:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def timed(state, bucket):   # what the framework's timed_comm_hook did before this change
                stamps.append(time.perf_counter())
                return allreduce_hook(state, bucket)
            model.register_comm_hook(None, timed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
        batches = pc.Batches(cfg["model_size"], cfg["batch_size"])
        times = []
        before: torch.cuda.Event | None = None
        for step in range(cfg["steps"]):
            batch = batches.batch(step, rank // tp, world // tp)     # by data-parallel rank
            if gpu:
                batch = batch.pin_memory().to(device, non_blocking=True)
            loss = pc.train_step(model, optimizer, batch)
            if "blocking_gather" in extras:
                # What report() did before this change: one blocking all-gather of 37 float64 per
                # step (loss, flags, compute time, metric slots), read back on the host.
                mine = torch.zeros(37, dtype=torch.float64)
                mine[0] = loss.detach()
                gathered = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(gathered, mine)
                torch.stack(gathered).cpu().tolist()
            if gpu:
                # The step before's loss is what a loop logs, read once its event has passed: the
                # host never waits for the step it has just queued.
                done = torch.cuda.Event()
                done.record()
                if before is not None:
                    before.synchronize()
                before = done
            elif rank == 0:
                loss.item()   # what a loop logs
            if rank == 0:
                times.append(time.time())
            stamps.clear()
        if gpu:
            torch.cuda.synchronize()
        dist.destroy_process_group()
        return times


def _tensor_parallel(model, device, world: int, tp: int, strategy: str):
    """What a user writes for TP x DP without a framework (torchtitan's way): a 2-D mesh, the
    example GPT's Megatron plan on "tp", then FSDP2's replicate (ddp) or fully_shard (fsdp) on the
    data-parallel dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    dp_dim = "dp_replicate" if strategy == "ddp" else "dp_shard"
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=(dp_dim, "tp"))
    pc.gpt.parallelize_gpt(model, mesh["tp"])
    if strategy == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        replicate(model, mesh=mesh[dp_dim])
    else:
        from torch import nn
        from torch.distributed.fsdp import fully_shard
        for block in [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m]:
            fully_shard(block, mesh=mesh[dp_dim])
        fully_shard(model, mesh=mesh[dp_dim])
    return model


def _thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far) of every thread of `pid`."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            out[int(tid)] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _profile(pid_of, out_path: str, after_s: float, seconds: float) -> threading.Thread:
    """py-spy on rank 0 once the run is in its steady state (best effort: a note if it fails)."""
    def go():
        pid = pc.wait_for(pid_of, 120, poll_s=0.1)
        if not pid:
            return
        time.sleep(after_s)   # let the run pass its warm-up before sampling (not a synchronisation)
        py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        before, t1 = _thread_cpu(pid), time.time()
        with open(out_path + ".log", "w") as log:
            subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
                            "--format", "raw", "--threads", "--nonblocking", "-o", out_path],
                           stdout=log, stderr=subprocess.STDOUT, timeout=seconds + 60)
        after, t2 = _thread_cpu(pid), time.time()
        # CPU seconds of each thread over the sampled window (py-spy shows Python stacks; this
        # shows what every thread costs, gRPC and gloo included), named by py-spy where it saw the
        # thread run Python (threading names), else by the OS name; per step in `thread_costs`.
        py_names = {}
        try:
            with open(out_path) as f:
                for line in f:
                    head = line.split(";", 1)[0]
                    if head.startswith("thread (") and "): " in head:
                        tid, name = head[len("thread ("):].split("): ", 1)
                        py_names[int(tid, 0)] = name
        except (OSError, ValueError):
            pass
        rows = [{"tid": tid, "name": py_names.get(tid, name), "cpu_s": round(cpu - before.get(tid, (name, 0.0))[1], 3)}
                for tid, (name, cpu) in after.items()]
        with open(out_path + ".threads.json", "w") as f:
            json.dump({"window": [t1, t2], "threads": sorted([r for r in rows if r["cpu_s"] > 0],
                                                             key=lambda r: -r["cpu_s"])}, f, indent=1)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def thread_costs(path: str, times: list[float]) -> dict | None:
    """CPU seconds per step of rank 0's threads over the profiled window (steps completed in it)."""
    data = pc.read_json(path)
    if not data:
        return None
    t1, t2 = data["window"]
    steps = sum(1 for t in times if t1 <= t <= t2)
    if steps < 2:
        return None
    by_name: dict[str, float] = {}
    for row in data["threads"]:
        name = row["name"] if not row["name"].startswith("ray::") else "ray::<main or pool thread>"
        by_name[name] = by_name.get(name, 0.0) + row["cpu_s"] / steps
    return {"steps": steps, "cpu_s_per_step": {k: round(v, 4) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])
                                               if v >= 0.0001},
            "total": round(sum(by_name.values()), 4)}


# The framework's per-step costs before issue 18, one at a time on the bare loop (--breakdown):
# DDP's unused-parameter search, a Python comm hook per bucket that stamps compute time, and a
# blocking all-gather of the step's values with its host copy.
EXTRAS = {"plain+find_unused": ("find_unused",), "plain+py_hook": ("py_hook",),
          "plain+blocking_gather": ("blocking_gather",)}


def _system(title: str, args: argparse.Namespace) -> str:
    """The category of a process of the Ray instance that is neither a worker nor our controller:
    "ray_system", or with --cpu-by-process "ray_system/<what it is>" (raylet, gcs_server, an
    actor's class, ...): which of them a system's extra CPU is spent in."""
    if not args.cpu_by_process:
        return "ray_system"
    if title.startswith("ray::"):
        return "ray_system/" + title[len("ray::"):].split(".")[0].split()[0]
    return "ray_system/" + os.path.basename(title.split()[0]) if title.strip() else "ray_system/?"


def run_plain(args: argparse.Namespace, profile_to: str | None,
              extras: tuple[str, ...] = ()) -> tuple[list[float], pc.CpuSampler]:
    import ray
    cls = ray.remote(num_cpus=1, num_gpus=1 if args.gpu else 0)(PlainWorker)
    actors = [cls.remote(1) for _ in range(args.workers)]
    try:
        addr, port = ray.get(actors[0].address.remote())
        pids = ray.get([a.pid.remote() for a in actors])
        prof = _profile(lambda: pids[0], profile_to, args.profile_after_s, args.profile_s) if profile_to else None
        cfg = {"model_size": args.model_size, "batch_size": args.batch_size, "lr": 3e-3, "steps": args.steps,
               "extras": list(extras), "gpu": args.gpu, "tp": args.tp, "strategy": args.strategy}

        def categorise() -> dict[int, str]:
            return {pid: "workers" if pid in pids else _system(title, args)
                    for pid, title in pc.ray_processes().items()}
        with pc.CpuSampler(categorise) as cpu:
            times = ray.get([a.run.remote(r, args.workers, addr, port, cfg) for r, a in enumerate(actors)])[0]
        if prof:
            prof.join(timeout=args.profile_s + 60)
        return times, cpu
    finally:
        for a in actors:
            ray.kill(a)


def run_elastic(args: argparse.Namespace, profile_to: str | None,
                sdc_check: bool = True) -> tuple[list[float], pc.CpuSampler]:
    from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
    with tempfile.TemporaryDirectory(prefix="o1-") as d:
        run_dir = os.path.join(d, "run")

        def rank0_pid():
            status = pc.read_json(os.path.join(run_dir, "status.json")) or {}
            workers = status.get("workers", []) if status.get("state") == "running" else []
            return next((w["pid"] for w in workers if w["rank"] == 0), None)

        workers: set[int] = set()

        def categorise() -> dict[int, str]:
            status = pc.read_json(os.path.join(run_dir, "status.json")) or {}
            workers.update(w["pid"] for w in status.get("workers", []))
            return {pid: "workers" if pid in workers else "controller" if "ControllerActor" in title
                    else _system(title, args) for pid, title in pc.ray_processes().items()}

        prof = _profile(rank0_pid, profile_to, args.profile_after_s, args.profile_s) if profile_to else None
        with pc.CpuSampler(categorise) as cpu:
            result = ElasticTrainer(
                pc.gpt.train_loop, train_loop_config={"model_size": args.model_size, "batch_size": args.batch_size},
                scaling=ScalingConfig(min_workers=args.workers, max_workers=args.workers, use_gpu=args.gpu,
                                      tensor_parallel_size=args.tp, strategy=args.strategy),
                checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=None,
                                            in_memory_every_n_steps=args.in_memory_every),
                failure=FailureConfig(sdc_check=sdc_check),
                total_steps=args.steps, seed=0).fit()
        if prof:
            prof.join(timeout=args.profile_s + 60)
        if not result.ok:
            raise SystemExit(f"elastic run failed: {result.error!r}")
        recoveries = result.summary["recoveries"]
        if recoveries:
            raise SystemExit(f"elastic run had recoveries (not steady state): {recoveries}")
        lines = pc.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        return [m["time"] for m in sorted(lines, key=lambda m: m["step"])], cpu


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(1, 1, 1)
    for n, name in enumerate(result["systems"]):
        for i, times in enumerate(result.pop(f"_{name}_times")):
            gaps = [b - a for a, b in pairwise(times)]
            ax.plot(range(2, len(gaps) + 2), gaps, lw=0.8, color=f"C{n}",
                    label=f"{name} ({result[name]['steps_per_s_median']:.2f} steps/s median)" if i == 0 else None)
    ax.axvline(result["warmup"], color="grey", ls=":", lw=1, label="end of warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"O1: {result['model_size']} GPT, {result['workers']} workers, batch {result['batch_size']}/worker; "
                 f"ratio {result.get('ratio', float('nan')):.3f}")
    ax.legend()


def _spread(values: list[float]) -> dict:
    """Median, min, max and interquartile range of paired per-rep ratios."""
    v = sorted(values)
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    return {"median": round(statistics.median(v), 3), "min": round(v[0], 3), "max": round(v[-1], 3),
            "p25": round(q[0], 3), "p75": round(q[2], 3), "n": len(v)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model-size", default="small", choices=sorted(pc.gpt.MODEL_SIZES))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the rate")
    p.add_argument("--reps", type=int, default=6,
                   help="repetitions of each system, alternating (>= 6 to state a spread)")
    p.add_argument("--breakdown", action="store_true",
                   help="also run the bare loop with each of the framework's former per-step costs added "
                        f"({', '.join(EXTRAS)}): the per-step breakdown")
    p.add_argument("--systems", help="comma-separated subset of systems to run (default: elastic, plain_ddp "
                                     "and, with --breakdown, the plain+ variants; elastic_no_sdc: ours with "
                                     "FailureConfig.sdc_check off)")
    p.add_argument("--plot", help="write a PNG of step times")
    p.add_argument("--out", help="also write the JSON line to this file")
    p.add_argument("--profile", metavar="DIR", help="py-spy rank 0 of each system into DIR")
    p.add_argument("--gpu", action="store_true", help="one GPU per rank, NCCL (see the docstring)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: both systems run the example GPT's TP plan (O1-TP)")
    p.add_argument("--in-memory-every", type=lambda v: None if v == "none" else int(v), default=10,
                   help="fsdp: CheckpointConfig.in_memory_every_n_steps of ours ('none': no copies, as the "
                        "plain loop keeps none)")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                   help="with --tp: FSDP2 replicate (ddp) or fully_shard (fsdp, 2-D) over the data-parallel dimension")
    p.add_argument("--cpu-by-process", action="store_true",
                   help="split the Ray instance's own CPU per step by process (raylet, GCS, each actor class)")
    p.add_argument("--profile-after-s", type=float, default=8.0)
    p.add_argument("--profile-s", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.gpu and args.breakdown:
        p.error("--breakdown measures the CPU loop's former costs (gloo's blocking all-gather): run it without --gpu")

    import ray
    pc.ship_by_value(sys.modules[__name__])
    start = pc.machine()
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.workers + 2), include_dashboard=False,
             logging_level="WARNING", log_to_driver=False)
    systems = ["elastic", "plain_ddp", *(EXTRAS if args.breakdown else ())]
    if args.systems:
        systems = [s for s in args.systems.split(",") if s]
        if "plain_ddp" not in systems:
            raise SystemExit("--systems must include plain_ddp: every ratio is to it")
    runs: dict[str, list[list[float]]] = {name: [] for name in systems}
    cpu: dict[str, list[dict]] = {name: [] for name in systems}
    threads: dict[str, list[dict]] = {name: [] for name in systems}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    try:
        for rep in range(args.reps):
            # Alternate the order (ABBA...): drift on a shared machine then hits every system alike.
            order = systems if rep % 2 == 0 else list(reversed(systems))
            for name in order:
                prof = os.path.join(args.profile, f"{name}-rep{rep}.txt") if args.profile else None
                if name in ("elastic", "elastic_no_sdc"):
                    # elastic_no_sdc: FailureConfig.sdc_check off (no fingerprint, and no DDP
                    # copies in memory): the check's cost is elastic over it (SDC1).
                    times, sampler = run_elastic(args, prof, sdc_check=name == "elastic")
                else:
                    times, sampler = run_plain(args, prof, EXTRAS.get(name, ()))
                runs[name].append(times)
                cpu[name].append(sampler.per_step(times[args.warmup], times[-1], len(times) - 1 - args.warmup))
                if prof:
                    costs = thread_costs(prof + ".threads.json", times)
                    if costs:
                        threads[name].append(costs)
                print(f"rep {rep} {name}: {pc.steady_rate(times, args.warmup):.3f} steps/s, CPU s/step {cpu[name][-1]}",
                      file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    if args.gpu:
        import torch
        start["gpu"] = torch.cuda.get_device_name(0)
    result = {"benchmark": "O1-TP" if args.tp > 1 else "O1", "workers": args.workers, "tp": args.tp,
              "strategy": args.strategy, "in_memory_every": args.in_memory_every, "model_size": args.model_size,
              "batch_size": args.batch_size,
              "steps": args.steps, "warmup": args.warmup, "reps": args.reps,
              "backend": "nccl" if args.gpu else "gloo", "torch_threads": 1,
              "systems": systems, **start, "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}
    for name, reps in runs.items():
        rates = [pc.steady_rate(t, args.warmup) for t in reps]
        result[name] = {"steps_per_s_median": round(statistics.median(rates), 3),
                        "steps_per_s": [round(r, 3) for r in rates],
                        "step_s_median": pc.median_interval(reps[0][args.warmup:]),
                        "cpu_s_per_step_median": {k: round(statistics.median(c.get(k, 0.0) for c in cpu[name]), 4)
                                                  for k in sorted({k for c in cpu[name] for k in c})},
                        "cpu_s_per_step": cpu[name]}
    # Step times pooled over reps: on a shared machine they are bimodal (quiet / contended); the
    # low quantiles estimate the uncontended step, the one a dedicated machine would see.
    for name, reps in runs.items():
        gaps = sorted(b - a for t in reps for a, b in pairwise(t[args.warmup:]))
        result[name]["step_s_quantiles"] = {f"p{q}": round(gaps[int(q / 100 * (len(gaps) - 1))], 4)
                                            for q in (10, 25, 50)}
    plain = result["plain_ddp"]
    # Every system against the bare loop of the same rep (paired: both ran minutes apart at most).
    result["vs_plain_ddp"] = {}
    for name in systems:
        if name == "plain_ddp":
            continue
        mine = result[name]
        ratios = [a / b for a, b in zip(mine["steps_per_s"], plain["steps_per_s"], strict=True)]
        cpu_ratios = [a["workers"] / b["workers"] for a, b in zip(mine["cpu_s_per_step"], plain["cpu_s_per_step"],
                                                                 strict=True) if b.get("workers")]
        # The part's cost per step: its step time and its workers' CPU seconds over the bare loop's.
        extra_ms = [1000 * (1 / a - 1 / b) for a, b in zip(mine["steps_per_s"], plain["steps_per_s"], strict=True)]
        extra_cpu_ms = [1000 * (a["workers"] - b["workers"]) / args.workers
                        for a, b in zip(mine["cpu_s_per_step"], plain["cpu_s_per_step"], strict=True)]
        result["vs_plain_ddp"][name] = {
            "steps_per_s_ratio": _spread(ratios), "steps_per_s_ratio_per_rep": [round(r, 3) for r in ratios],
            "worker_cpu_per_step_ratio": _spread(cpu_ratios) if cpu_ratios else None,
            "worker_cpu_per_step_ratio_per_rep": [round(r, 3) for r in cpu_ratios],
            "extra_step_ms_median": round(statistics.median(extra_ms), 2),
            "extra_worker_cpu_ms_per_rank_per_step_median": round(statistics.median(extra_cpu_ms), 2),
            "ratio_uncontended_p10": round(plain["step_s_quantiles"]["p10"] / mine["step_s_quantiles"]["p10"], 3),
            "ratio_uncontended_p25": round(plain["step_s_quantiles"]["p25"] / mine["step_s_quantiles"]["p25"], 3)}
    if {"elastic", "elastic_no_sdc"} <= set(systems):
        on, off = result["elastic"]["steps_per_s"], result["elastic_no_sdc"]["steps_per_s"]
        result["sdc_check_on_over_off"] = _spread([a / b for a, b in zip(on, off, strict=True)])
        result["sdc_check_on_over_off_per_rep"] = [round(a / b, 3) for a, b in zip(on, off, strict=True)]
    if "elastic" in systems:
        ours = result["vs_plain_ddp"]["elastic"]
        # The keys of earlier versions of this benchmark.
        result["ratio"] = round(result["elastic"]["steps_per_s_median"] / plain["steps_per_s_median"], 3)
        result["ratio_paired_median"] = ours["steps_per_s_ratio"]["median"]
        result["ratio_uncontended_p10"] = ours["ratio_uncontended_p10"]
        result["ratio_uncontended_p25"] = ours["ratio_uncontended_p25"]
        result["ratio_per_rep"] = ours["steps_per_s_ratio_per_rep"]
        result["target"] = "steps/s >= 0.98x plain, worker CPU per step <= 1.03x plain (medians of paired reps)"
        # Cost per step in CPU seconds (all of a system's processes): steadier than steps/s under load.
        for key in ("workers", "total"):
            a, b = result["elastic"]["cpu_s_per_step_median"][key], plain["cpu_s_per_step_median"][key]
            result[f"cpu_{key}_ratio_elastic_over_plain"] = round(a / b, 3) if b else None
    if args.profile:
        result["profiles"] = args.profile
        result["rank0_thread_cpu_s_per_step"] = threads
    if args.plot:
        for name, reps in runs.items():
            result[f"_{name}_times"] = reps
    pc.emit(result, args.plot, plot, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

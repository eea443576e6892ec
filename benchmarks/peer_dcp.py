"""C1/C2 against DCP's own synchronous save (`torch.distributed.checkpoint.save`) to the same storage.

For local files (DCP `FileSystemWriter`, fsync on, as ours) and an S3 endpoint (DCP `FsspecWriter`
through s3fs; moto's server on loopback unless --use-env), single rank, a state of --mb MB:

- blocking time: DCP sync save, our sync save (DCP + manifest + checksums + commit), and our async
  save's stall (staging to host memory); ratios against DCP sync.
- DCP's own asynchronous save from a separate process (`dcp.async_save` with
  `AsyncCheckpointerType.PROCESS`, its default stager; issue 35): its stall (until `async_save`
  returns), and its first save's (which starts the process) apart.
- training slowdown: a training loop in the same process (the runs' GPT, --model-size, one
  thread) with one save of the state at its start; slowdown = loop wall time - the same loop
  without a save. The async saves keep uploading while the loop runs (if the upload outlasts the
  loop, the rest of the wait is counted). Ours twice: the files written by the save's background
  thread, and by a child process (`CheckpointManager(write_process=True)`). Ratios against
  DCP-sync and DCP-process. With the S3 endpoint on this machine (moto), the endpoint's own CPU competes with
  the loop: it is reported.

    python benchmarks/peer_dcp.py --mb 256 --reps 3 [--plot c1.png]

torch runs with one thread here (one core per worker, as in the runs), for both systems.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import _peer_common as pc
import checkpoint as ours_bench  # benchmarks/checkpoint.py: moto server, state, C1
from checkpointing import CheckpointManager
from checkpointing.storage import Storage


def dcp_writer(url: str, endpoint: str | None):
    if url.startswith("s3://"):
        # Durable on close; DCP's sync_files would os.sync() the whole machine for a remote store.
        # The credentials travel with the writer: DCP's checkpoint process started before the S3
        # endpoint's variables were set (it serves every store of the run).
        return FsspecWriter(url, sync_files=False, skip_instance_cache=True, endpoint_url=endpoint,
                            key=os.environ.get("AWS_ACCESS_KEY_ID"), secret=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    return FileSystemWriter(url)


def dcp_save(url: str, state: dict, endpoint: str | None) -> float:
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp_writer(url, endpoint), no_dist=True)
    return time.perf_counter() - t0


def dcp_process_save(url: str, state: dict, endpoint: str | None):
    """DCP's async save from its checkpoint process: (stall, the future of the upload)."""
    t0 = time.perf_counter()
    future = dcp.async_save(state, storage_writer=dcp_writer(url, endpoint),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    return time.perf_counter() - t0, future


def _drop(url: str) -> None:
    storage = Storage(url)
    if storage.exists(storage.root):
        storage.rm(storage.root)


class Loop:
    """The training stand-in: real steps of the runs' GPT (one rank, one thread, AdamW); the step
    times of each window are kept, so that a background upload's effect on steps shows."""

    def __init__(self, model_size: str, batch_size: int):
        self.model = pc.build_model(model_size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.batches = pc.Batches(model_size, batch_size)
        self.step = 0
        self.run(3)   # warm up allocator and autograd
        t0 = time.perf_counter()
        self.run(5)
        self.step_s = (time.perf_counter() - t0) / 5

    def run(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            pc.train_step(self.model, self.optimizer, self.batches.batch(self.step, 0, 1))
            self.step += 1
            times.append(time.perf_counter() - t0)
        return times


def _endpoint_cpu() -> float:
    """CPU seconds used so far by the S3 endpoint this benchmark started (moto, on this machine:
    its work competes with training here, unlike a remote store's)."""
    return sum(pc.cpu_seconds(pid) or 0.0 for pid, cmd in pc.descendants().items() if "moto.server" in cmd)


def slowdown(url: str, state: dict, loop: Loop, n: int, reps: int, endpoint: str | None) -> dict:
    """Per rep: the loop alone, then DCP sync save + loop, then DCP's process-based async save
    + loop, then our async save + loop."""
    arms = ("base", "dcp", "dcp_process", "ours", "ours_process")
    walls: dict[str, list[float]] = {k: [] for k in arms}
    steps: dict[str, list[float]] = {k: [] for k in arms}
    endpoint_cpu: dict[str, list[float]] = {k: [] for k in arms[1:]}
    waits, uploads = [], []
    mgr = CheckpointManager(url + "/slow_ours", async_save=True, keep=1)
    # Ours with the files written by a child process (CheckpointManager(write_process=True)).
    mgr_process = CheckpointManager(url + "/slow_ours_process", async_save=True, keep=1, write_process=True)
    for m in (mgr, mgr_process):
        m.save(0, state, generation=0)   # staging buffers (and the writer process) outside the timed region
        m.wait()
    for i in range(reps):
        ours_bench.touch(state)
        t0 = time.perf_counter()
        steps["base"] += loop.run(n)
        walls["base"].append(time.perf_counter() - t0)

        c0, t0 = _endpoint_cpu(), time.perf_counter()
        dcp_save(f"{url}/slow_dcp/{i}", state, endpoint)
        steps["dcp"] += loop.run(n)
        walls["dcp"].append(time.perf_counter() - t0)
        endpoint_cpu["dcp"].append(_endpoint_cpu() - c0)
        _drop(f"{url}/slow_dcp/{i}")

        c0, t0 = _endpoint_cpu(), time.perf_counter()
        _, future = dcp_process_save(f"{url}/slow_dcp_process/{i}", state, endpoint)
        steps["dcp_process"] += loop.run(n)
        future.result()   # an upload outlasting the loop is counted
        walls["dcp_process"].append(time.perf_counter() - t0)
        endpoint_cpu["dcp_process"].append(_endpoint_cpu() - c0)
        _drop(f"{url}/slow_dcp_process/{i}")

        c0, t0, wall0 = _endpoint_cpu(), time.perf_counter(), time.time()
        mgr.save(i + 1, state, generation=0)
        steps["ours"] += loop.run(n)
        t_loop = time.perf_counter()
        info = mgr.wait()   # an upload outlasting the loop is counted
        assert info is not None, mgr.last_error
        walls["ours"].append(time.perf_counter() - t0)
        uploads.append(info.committed_at - wall0)   # save() to COMMITTED, while the loop ran
        endpoint_cpu["ours"].append(_endpoint_cpu() - c0)
        waits.append(round(time.perf_counter() - t_loop, 3))

        c0, t0 = _endpoint_cpu(), time.perf_counter()
        mgr_process.save(i + 1, state, generation=0)
        steps["ours_process"] += loop.run(n)
        assert mgr_process.wait() is not None, mgr_process.last_error
        walls["ours_process"].append(time.perf_counter() - t0)
        endpoint_cpu["ours_process"].append(_endpoint_cpu() - c0)
    mgr.close()
    mgr_process.close()
    base = statistics.median(walls["base"])
    d, o = statistics.median(walls["dcp"]) - base, statistics.median(walls["ours"]) - base
    p = statistics.median(walls["dcp_process"]) - base
    op = statistics.median(walls["ours_process"]) - base
    out = {"loop_steps": n, "loop_s": round(base, 3), "step_s_median": round(statistics.median(steps["base"]), 4),
           "dcp_sync_slowdown_s": round(d, 3), "dcp_process_slowdown_s": round(p, 3),
           "ours_async_slowdown_s": round(o, 3), "ours_write_process_slowdown_s": round(op, 3),
           "ratio_ours_write_process_vs_dcp_process": round(op / p, 3) if p > 0 else None,
           "ratio_ours_async_vs_dcp_sync": round(o / d, 3) if d > 0 else None,
           "ratio_ours_async_vs_dcp_process": round(o / p, 3) if p > 0 else None,
           "upload_wait_after_loop_s": waits,
           # How long our async save took from save() to COMMITTED while the loop ran beside it.
           "ours_async_commit_s_median": round(statistics.median(uploads), 3),
           # Step times while our upload runs in the background (the first steps of each window).
           "step_s_max": {k: round(max(v), 3) for k, v in steps.items()},
           "step_s_p90": {k: round(sorted(v)[int(0.9 * (len(v) - 1))], 3) for k, v in steps.items()}}
    if endpoint is not None:
        out["endpoint_cpu_s_median"] = {k: round(statistics.median(v), 2) for k, v in endpoint_cpu.items()}
    return out


def measure(url: str, state: dict, args: argparse.Namespace, endpoint: str | None) -> dict:
    dcp_s = []
    for i in range(args.reps):
        ours_bench.touch(state)
        dcp_s.append(dcp_save(f"{url}/dcp/{i}", state, endpoint))
        _drop(f"{url}/dcp/{i}")
    # DCP's checkpoint process starts at its first save: that stall is reported apart.
    first_process_s, future = dcp_process_save(f"{url}/dcp_process/first", state, endpoint)
    future.result()
    _drop(f"{url}/dcp_process/first")
    process_s = []
    for i in range(args.reps):
        ours_bench.touch(state)
        stall, future = dcp_process_save(f"{url}/dcp_process/{i}", state, endpoint)
        future.result()
        process_s.append(stall)
        _drop(f"{url}/dcp_process/{i}")
    ours = ours_bench.c1_stall(url, state, args.reps)
    ours_process = ours_bench.c1_stall(url + "/write_process", state, args.reps, write_process=True)
    d, p = statistics.median(dcp_s), statistics.median(process_s)
    out = {"dcp_sync_save_s": round(d, 4), "dcp_sync_per_rep": [round(x, 3) for x in dcp_s],
           "ours_sync_save_s": ours["sync_save_s"], "ours_async_stall_s": ours["async_stall_s"],
           "ours_async_first_stall_s": ours["async_first_stall_s"],
           "C1_stall_vs_dcp_sync": round(ours["async_stall_s"] / d, 4),
           "dcp_process_stall_s": round(p, 4), "dcp_process_per_rep": [round(x, 3) for x in process_s],
           "dcp_process_first_stall_s": round(first_process_s, 3),
           "ours_async_stall_vs_dcp_process_stall": round(ours["async_stall_s"] / p, 3),
           "ours_write_process_stall_s": ours_process["async_stall_s"],
           "ours_write_process_stall_vs_dcp_process_stall": round(ours_process["async_stall_s"] / p, 3),
           "ours_sync_vs_dcp_sync": round(ours["sync_save_s"] / d, 3),
           "dcp_sync_MBps": round(args.mb * (1 << 20) / d / 1e6, 1)}
    loop = Loop(args.model_size, args.batch_size)
    n = max(10, math.ceil(args.window * d / loop.step_s))
    out["training_slowdown"] = slowdown(url, state, loop, n, args.reps, endpoint)
    return out


def plot(fig, result: dict) -> None:
    import numpy as np
    ax = fig.add_subplot(1, 1, 1)
    stores = [s for s in ("local", "s3") if s in result]
    labels = ["DCP sync save", "ours sync save", "DCP process stall", "ours async stall", "slowdown DCP sync",
              "slowdown DCP process", "slowdown ours async"]
    for j, s in enumerate(stores):
        r = result[s]
        slow = r["training_slowdown"]
        vals = [r["dcp_sync_save_s"], r["ours_sync_save_s"], r["dcp_process_stall_s"], r["ours_async_stall_s"],
                slow["dcp_sync_slowdown_s"], slow["dcp_process_slowdown_s"], slow["ours_async_slowdown_s"]]
        x = np.arange(len(labels)) + j * 0.4
        bars = ax.bar(x, vals, width=0.38, label=s)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_xticks(np.arange(len(labels)) + 0.2 * (len(stores) - 1), labels, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(f"C1 vs DCP: {result['state_mb']} MB state, single rank (lower is better)")
    ax.legend()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model-size", default="small", choices=sorted(pc.gpt.MODEL_SIZES),
                    help="GPT of the stand-in training loop")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--window", type=float, default=3.0, help="loop length, in DCP sync saves")
    ap.add_argument("--stores", default="local,s3")
    ap.add_argument("--use-env", action="store_true", help="use the S3 endpoint in AWS_* variables")
    ap.add_argument("--plot")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # DCP's process-based save needs a process group (with a CPU backend): one rank of gloo.
    store = dist.FileStore(tempfile.mktemp(prefix="c1dcp-store-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    state = ours_bench.make_state(args.mb)
    out = {"benchmark": "C1-vs-DCP", "state_mb": args.mb, "reps": args.reps, "loop_model": args.model_size,
           "torch_threads": 1, **pc.machine()}
    stores = args.stores.split(",")
    if "local" in stores:
        tmp = tempfile.mkdtemp(prefix="c1dcp-")
        try:
            out["local"] = measure(os.path.join(tmp, "run"), state, args, None)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if "s3" in stores:
        with ours_bench.s3_endpoint(args.use_env) as endpoint:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            Storage(f"s3://{bucket}").fs.mkdir(bucket)
            out["s3"] = measure(f"s3://{bucket}/run", state, args, endpoint)
            out["endpoint"] = "moto_server (loopback)" if not args.use_env else endpoint
    pc.emit(out, args.plot, plot, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

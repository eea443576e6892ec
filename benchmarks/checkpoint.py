"""Checkpoint benchmarks C1 and C2; prints one JSON line.

C1: training stall of an async save (the time save() blocks the training thread: staging to
    host memory) as a share of a synchronous save of the same state (target <= 10 %).
C2: upload throughput of a checkpoint save to an S3 endpoint against a raw s3fs put of the
    same bytes (target >= 0.8x).

Both on a state of --mb MB (default 256; at least 200 for the reported numbers), single rank,
against moto's S3 server started on loopback for the run (or the endpoint in AWS_ENDPOINT_URL
with --use-env). Usage: .venv/bin/python benchmarks/checkpoint.py [--mb 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from chaos.services import MOTO_CREDENTIALS, MotoServer
from checkpointing import CheckpointManager
from checkpointing.storage import Storage


@contextlib.contextmanager
def s3_endpoint(use_env: bool):
    """The S3 endpoint to measure against: the one in AWS_ENDPOINT_URL (--use-env), or moto's
    server on loopback for the run, with the AWS variables of this process pointing at it."""
    if use_env:
        yield os.environ.get("AWS_ENDPOINT_URL")
        return
    with MotoServer(os.devnull) as moto:
        os.environ.update(AWS_ENDPOINT_URL=moto.endpoint, **MOTO_CREDENTIALS)
        yield moto.endpoint


def make_state(mb: int) -> dict:
    n_tensors = 8
    per = mb * (1 << 20) // 4 // n_tensors
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n_tensors)},
            "extra": {"step": 0, "samples_seen": 0}}


def touch(state: dict) -> None:
    """A stand-in for a training step: change every tensor in place."""
    for t in state["model"].values():
        t.add_(1e-3)


def c1_stall(url: str, state: dict, reps: int, *, write_process: bool = False) -> dict:
    sync = CheckpointManager(url + "/sync", async_save=False, keep=1)
    sync_s = []
    for i in range(reps):
        touch(state)
        t0 = time.perf_counter()
        sync.save(i, state, generation=0)
        sync_s.append(time.perf_counter() - t0)
        assert sync.wait() is not None, sync.last_error
    sync.close()

    amgr = CheckpointManager(url + "/async", async_save=True, keep=1, write_process=write_process)
    stalls, first = [], None
    for i in range(reps + 1):
        touch(state)
        t0 = time.perf_counter()
        amgr.save(i, state, generation=0)
        stall = time.perf_counter() - t0
        # Training would run here; wait outside the timed region so the next save's stall
        # is the staging copy only (a real run checkpoints far less often than uploads take).
        assert amgr.wait() is not None, amgr.last_error
        if i == 0:
            first = stall  # allocates the staging buffers once per run
        else:
            stalls.append(stall)
    amgr.close()
    sync_med, stall_med = statistics.median(sync_s), statistics.median(stalls)
    return {"sync_save_s": round(sync_med, 4), "async_stall_s": round(stall_med, 4),
            "async_first_stall_s": round(first, 4), "stall_share": round(stall_med / sync_med, 4)}


def c2_throughput(url: str, state: dict, reps: int) -> dict:
    mgr = CheckpointManager(url + "/c2", async_save=False, keep=1)
    ours, nbytes = [], 0
    for i in range(reps):
        t0 = time.perf_counter()
        mgr.save(i, state, generation=0)
        ours.append(time.perf_counter() - t0)
        info = mgr.wait()
        assert info is not None, mgr.last_error
        nbytes = info.total_bytes
    mgr.close()
    storage = Storage(url + "/raw")
    sizes = sorted((f["size"] for f in info.files.values()), reverse=True)
    blobs = [os.urandom(min(s, 1 << 20)) * (s // (1 << 20)) + os.urandom(s % (1 << 20)) for s in sizes]
    raw = []
    for i in range(reps):
        t0 = time.perf_counter()
        for j, blob in enumerate(blobs):
            storage.fs.pipe_file(storage.path(f"r{i}", f"f{j}"), blob)
        raw.append(time.perf_counter() - t0)
        storage.rm(storage.path(f"r{i}"))
    ours_bps, raw_bps = nbytes / statistics.median(ours), nbytes / statistics.median(raw)
    return {"bytes": nbytes, "ours_MBps": round(ours_bps / 1e6, 1), "raw_s3fs_MBps": round(raw_bps / 1e6, 1),
            "ratio": round(ours_bps / raw_bps, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--use-env", action="store_true", help="use the S3 endpoint in AWS_* variables")
    args = ap.parse_args()
    state = make_state(args.mb)
    out = {"bench": "checkpoint", "state_mb": args.mb, "reps": args.reps}
    with tempfile.TemporaryDirectory() as tmp:
        out["C1_local"] = c1_stall(os.path.join(tmp, "run"), state, args.reps)
    with s3_endpoint(args.use_env) as endpoint:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        storage = Storage(f"s3://{bucket}")
        storage.fs.mkdir(bucket)
        url = f"s3://{bucket}/run"
        out["C1_s3"] = c1_stall(url, state, args.reps)
        out["C2_s3"] = c2_throughput(url, state, args.reps)
        out["endpoint"] = "moto_server (loopback)" if not args.use_env else endpoint
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""A gloo group of local processes, no Ray: the harness of the pipeline benchmarks.

`run_group("module:function", world, kwargs, collective_timeout_s=...)` starts one process per
rank (`python _rank_group.py module:function rank world port timeout kwargs out_dir`); the
parent hosts the group's TCPStore, so no port is picked in advance. Each rank joins the default
group with `timeout=collective_timeout_s` (as a worker does with FailureConfig's), runs
`function(rank=, world=, progress=, **kwargs)` with one torch thread (as a worker with 1 CPU),
and writes its JSON-able return value, or the error it raised with its traceback. `progress(n)`
records how far the rank got: when no rank moves for `stall_s`, the parent kills them all and
says so (a hang that the collective timeout did not end). The same harness shape as
tests/integration/ckpt/ckpt_ranks.py, with the group's timeout, the progress watch and a
failure returned as data (a benchmark reports it) instead of raised.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass
class GroupResult:
    results: list          # each rank's return value, or None where it has none
    errors: dict = field(default_factory=dict)     # rank -> {"error", "traceback", "progress"}
    exit_codes: list = field(default_factory=list)
    stalled: bool = False          # killed by the progress watch
    progress: list = field(default_factory=list)   # each rank's last progress count
    logs: list = field(default_factory=list)        # each rank's output, last 3,000 characters
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors and not self.stalled and all(c == 0 for c in self.exit_codes)


def _progress_of(out_dir: str, rank: int) -> int:
    """-1 before the rank has joined the group (its imports can take minutes on a loaded machine)."""
    try:
        return int(Path(out_dir, f"progress{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return -1


def run_group(program: str, world: int, kwargs: dict, *, collective_timeout_s: float = 20.0,
              stall_s: float = 120.0, start_s: float = 900.0, deadline_s: float = 3600.0) -> GroupResult:
    """Run `program` on `world` ranks; returns every rank's result or failure, never raises for a
    rank's failure, and always kills what is left. The watch: every rank joined within `start_s`,
    then no `stall_s` without a rank moving, all done within `deadline_s`."""
    import tempfile

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), str(ROOT / "examples"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="rank-group-") as out_dir:
        procs: list[subprocess.Popen] = []
        started = time.monotonic()
        stalled = False
        try:
            for rank in range(world):
                cmd = [sys.executable, str(HERE / "_rank_group.py"), program, str(rank), str(world), str(store.port),
                       str(collective_timeout_s), json.dumps(kwargs), out_dir]
                with open(Path(out_dir, f"rank{rank}.log"), "wb") as log:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            last, moved = [-1] * world, time.monotonic()
            while any(p.poll() is None for p in procs):
                now = [_progress_of(out_dir, r) for r in range(world)]
                if now != last:
                    last, moved = now, time.monotonic()
                elif time.monotonic() - moved > (start_s if min(now) < 0 else stall_s):
                    stalled = True
                    break
                if time.monotonic() - started > deadline_s:
                    stalled = True
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        out = GroupResult(results=[None] * world, exit_codes=[p.returncode for p in procs], stalled=stalled,
                          wall_s=round(time.monotonic() - started, 2))
        for rank in range(world):
            out.progress.append(_progress_of(out_dir, rank))
            out.logs.append(Path(out_dir, f"rank{rank}.log").read_text(errors="replace")[-3000:])
            path = Path(out_dir, f"rank{rank}.json")
            if not path.exists():
                if procs[rank].returncode != 0:
                    out.errors[rank] = {"error": f"no result (exit {procs[rank].returncode})",
                                        "progress": out.progress[-1]}
                continue
            data = json.loads(path.read_text())
            if "error" in data:
                out.errors[rank] = {k: v for k, v in data.items() if k != "result"}
            out.results[rank] = data.get("result")
    del store
    return out


def _main() -> None:
    program, rank_s, world_s, port, timeout_s, kwargs, out_dir = sys.argv[1:8]
    rank, world = int(rank_s), int(world_s)
    import importlib

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)

    def progress(n: int) -> None:
        tmp = Path(out_dir, f"progress{rank}.tmp")
        tmp.write_text(str(n))
        os.replace(tmp, Path(out_dir, f"progress{rank}"))

    module, _, name = program.rpartition(":")
    store = dist.TCPStore("127.0.0.1", int(port), world + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(timeout_s)))
    progress(0)          # joined: the progress watch starts now
    try:
        result = getattr(importlib.import_module(module), name)(rank=rank, world=world, progress=progress,
                                                                **json.loads(kwargs))
    except Exception as error:  # noqa: BLE001 - the benchmark reports every failure as data
        _write(out_dir, rank, _error(error, out_dir, rank))
        os._exit(1)          # a broken group's teardown can hang: leave without it
    _write(out_dir, rank, {"result": result})     # before the barrier: a rank that hangs there keeps its result
    try:
        dist.barrier()
    except Exception as error:  # noqa: BLE001
        _write(out_dir, rank, {"result": result, **_error(error, out_dir, rank)})
        os._exit(1)
    dist.destroy_process_group()


def _error(error: Exception, out_dir: str, rank: int) -> dict:
    path = Path(out_dir, f"progress{rank}")
    return {"error": f"{type(error).__name__}: {error}"[:2000], "traceback": traceback.format_exc()[-6000:],
            "progress": int(path.read_text() or 0) if path.exists() else -1}


def _write(out_dir: str, rank: int, data: dict) -> None:
    tmp = Path(out_dir, f"rank{rank}.json.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, Path(out_dir, f"rank{rank}.json"))

if __name__ == "__main__":
    _main()

"""Run a rank program on N local processes with a gloo group on 127.0.0.1 (no Ray).

`run_ranks("program", world, **kwargs)` starts `python ckpt_ranks.py program rank world port json`
per rank, waits with a deadline, and always kills what is left. Each program is a function in
`ckpt_rank_programs.py` (or "module:function" for a module of tests/unit); its return value
(JSON-able) comes back per rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from chaos.services import free_port, wait_until

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SUITE = HERE.parents[1] / "unit" / "ckpt"  # ckpt_conformance.py (shared helpers)
UNIT = HERE.parents[1] / "unit"            # programs of other suites: "module:function"


def spawn_ranks(program: str, world: int, kwargs: dict, out_dir: str, env: dict | None = None):
    port = free_port()
    procs = []
    for rank in range(world):
        cmd = [sys.executable, str(HERE / "ckpt_ranks.py"), program, str(rank), str(world), str(port),
               json.dumps(kwargs), out_dir]
        penv = dict(os.environ, **(env or {}))
        penv["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), str(SUITE), str(UNIT), penv.get("PYTHONPATH", "")])
        with open(Path(out_dir, f"rank{rank}.log"), "wb") as log:
            procs.append(subprocess.Popen(cmd, env=penv, stdout=log, stderr=subprocess.STDOUT))
    return procs


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_ranks(program: str, world: int, timeout: float = 90, env: dict | None = None, **kwargs) -> list:
    """Results of `program` per rank; raises with every rank's output if any rank fails."""
    with tempfile.TemporaryDirectory() as out_dir:
        procs = spawn_ranks(program, world, kwargs, out_dir, env)
        try:
            with contextlib.suppress(TimeoutError):   # a rank still running then is reported below
                wait_until(lambda: all(p.poll() is not None for p in procs) or any(p.poll() for p in procs),
                           timeout, f"{program}'s ranks to end", interval_s=0.05)
        finally:
            running = [p for p in procs if p.poll() is None]
            kill_all(procs)
        outputs = [Path(out_dir, f"rank{r}.log").read_text(errors="replace") for r in range(world)]
        codes = [p.returncode for p in procs]
        if running or any(c != 0 for c in codes):
            detail = "\n".join(f"--- rank {r} (exit {codes[r]})\n{outputs[r][-4000:]}" for r in range(world))
            raise AssertionError(f"{program} at world {world} failed or timed out ({timeout}s):\n{detail}")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def _main() -> None:
    program, rank, world, port, kwargs, out_dir = sys.argv[1:7]
    rank, world = int(rank), int(world)
    import importlib

    import torch.distributed as dist

    module, _, name = program.rpartition(":")
    programs = importlib.import_module(module or "ckpt_rank_programs")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = getattr(programs, name)(rank=rank, world=world, **json.loads(kwargs))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _main()

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

from chaos.services import wait_until

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SUITE = HERE.parents[1] / "unit" / "ckpt"  # ckpt_conformance.py (shared helpers)
UNIT = HERE.parents[1] / "unit" / "worker"  # programs of other suites: "module:function"


PORT_FILE = "store_port"


def spawn_ranks(program: str, world: int, kwargs: dict, out_dir: str, env: dict | None = None,
                timeout: float = 60, procs: list | None = None) -> list:
    """Rank 0 first: its store binds a port the OS picks (a port picked free beforehand can be
    taken by another test before the store binds it) and names it in PORT_FILE; then the rest.
    Each process is appended to `procs` as it starts (the caller kills them, whatever happens)."""
    procs = [] if procs is None else procs
    penv = dict(os.environ, **(env or {}))
    penv["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), str(SUITE), str(UNIT), penv.get("PYTHONPATH", "")])

    def start(rank: int, port: int) -> subprocess.Popen:
        cmd = [sys.executable, str(HERE / "ckpt_ranks.py"), program, str(rank), str(world), str(port),
               json.dumps(kwargs), out_dir]
        with open(Path(out_dir, f"rank{rank}.log"), "wb") as log:
            return subprocess.Popen(cmd, env=penv, stdout=log, stderr=subprocess.STDOUT)

    procs.append(start(0, 0))
    port_file = Path(out_dir, PORT_FILE)
    with contextlib.suppress(TimeoutError):       # rank 0 failed or hung: reported by run_ranks
        wait_until(lambda: port_file.exists() or procs[0].poll() is not None, timeout,
                   "rank 0's store port", interval_s=0.02)
    if not port_file.exists():
        return procs
    port = int(port_file.read_text())
    procs.extend(start(rank, port) for rank in range(1, world))
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
        procs: list[subprocess.Popen] = []
        try:
            spawn_ranks(program, world, kwargs, out_dir, env, procs=procs)
            with contextlib.suppress(TimeoutError):   # a rank still running then is reported below
                wait_until(lambda: all(p.poll() is not None for p in procs) or any(p.poll() for p in procs),
                           timeout, f"{program}'s ranks to end", interval_s=0.05)
        finally:
            running = [p for p in procs if p.poll() is None]
            kill_all(procs)
        # Fewer than `world` when rank 0 never named its port (the others were not started).
        outputs = [Path(out_dir, f"rank{r}.log").read_text(errors="replace") for r in range(len(procs))]
        codes = [p.returncode for p in procs]
        if len(procs) < world or running or any(c != 0 for c in codes):
            detail = "\n".join(f"--- rank {r} (exit {codes[r]})\n{outputs[r][-4000:]}" for r in range(len(procs)))
            raise AssertionError(f"{program} at world {world} failed or timed out ({timeout}s):\n{detail}")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def _main() -> None:
    program, rank, world, port, kwargs, out_dir = sys.argv[1:7]
    rank, world = int(rank), int(world)
    import importlib

    import torch.distributed as dist

    module, _, name = program.rpartition(":")
    programs = importlib.import_module(module or "ckpt_rank_programs")
    store = dist.TCPStore("127.0.0.1", int(port), world, is_master=rank == 0, wait_for_workers=False)
    if rank == 0:                               # bound: name the port (written whole, then renamed)
        Path(out_dir, PORT_FILE + ".tmp").write_text(str(store.port))
        os.replace(Path(out_dir, PORT_FILE + ".tmp"), Path(out_dir, PORT_FILE))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = getattr(programs, name)(rank=rank, world=world, **json.loads(kwargs))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _main()

"""A save's files written by a child process (CheckpointManager(write_process=True),
checkpointing._write_process): the same files as the background thread writes, committed and
loaded alike; a cancelled save stops the child and commits nothing; the child ends with its
parent, even a SIGKILLed one."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from chaos.services import wait_until
from checkpointing import CheckpointManager
from checkpointing import manifest as mf

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g),
                      "steps": torch.tensor(seed)},
            "extra": {"epoch": seed, "note": f"state {seed}"}}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent has not reaped it yet).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float, what: str) -> None:
    wait_until(lambda: not _alive(pid), timeout_s, what)


def test_the_childs_files_are_the_threads_own_and_commit_and_load_alike(tmp_path):
    thread = CheckpointManager(str(tmp_path / "thread"), async_save=True)
    child = CheckpointManager(str(tmp_path / "child"), async_save=True, write_process=True)
    for step in (1, 2):          # the second save sends the staged buffers' handles only
        for mgr in (thread, child):
            mgr.save(step, _state(step), generation=0)
        infos = [mgr.wait() for mgr in (thread, child)]
        assert all(info is not None and info.step == step for info in infos), (thread.last_error, child.last_error)
        # Byte for byte the data files DCP's own writer makes: the same names, sizes and SHA-256s
        # (.metadata names its own directory, which differs).
        data = [{k: v for k, v in info.files.items() if k.endswith(".distcp")} for info in infos]
        assert data[0] and data[0] == data[1]
        assert infos[0].files.keys() == infos[1].files.keys()
    pid = child._writer.pid
    assert pid is not None and pid != os.getpid()
    loaded = _state(0)
    result = child.load_latest(loaded)
    assert result is not None and result.step == 2
    expected = _state(2)
    for key in ("w", "b", "steps"):
        assert torch.equal(loaded["model"][key], expected["model"][key])
    assert loaded["extra"] == expected["extra"]
    # The records the child took while writing are what storage holds.
    assert mf.verify_files(child.storage, 2, infos[1].files) == []
    thread.close()
    child.close()
    _wait_gone(pid, 5, "close() to end the writer process")


def test_a_cancelled_save_stops_the_child_commits_nothing_and_the_next_save_starts_another(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), async_save=True, write_process=True)
    mgr.save(1, _state(1), generation=0)
    wait_until(lambda: mgr._writer.pid is not None, 30, "the save to start its writer process", interval_s=0.01)
    first = mgr._writer.pid
    assert first is not None
    mgr.abandon()           # the save's thread sees the cancel within its poll and kills the child
    _wait_gone(first, 10, "the cancelled save's writer process to end")
    assert mf.read_manifest(mgr.storage, 1) is None
    mgr.save(2, _state(2), generation=0)
    info = mgr.wait()
    assert info is not None and info.step == 2, mgr.last_error
    assert mgr._writer.pid not in (None, first)
    mgr.close()


def test_the_child_ends_within_seconds_of_a_sigkilled_parent(tmp_path):
    parent = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path[:0] = {sys.path!r}
        from checkpointing import CheckpointManager
        mgr = CheckpointManager({str(tmp_path / "run")!r}, async_save=True, write_process=True)
        mgr.save(1, {{"w": torch.ones(8)}}, generation=0)
        assert mgr.wait() is not None, mgr.last_error
        print(mgr._writer.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=90)
    assert done.returncode == -9, done.stderr[-2000:]
    pid = int(done.stdout.split()[-1])
    _wait_gone(pid, 5, f"writer process {pid} to end after its parent's SIGKILL")

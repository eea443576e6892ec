"""A step's exchange let go while still pending (elastic/_worker/step_exchange.py's graveyard),
three ranks in three processes over gloo, no Ray: ranks 0 and 1 post their exchange, rank 2 is
alive and has not posted its own (its step failed first). Ranks 0 and 1 let the exchange go and
tear the group down: that must not wait for rank 2 (before the graveyard, dropping the group's
last reference waited in ~ProcessGroupGloo for the whole collective timeout). The group is kept
until the work completes, and dropped then."""
from __future__ import annotations

import datetime
import gc
import multiprocessing
import subprocess
import sys
import time

import pytest

from support import run_processes, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

COLLECTIVE_TIMEOUT_S = 60.0


def _rank_main(rank: int, ports, go, out) -> None:
    import torch
    import torch.distributed as dist

    from elastic._worker import step_exchange
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
        for _ in range(2):
            ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=60), 3, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    dist.barrier()
    if rank == 2:
        for _ in range(2):              # both others have let their exchange go
            go.get(timeout=60)
        pending = step_exchange.post([2.0], {}, device=torch.device("cpu"), world_size=3)
        out.put((rank, pending.collect()[:, 0].tolist()))
        dist.destroy_process_group()
        return
    pending = step_exchange.post([float(rank)], {}, device=torch.device("cpu"), world_size=3)
    assert not pending.completed()      # rank 2 posts only after both "go"s below
    started = time.monotonic()
    del pending
    dist.destroy_process_group()
    gc.collect()                        # the group's last reference here, but for the graveyard's
    teardown_s = time.monotonic() - started
    kept = step_exchange._GRAVEYARD.pending()
    go.put(rank)
    wait_for(lambda: not step_exchange._GRAVEYARD.pending(), 30.0, "the kept group dropped after rank 2's post")
    out.put((rank, {"teardown_s": teardown_s, "kept": kept, "left": step_exchange._GRAVEYARD.pending()}))


def test_a_pending_exchange_let_go_neither_holds_up_the_teardown_nor_leaks_its_group():
    mp = multiprocessing.get_context("spawn")
    ports, go, out = mp.Queue(), mp.Queue(), mp.Queue()
    procs = [mp.Process(target=_rank_main, args=(r, ports, go, out)) for r in range(3)]
    run_processes(procs, timeout_s=100)
    seen = dict(out.get(timeout=5) for _ in range(3))
    for rank in (0, 1):
        # Torn down without waiting for rank 2 (not the collective timeout), the group kept
        # meanwhile, and dropped once rank 2's post completed the work.
        assert seen[rank]["teardown_s"] < COLLECTIVE_TIMEOUT_S / 4, seen
        assert seen[rank]["kept"] == 1 and seen[rank]["left"] == 0, seen
    assert seen[2] == [0.0, 1.0, 2.0]   # the late rank's exchange completed with the others' values


class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_the_graveyard_keeps_each_group_until_its_work_completes_and_its_thread_ends_when_empty():
    import weakref

    from elastic._worker.step_exchange import _Graveyard

    class Group:
        pass

    graveyard = _Graveyard()
    finished = _Work()
    finished.done = True
    graveyard.keep_if_pending(finished, Group())
    assert graveyard.pending() == 0 and graveyard._reaper is None     # completed: nothing to keep
    works, groups = [_Work(), _Work()], [Group(), Group()]
    alive = [weakref.ref(g) for g in groups]
    for work, group in zip(works, groups, strict=True):
        graveyard.keep_if_pending(work, group)
    del group, groups
    assert graveyard.pending() == 2 and all(ref() is not None for ref in alive)
    works[0].done = True
    wait_for(lambda: graveyard.pending() == 1, 5.0, "the completed work's group dropped")
    assert alive[0]() is None and alive[1]() is not None
    works[1].done = True
    wait_for(lambda: graveyard._reaper is None, 5.0, "the reaper thread's end")
    assert graveyard.pending() == 0 and alive[1]() is None
    again = _Work()
    graveyard.keep_if_pending(again, Group())                        # a later generation's: a new thread
    assert graveyard.pending() == 1 and graveyard._reaper is not None
    again.done = True
    wait_for(lambda: graveyard._reaper is None, 5.0, "the second reaper thread's end")


_EXIT_DURING_A_DROP = """
import datetime, sys, threading, time
import torch.distributed as dist
from elastic._worker.step_exchange import _GRAVEYARD

class Work:                 # completes when told; says when the graveyard has seen it completed
    done, seen = False, threading.Event()
    def is_completed(self):
        if self.done:
            self.seen.set()
        return self.done

class SlowToDrop:           # the real gloo group, dropped after a pause that outlasts the exit
    def __init__(self, group):
        self.group = group
    def __del__(self):
        time.sleep(0.5)
        del self.group      # ~ProcessGroupGloo, with the GIL released
        print("dropped", flush=True)

store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))
work = Work()
_GRAVEYARD.keep_if_pending(work, SlowToDrop(dist.group.WORLD))
dist.destroy_process_group()    # the graveyard holds the group's last reference
work.done = True
work.seen.wait(10)              # the reaper is about to drop the group: exit now
sys.exit(0)
"""


def test_the_process_exit_waits_for_the_graveyard_to_finish_a_drop():
    # A drop in flight as the interpreter finalizes: its thread is ended when it asks for the GIL
    # back, which out of ~ProcessGroupGloo (GIL released, noexcept) is std::terminate (stop 24's
    # CI: "terminate called without an active exception", exit code -6). The exit must wait.
    done = subprocess.run([sys.executable, "-c", _EXIT_DURING_A_DROP], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["dropped"], done.stdout

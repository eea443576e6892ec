"""Cutting a rank's gloo connections releases its own blocked collective at once, even when the
peer it waits on never closes its sockets (a node gone or cut off): what the controller asks of
the survivors when a member is lost (TrainWorker.request_stop(cut_group=True))."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

COLLECTIVE_TIMEOUT_S = 300     # beyond this test's timeout: waiting it out cannot pass

RANK = textwrap.dedent("""
    import datetime, sys, threading, time
    import torch, torch.distributed as dist
    from elastic._group_sockets import GroupSockets
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    sockets = GroupSockets()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=%d))
    sockets.capture()
    dist.all_reduce(torch.ones(4))               # the group works
    if rank == 1:
        print("peer-frozen", flush=True)
        time.sleep(3600)                         # alive, connections open, never joins again
    outcome = []
    def blocked():
        try:
            dist.all_reduce(torch.ones(4))
            outcome.append("completed")
        except Exception as error:
            outcome.append(type(error).__name__ + ": " + str(error)[:200])
    thread = threading.Thread(target=blocked, daemon=True)
    thread.start()
    thread.join(2.0)
    print("blocked" if thread.is_alive() else "not blocked: " + repr(outcome), flush=True)
    started = time.monotonic()
    print("cut", sockets.shutdown(), flush=True)
    thread.join(60)
    print("released" if not thread.is_alive() else "still blocked", round(time.monotonic() - started, 2),
          outcome, flush=True)
""" % COLLECTIVE_TIMEOUT_S)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cutting_the_group_releases_a_collective_blocked_on_a_frozen_peer():
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        out, _ = ranks[0].communicate(timeout=100)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    lines = out.splitlines()
    assert "blocked" in lines, out
    cut = next(line for line in lines if line.startswith("cut "))
    assert int(cut.split()[1]) >= 1, out                 # the connection to rank 1 was shut down
    released = next(line for line in lines if line.startswith(("released", "still blocked")))
    assert released.startswith("released") and "completed" not in released, out

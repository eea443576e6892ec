"""A generation's rendezvous store, hosted by its rank 0 before the generation starts
(elastic._worker.rendezvous): it listens before any rank joins, the hosting rank's window of
group sockets holds what it accepts (so a cut reaches a rank waiting on the store), and a
store hosted for a generation that never used it is not mistaken for the next one's."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from elastic._worker.rendezvous import HostedStore, join_store

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


# Rank 1, in a process of its own (in this one, its own end of the connection would be in the
# host's window too): joins the plan's store, says so, then waits on a key nobody sets.
RANK_1 = textwrap.dedent("""
    import sys
    from elastic._worker.rendezvous import join_store
    store, _ = join_store(("127.0.0.1", int(sys.argv[1])), rank=1, timeout_s=50, hosted=None)
    store.set("from_rank_1", b"1")
    print("waiting", flush=True)
    try:
        store.get("never")
        print("answered", flush=True)
    except Exception as error:
        print("released:", type(error).__name__, flush=True)
""")


def test_ranks_join_the_hosted_store_and_a_cut_by_its_host_releases_a_rank_waiting_on_it():
    hosted = HostedStore("127.0.0.1")
    assert hosted.address[1] > 0                         # the port the OS picked when it bound
    store, sockets = join_store(hosted.address, rank=0, timeout_s=50, hosted=hosted)
    assert store is hosted.store and sockets is hosted.sockets
    rank_1 = subprocess.Popen([sys.executable, "-c", RANK_1, str(hosted.address[1])], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert store.get("from_rank_1") == b"1"          # waits for rank 1 to join
        sockets.capture()
        assert rank_1.stdout.readline() == "waiting\n"   # about to wait (a cut before its get fails it too)
        assert rank_1.poll() is None
        # The connections the store accepted (rank 1's, and the host's own client's, both ends).
        assert sockets.shutdown() >= 1
        out, _ = rank_1.communicate(timeout=20)
        assert out.startswith("released:"), out
    finally:
        rank_1.kill()
        rank_1.wait()


def test_a_store_hosted_for_another_plan_is_not_used():
    unused = HostedStore("127.0.0.1")
    current = HostedStore("127.0.0.1")
    for address, rank in ((current.address, 0), (current.address, 1)):
        hosted = unused if rank == 0 else current        # rank 0 holds a stale one; rank 1 is no host
        store, _ = join_store(address, rank=rank, timeout_s=50, hosted=hosted)
        assert store is not unused.store and store is not current.store
        store.set(f"rank{rank}", b"x")
        assert current.store.get(f"rank{rank}") == b"x"   # a client of the plan's store

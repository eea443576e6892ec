"""Cutting a rank's gloo connections releases its own blocked collective at once, even when the
peer it waits on never closes its sockets (a node gone or cut off): what the controller asks of
the survivors when a member is lost (TrainWorker.request_stop(cut_group=True)). And only the
group's connections are cut: never one another thread opened meanwhile (reliability review F11)."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from elastic._worker.group_sockets import GroupSockets

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

COLLECTIVE_TIMEOUT_S = 300     # beyond this test's timeout: waiting it out cannot pass

RANK = textwrap.dedent("""
    import datetime, socket, sys, threading, time
    import torch, torch.distributed as dist
    from checkpointing._groups import new_lazy_gloo_group
    from elastic._worker.rendezvous import HostedStore, join_store
    rank, frozen, on = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    server = socket.create_server(("127.0.0.1", 0))          # the user's: a local service, open before
    # As TrainWorker forms a group: rank 0 hosts the store (and opens its window) first.
    hosted = HostedStore("127.0.0.1") if rank == 0 else None
    address = hosted.address if hosted else ("127.0.0.1", int(sys.argv[4]))
    if hosted:
        print("port", address[1], flush=True)
    user = []                                                # ... and a connection to it, opened by
    opener = threading.Thread(target=lambda: user.append(socket.create_connection(server.getsockname())))
    opener.start()                                           # another thread while the group forms
    store, sockets = join_store(address, rank, %d, hosted)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=%d))
    side = new_lazy_gloo_group(datetime.timedelta(seconds=%d))   # as the checkpoint side group is
    opener.join()
    accepted, _ = server.accept()
    sockets.capture(store=dist.distributed_c10d._get_default_store(), rank=rank, world_size=2)
    group = side if on == "side" else None       # the side group's pairs connect here, after the capture
    dist.all_reduce(torch.ones(4), group=group)  # the group works
    if rank == frozen:
        print("peer-frozen", flush=True)
        time.sleep(3600)                         # alive, connections open, never joins again
    outcome = []
    def blocked():
        try:
            dist.all_reduce(torch.ones(4), group=group)
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
    try:
        user[0].sendall(b"ping")
        print("user connection", "ok" if accepted.recv(4) == b"ping" else "broken", flush=True)
    except OSError as error:
        print("user connection broken:", error, flush=True)
""" % (COLLECTIVE_TIMEOUT_S, COLLECTIVE_TIMEOUT_S, COLLECTIVE_TIMEOUT_S))  # noqa: UP031 - the program's own f-strings use braces


# Gloo connects each pair from the higher rank to the lower one's listener: rank 0 cuts a
# connection it accepted, rank 1 one it opened to rank 0 (found through the exchanged listeners).
# `side`: the collective runs on a group whose pairs connect on first use, after the capture (the
# checkpoint side group): the cut must find those connections too.
@pytest.mark.parametrize("on", ["default", "side"], ids=["default_group", "lazy_side_group"])
@pytest.mark.parametrize("frozen", [1, 0], ids=["cut_by_rank_0", "cut_by_rank_1"])
def test_cutting_the_group_releases_a_collective_blocked_on_a_frozen_peer_and_nothing_else(frozen, on):
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, "0", str(frozen), on], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)]
    try:
        first = ranks[0].stdout.readline()           # rank 0's store listens on the port the OS picked
        while first and not first.startswith("port "):   # a warning before it
            first = ranks[0].stdout.readline()
        assert first.startswith("port "), ranks[0].communicate(timeout=30)[0]
        ranks.append(subprocess.Popen([sys.executable, "-c", RANK, "1", str(frozen), on, first.split()[1]],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        out, _ = ranks[1 - frozen].communicate(timeout=100)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    lines = out.splitlines()
    assert "blocked" in lines, out
    cut = next(line for line in lines if line.startswith("cut "))
    assert int(cut.split()[1]) >= 1, out                 # the connection to the frozen peer was shut down
    released = next(line for line in lines if line.startswith(("released", "still blocked")))
    assert released.startswith("released") and "completed" not in released, out
    assert "user connection ok" in lines, out            # the other thread's connection survived the cut


def echo_server():
    return socket.create_server(("127.0.0.1", 0))


def works(client: socket.socket, peer: socket.socket) -> bool:
    try:
        client.sendall(b"ping")
        return peer.recv(4) == b"ping"
    except OSError:
        return False


def test_a_connection_another_thread_opens_while_the_group_forms_is_not_cut():
    """The review's repro: GroupSockets(); a second thread opens a TCP connection (and an AF_UNIX
    pair); capture(); shutdown(). Nothing of the group was formed, so nothing may be cut."""
    server = echo_server()
    sockets = GroupSockets()
    opened = []
    opener = threading.Thread(target=lambda: opened.extend([socket.create_connection(server.getsockname()),
                                                            *socket.socketpair()]))
    opener.start()
    opener.join(10)
    client, unix_a, unix_b = opened
    peer, _ = server.accept()
    sockets.capture()
    assert sockets.shutdown() == 0
    assert works(client, peer) and works(unix_a, unix_b)
    for s in (client, peer, unix_a, unix_b, server):
        s.close()


class FakeStore:
    """The group's store, as far as the capture's exchange of listeners uses it."""

    def __init__(self, **published):
        self.keys = {k: v.encode() for k, v in published.items()}

    def set(self, key, value):
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def multi_get(self, keys):
        return [self.keys[k] for k in keys]


def test_only_connections_to_the_store_and_to_the_groups_listeners_are_cut():
    import json
    store = echo_server()                      # the rendezvous store (its address is in the plan)
    peer_listener = echo_server()              # rank 0's gloo listener (in its process, elsewhere)
    user_server = echo_server()                # the user's, open before the group forms
    sockets = GroupSockets(store.getsockname())
    # What forming the group opens, as rank 1: a store connection, one to rank 0's listener, its
    # own listener (bound to its address, as gloo's) and a connection a peer made to it.
    to_store = socket.create_connection(store.getsockname())
    to_peer = socket.create_connection(peer_listener.getsockname())
    listener = socket.create_server(("127.0.0.1", 0))
    from_peer = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    # What other threads open meanwhile: a connection to the user's service, and a server of
    # the user's (bound to all addresses) with a connection to it.
    to_user = socket.create_connection(user_server.getsockname())
    wildcard = socket.create_server(("", 0))
    to_wildcard = socket.create_connection(("127.0.0.1", wildcard.getsockname()[1]))
    ends = [store.accept()[0], peer_listener.accept()[0], user_server.accept()[0], wildcard.accept()[0]]
    store_end, peer_end, user_end, wildcard_end = ends
    group_store = FakeStore(**{"elastic/group_listeners/0": json.dumps([peer_listener.getsockname()])})
    sockets.capture(store=group_store, rank=1, world_size=2)
    assert json.loads(group_store.keys["elastic/group_listeners/1"]) == [list(listener.getsockname())]
    assert sockets.shutdown() == 3
    assert not works(to_store, store_end) and not works(to_peer, peer_end) and not works(from_peer, accepted)
    assert works(to_user, user_end) and works(to_wildcard, wildcard_end) and works(user_end, to_user)
    for s in (store, peer_listener, user_server, to_store, to_peer, listener, from_peer, accepted, to_user,
              wildcard, to_wildcard, *ends):
        s.close()


def test_a_cut_during_the_capture_reaches_what_the_capture_finds_afterwards():
    store = echo_server()
    sockets = GroupSockets(store.getsockname())
    to_store = socket.create_connection(store.getsockname())
    store_peer, _ = store.accept()
    assert sockets.shutdown() == 0                        # request_stop(cut_group=True) came first
    sockets.capture()
    assert not works(to_store, store_peer)
    for s in (store, to_store, store_peer):
        s.close()


@pytest.mark.parametrize("hosts_store", [False, True], ids=["joining_rank", "store_host"])
def test_a_cut_while_the_group_forms_reaches_its_store_and_nothing_else(hosts_store):
    """A rank still forming the group waits on the store (init_process_group), before any capture
    (reliability review R3-6): cut_store shuts down its connection to the store and, where it
    hosts the store, the ones the store accepted; not another thread's."""
    user_server = echo_server()
    if hosts_store:                        # as HostedStore: the window opens before the store listens
        sockets = GroupSockets()
        store = echo_server()
        sockets.store_at(store.getsockname())
    else:                                  # the store is another rank's, there before the window
        store = echo_server()
        sockets = GroupSockets(store.getsockname())
    to_store = socket.create_connection(store.getsockname())
    to_user = socket.create_connection(user_server.getsockname())
    store_end, user_end = store.accept()[0], user_server.accept()[0]
    assert sockets.cut_store() == (2 if hosts_store else 1)    # the host cuts both ends of its client's
    assert not works(to_store, store_end)
    assert works(to_user, user_end) and works(user_end, to_user)
    for s in (user_server, store, to_store, to_user, store_end, user_end):
        s.close()

"""The TCP connections of this rank's process group, so that leaving a broken group is instant.

When a peer dies mid-collective, only its direct neighbours see the error; a rank waiting on a
*live* peer that has left the collective would wait out the whole collective timeout. Neither
`destroy_process_group` (it only unregisters; a DDP wrapper keeps the group alive) nor gloo's
`abort()` closes the connections (checked on torch 2.13: a collective blocked on a frozen peer
stays blocked after either). Shutting down this rank's connections of the group does: every
peer blocked on us fails at once ("connection closed by peer"), and the failure cascades
through the group in milliseconds (measured in BENCHMARKS.md, R1).

Which connections are the group's. Forming a group takes seconds, and other threads of the
process open connections meanwhile: the user's metrics client, a dataset's S3 pool, the previous
generation's abandoned upload, Ray's own gRPC. Those must never be cut (a reset the user's code
sees fails the run as a user error). So a socket is the group's only when all of these hold:

- it appeared while the group was formed (between `GroupSockets()` and `capture()`);
- it is an IPv4/IPv6 TCP connection (in /proc/net/tcp or tcp6): never AF_UNIX, UDP, netlink,
  and never a listening socket (gloo's listener aborts the process if its socket is shut down);
- its other end is an endpoint of the group:
  1. the rendezvous store (`store_address`: the plan's master address and port), or
  2. one of this rank's own group listeners, i.e. the connection was accepted by a listener that
     appeared in the window, bound to a specific address (gloo binds its device's address) or
     to the store's port (the store server, on the rank that hosts it), or
  3. a peer's group listener, as every rank publishes its own in the group's store at capture
     (one small key per rank; gloo connects each pair to one side's listener).

Connections made after the capture. A group whose pairs connect on first use (the checkpoint
side group: checkpointing._groups, gloo's lazy connections) opens them after the window closed.
`shutdown` therefore looks again: a connection that is new since the window opened and was
accepted by one of this rank's group listeners or made to a peer's (the listeners the capture
found) is the group's too. Only the current group's listeners are known, and they are open while
it is (their ports are not reused), so a later group's connections never match.

A group still forming. `init_process_group` waits on the store for every peer's address (gloo's
full mesh; under NCCL, the checkpoint side group's): a rank whose peer never comes (it never got
its plan) waits there until the store's timeout, before any capture. `cut_store` cuts what the
window holds of the store already: this rank's connections to it and, on the rank hosting it,
the ones it accepted (its listener appeared in the window, on the store's port); the wait fails
at once ("connection closed"), and the peers' waits on the hosted store with it.

What remains possible: a thread that, in the same seconds, opens a listener bound to a specific
address and accepts a connection on it, or connects to the store or to a peer's gloo listener,
has that connection cut too. NCCL's own connections are created at the first collective, after
the window: they are not sockets this module knows; `_abort_process_group` cuts them.

Linux (/proc/self/fd, /proc/net/tcp); elsewhere this is a no-op and recovery falls back to the
timeouts.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

log = logging.getLogger("elastic.worker")

_FD_DIR = "/proc/self/fd"
_TCP_TABLES = (("/proc/self/net/tcp", socket.AF_INET), ("/proc/self/net/tcp6", socket.AF_INET6))
_LISTEN = "0A"                                  # TCP_LISTEN in /proc/net/tcp's `st` column
_WILDCARDS = ("0.0.0.0", "::")
_STORE_KEY = "elastic/group_listeners/{rank}"

Endpoint = tuple[str, int]


class _Tcp(NamedTuple):
    local: Endpoint
    remote: Endpoint
    listening: bool


def _sockets() -> dict[int, str]:
    """fd -> 'socket:[inode]' for every socket this process has open."""
    found: dict[int, str] = {}
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"{_FD_DIR}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(fd)] = target
    return found


def _address(hex_address: str, family: int) -> str:
    # The kernel prints each 32-bit word of the address as a native-endian integer.
    words = [int(hex_address[i:i + 8], 16) for i in range(0, len(hex_address), 8)]
    packed = struct.pack(f"={len(words)}I", *words)
    if family == socket.AF_INET6 and packed[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, packed[12:])      # an IPv4 peer on a dual-stack socket
    return socket.inet_ntop(family, packed)


def _tcp_sockets() -> dict[str, _Tcp]:
    """'socket:[inode]' -> endpoints of every TCP socket in this network namespace."""
    found = {}
    for path, family in _TCP_TABLES:
        try:
            with open(path) as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            try:
                (local_ip, local_port), (remote_ip, remote_port) = (f.split(":") for f in fields[1:3])
                found[f"socket:[{fields[9]}]"] = _Tcp((_address(local_ip, family), int(local_port, 16)),
                                                      (_address(remote_ip, family), int(remote_port, 16)),
                                                      fields[3] == _LISTEN)
            except (IndexError, ValueError, OSError):
                continue
    return found


def _resolve(address: Endpoint | None) -> set[Endpoint]:
    if address is None:
        return set()
    host, port = address
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return {(host, port)}
    # sockaddr[0] is the address string (typeshed types the whole sockaddr loosely).
    return {(_normalized(str(info[4][0])), port) for info in infos} | {(host, port)}


def _normalized(ip: str) -> str:
    return ip[len("::ffff:"):] if ip.startswith("::ffff:") and "." in ip else ip


def _reaches(endpoint: Endpoint, listeners: Iterable[Endpoint]) -> bool:
    """Whether `endpoint` is one of `listeners` (a wildcard listener matches on its port)."""
    ip, port = endpoint
    return any(port == lport and (lip in _WILDCARDS or lip == ip) for lip, lport in listeners)


class GroupSockets:
    """Use: `s = GroupSockets(store_address)` before forming a group, `s.capture(store, rank,
    world_size)` after, `s.shutdown()` to leave, with `s.cut_store()` where the group may still be
    forming. Both may come from another thread at any time, during `capture` too: what capture
    finds after them is shut down at once."""

    def __init__(self, store_address: Endpoint | None = None) -> None:
        self._before = _sockets()
        self._lock = threading.Lock()
        self.store_at(store_address)
        self._mine: dict[int, str] = {}
        self._own: list[Endpoint] = []        # this rank's group listeners (found at capture)
        self._theirs: list[Endpoint] = []     # the peers' group listeners (published at capture)
        self._cut = False

    def store_at(self, store_address: Endpoint | None) -> None:
        """The group's store is at `store_address` (known after construction when this rank
        hosts the store: its port is picked when it binds, inside the window)."""
        self._store = _resolve(store_address)
        self._store_port = store_address[1] if store_address else None

    def capture(self, store: Any = None, rank: int = 0, world_size: int = 1) -> None:
        """Keep the group's connections among the sockets that appeared since construction.

        With the group's `store` (a torch.distributed Store), publish this rank's group
        listeners and read the peers' (a collective: every rank of the group calls it), which
        finds the connections this rank opened to them."""
        new = self._new_since_window()
        own = sorted({t.local for _, t in new.values() if t.listening
                      and (t.local[0] not in _WILDCARDS or t.local[1] == self._store_port)})
        connections = {fd: (inode, t) for fd, (inode, t) in new.items() if not t.listening}
        self._own = own
        self._keep({fd: inode for fd, (inode, t) in connections.items()
                    if t.remote in self._store or _reaches(t.local, own)})
        if store is None or world_size <= 1:
            return
        store.set(_STORE_KEY.format(rank=rank), json.dumps(own))
        peers = store.multi_get([_STORE_KEY.format(rank=r) for r in range(world_size) if r != rank])
        theirs = [(ip, port) for answer in peers for ip, port in json.loads(answer)]
        self._theirs = theirs
        self._keep({fd: inode for fd, (inode, t) in connections.items() if _reaches(t.remote, theirs)})

    def _keep(self, found: dict[int, str]) -> None:
        with self._lock:
            cut = self._cut
            if not cut:
                self._mine.update(found)
        if cut:
            _shut_down(found)

    def shutdown(self) -> int:
        """Shut down the group's connections (the fds stay open: the group owns them)."""
        with self._lock:
            mine, self._mine, self._cut = self._mine, {}, True
        closed = _shut_down({**self._made_since_capture(), **mine})
        log.debug("shut down %d connection(s) of the broken group", closed)
        return closed

    def cut_store(self) -> int:
        """Shut down this rank's connections of the group's store opened since the window opened
        (to it, and those it accepted when this rank hosts it), captured or not: the one way to
        release a rank still forming the group, blocked on the store. The group is cut from now
        on: a capture after this shuts down what it finds."""
        with self._lock:
            self._cut = True
        new = self._new_since_window()
        stores = [t.local for _, t in new.values() if t.listening and t.local[1] == self._store_port]
        closed = _shut_down({fd: inode for fd, (inode, t) in new.items() if not t.listening
                             and (t.remote in self._store or _reaches(t.local, stores))})
        log.debug("shut down %d connection(s) of the group's store", closed)
        return closed

    def _made_since_capture(self) -> dict[int, str]:
        """The group's connections opened after the capture (pairs that connect on first use):
        new since the window opened, accepted by this rank's group listeners or made to a peer's."""
        if not (self._own or self._theirs):
            return {}
        return {fd: inode for fd, (inode, t) in self._new_since_window().items() if not t.listening
                and (_reaches(t.local, self._own) or _reaches(t.remote, self._theirs))}

    def _new_since_window(self) -> dict[int, tuple[str, _Tcp]]:
        """fd -> (inode, endpoints) of the TCP sockets opened since the window opened."""
        tcp = _tcp_sockets()
        return {fd: (inode, tcp[inode]) for fd, inode in _sockets().items()
                if self._before.get(fd) != inode and inode in tcp}


def _shut_down(sockets: dict[int, str]) -> int:
    closed = 0
    for fd, inode in sockets.items():
        try:
            if os.readlink(f"{_FD_DIR}/{fd}") != inode:
                continue          # the fd was closed and reused: not ours any more
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM:
                sock.getpeername()          # raises for listening sockets
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return closed

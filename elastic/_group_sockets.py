"""The TCP connections of this rank's process group, so that leaving a broken group is instant.

When a peer dies mid-collective, only its direct neighbours see the error; a rank waiting on a
*live* peer that has left the collective would wait out the whole collective timeout. Neither
`destroy_process_group` (it only unregisters; a DDP wrapper keeps the group alive) nor gloo's
`abort()` closes the connections. Shutting down this rank's connected sockets does: every peer
blocked on us fails at once ("connection closed by peer"), and the failure cascades through the
group in milliseconds (measured in BENCHMARKS.md, R1).

The group's sockets are those that appeared while the group was being formed. Listening
sockets are left alone: gloo's listener aborts the process if its socket is shut down.
Linux (/proc/self/fd); elsewhere this is a no-op and recovery falls back to the timeouts.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("elastic.worker")

_FD_DIR = "/proc/self/fd"


def _sockets() -> dict[int, str]:
    """fd -> 'socket:[inode]' for every socket this process has open."""
    found = {}
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


class GroupSockets:
    """Use: `s = GroupSockets()` before forming a group, `s.capture()` after, `s.shutdown()` to leave."""

    def __init__(self) -> None:
        self._before = _sockets()
        self._mine: dict[int, str] = {}

    def capture(self) -> None:
        self._mine = {fd: ino for fd, ino in _sockets().items() if self._before.get(fd) != ino}

    def shutdown(self) -> int:
        """Shut down the group's connected sockets (the fds stay open: the group owns them)."""
        closed = 0
        for fd, inode in self._mine.items():
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
        self._mine = {}
        log.debug("shut down %d connection(s) of the broken group", closed)
        return closed

"""Signals to worker processes, sent the way an operator would: by pid, from outside.

status.json is rewritten about once a second, so a pid read from it may belong to a worker
that has just died, and a dead pid may be reused by an unrelated process. Before signalling,
check that the pid still is a Ray worker process (its command line starts with "ray::", the
title Ray gives actor processes) and remember its start time, so that a later heal (SIGCONT)
or cleanup (SIGKILL) never hits a recycled pid.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

WORKER_TITLE = "ray::"
# The runtime's node keepers (elastic/_node_keeper.py: the actor class NodeKeeper), by the title
# Ray gives an actor's process; named here, since chaos/ does not import the runtime.
KEEPER_TITLE = "ray::NodeKeeper"


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None   # field 22 of stat: starttime in clock ticks


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(WORKER_TITLE.encode())
    except OSError:
        return False


@dataclass(frozen=True)
class Proc:
    """A process identified by pid and start time (a pid alone can be recycled)."""

    pid: int
    started: int | None

    @classmethod
    def of_worker(cls, pid: int) -> Proc | None:
        """The worker process `pid`, or None if no Ray worker runs under that pid now."""
        started = start_time(pid)
        if started is None or not is_worker(pid):
            return None
        return cls(pid, started)

    def same(self) -> bool:
        return self.started is not None and start_time(self.pid) == self.started and alive(self.pid)

    def signal(self, sig: int) -> bool:
        """Send `sig` if this is still the same process; whether it was sent."""
        if not self.same():
            return False
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:
            return False


def parent(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None     # field 4 of stat: the parent's pid


def siblings_titled(procs: list[Proc], title: str) -> list[Proc]:
    """Processes whose command line starts with `title` and whose parent is that of one of
    `procs` (the raylet that started them: the same Ray, on the same node), themselves excluded."""
    parents = {parent(p.pid) for p in procs} - {None}
    mine = {p.pid for p in procs}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(title.encode()):
                    continue
        except OSError:
            continue
        if parent(pid) in parents:
            started = start_time(pid)
            if started is not None:
                found.append(Proc(pid, started))
    return found


def resume_and_kill(procs: list[Proc]) -> list[int]:
    """Final cleanup of worker processes left alive: SIGCONT (a stopped process cannot act on
    anything else) then SIGKILL. Returns the pids that were still there."""
    left = [p for p in procs if p.same()]
    for p in left:
        p.signal(signal.SIGCONT)
        p.signal(signal.SIGKILL)
    return [p.pid for p in left]

"""A generation's rendezvous store: hosted by its rank 0 from before the generation starts.

Why not `init_method="tcp://..."` on every rank: there, rank 0 opens the store only when its
training thread reaches `init_process_group`, and a rank that connects before that is refused
and retries only after torch's connect backoff (0.7 s measured on torch 2.13), holding the whole
group in its rendezvous: the largest part of a re-form in R1 (BENCHMARKS.md). Here the
controller asks the new rank 0 for the store's address before it hands out the plans
(RayWorkerGroup.rendezvous_address): the store is listening by then, and every rank connects at
once. The port is the one the OS picks when the store binds port 0, so no other process can take
it between choosing and binding.

The store's listener and the connections it accepts belong to the group (group_sockets): the
hosting rank opens its GroupSockets window before the listener, so both appear in it.
"""
from __future__ import annotations

import datetime

from torch.distributed import Store, TCPStore

from elastic._worker.group_sockets import GroupSockets


class HostedStore:
    """The store a rank 0 opens for its next generation, with its window of group sockets."""

    def __init__(self, ip: str) -> None:
        self.sockets = GroupSockets()          # opened before the listener: it is the group's
        self.store = TCPStore(ip, 0, is_master=True, wait_for_workers=False)
        self.address = (ip, self.store.port)
        self.sockets.store_at(self.address)


def join_store(plan_address: tuple[str, int], rank: int, timeout_s: float,
               hosted: HostedStore | None) -> tuple[Store, GroupSockets]:
    """The generation's store and this rank's window of group sockets: the one this worker
    hosts when it is the plan's rank 0 at the plan's address, else a client of the plan's."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if hosted is not None and rank == 0 and hosted.address == tuple(plan_address):
        hosted.store.set_timeout(timeout)
        return hosted.store, hosted.sockets
    sockets = GroupSockets(store_address=plan_address)
    host, port = plan_address
    return TCPStore(host, port, is_master=False, timeout=timeout), sockets

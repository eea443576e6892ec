"""This rank's place in a generation's process group, across generations: the store it hosts
as the next generation's rank 0, the join, the leave, and the cut.

The cut fails every collective of the group at once, on this rank and on the peers blocked on
it: NCCL's communicators are aborted, the group's gloo connections and its store's are shut down
(elastic._worker.group_sockets). It may be asked for from another thread than the training
thread (the controller's `request_stop(cut_group=True)` when a member is lost), and before the
join has begun: a cut asked for the current plan is remembered, and a join that starts after it
fails at once instead of waiting on its rendezvous for a member that never comes.

torch is imported inside the methods, as in the rest of the worker (see worker.py).
"""
from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic._protocol import GenerationPlan
    from elastic._worker.group_sockets import GroupSockets
    from elastic._worker.rendezvous import HostedStore

log = logging.getLogger("elastic.worker")


class GroupMembership:
    """The group this rank joins, generation after generation."""

    def __init__(self, *, use_gpu: bool):
        self._use_gpu = use_gpu
        self._lock = threading.Lock()                 # the sockets and the cut flag, changed together
        self._sockets: GroupSockets | None = None     # the current group's, joined or joining
        self._cut_requested = False                   # the current plan's group is cut, joined or not yet
        self.hosted: HostedStore | None = None        # the next generation's store, when this is its rank 0

    def host_store(self, ip: str) -> tuple[str, int]:
        """Open the next generation's store here (this rank is its rank 0) and say where it
        listens (elastic._worker.rendezvous). An earlier one that no generation used is dropped."""
        from elastic._worker.rendezvous import HostedStore
        self.hosted = HostedStore(ip)
        return self.hosted.address

    def new_plan(self) -> None:
        """A new generation's plan: no cut is asked for it yet."""
        with self._lock:
            self._cut_requested = False

    def mark_cut(self) -> GroupSockets | None:
        """The current plan's group is to be cut: a join that has not handed its sockets over yet
        fails at once. Returns the sockets to cut now (this generation's, joined or joining;
        before its join began, the previous one's)."""
        with self._lock:
            self._cut_requested = True
            return self._sockets

    def cut(self, sockets: GroupSockets | None) -> None:
        """Fail every collective of the group of `sockets`: abort the NCCL communicators, shut
        down the gloo connections and the store's (a group still forming waits on its store).
        Best effort."""
        if self._use_gpu:
            try:
                from torch.distributed.distributed_c10d import _abort_process_group
                _abort_process_group()
            except Exception:   # e.g. mid-join, no group yet to abort: the sockets are still cut
                log.debug("aborting the process group failed", exc_info=True)
        if sockets is not None:
            try:
                sockets.shutdown()
                sockets.cut_store()
            except Exception:   # best effort; the collective timeout still applies
                log.debug("cutting the group's connections failed", exc_info=True)

    def leave(self, *, abort: bool = False) -> None:
        """Destroy the current group. With `abort` (the group broke), first cut its connections
        so that peers blocked on this rank fail now."""
        import torch.distributed as dist
        if not dist.is_initialized():
            # torch names each group from a process-wide counter (the default group "0", the
            # mesh's and the side groups after it) and puts the name in every rendezvous key; only
            # destroying the default group resets it. A join that failed (a peer never came) has
            # counted its group without making one: unreset, this rank's next group would carry
            # another name than a fresh worker's, and every later generation that mixes them
            # would wait on different keys until the collective timeout (found by the mixed-tp
            # chaos campaign, seed 1: four generations in a row). So the count starts again here.
            dist.distributed_c10d._world.group_count = 0
            return
        if abort:
            self.cut(self._sockets)
        try:
            dist.destroy_process_group()
        except Exception:   # the old group may already be broken; it is discarded either way
            log.debug("destroying the previous process group failed", exc_info=True)

    def join(self, plan: GenerationPlan, *, backend: str, formed: Callable[[], None]) -> None:
        """Leave the previous group and join `plan`'s. `formed` runs once the group exists and
        before its connections are captured (what must be formed with it: the checkpoint side
        group, whose connections a cut must reach too)."""
        import torch.distributed as dist

        from elastic._worker.rendezvous import join_store
        self.leave()
        hosted, self.hosted = self.hosted, None
        store, sockets = join_store((plan.master_addr, plan.master_port), plan.rank, plan.timeout_s, hosted)
        # Handed over before the join: a cut from now on reaches this group's store, on which the
        # join waits for every rank; a member that never got its plan would otherwise hold this
        # rank there for collective_timeout_s. After the capture below it reaches the group's
        # connections too, and releases the capture's exchange of listeners.
        with self._lock:
            self._sockets = sockets
            cut = self._cut_requested
        if cut:      # the cut came before the hand-over: it reached the previous group's sockets
            self.cut(sockets)
            raise dist.DistNetworkError(f"generation {plan.generation}'s group was cut before rank {plan.rank} "
                                        f"joined it (a member was lost)")
        dist.init_process_group(backend, store=store, rank=plan.rank, world_size=plan.world_size,
                                timeout=datetime.timedelta(seconds=plan.timeout_s))
        formed()
        sockets.capture(store=dist.distributed_c10d._get_default_store(), rank=plan.rank,
                        world_size=plan.world_size)

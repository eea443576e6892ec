"""The process group checkpoint collectives run on.

Internal. The training thread drives collectives on the default group at the same time as a
background upload runs, so the upload must not touch it. Every rank creates a separate gloo
group over the default group's ranks, collectively, in the training thread (in
`CheckpointManager.bind_group` right after the default group forms, else inside the first
save/load, which every rank calls at the same step boundary); DCP planning, the file-record
gather (to rank 0, the one writer of the manifest) and the commit broadcast of one save run on it.
Gloo also lets these object collectives work when the default group is NCCL. The group is
recreated when the default group changes (a rescale).

No full mesh. Gloo connects every pair of ranks when it creates a group (each rank reads every
other rank's address from the store: N*(N-1) reads, 67 M at 8,192 ranks, at every re-form).
The collectives here are rooted at rank 0 (gather, broadcast) and DCP's planning is a gather
and a scatter, so the side group is created with gloo's lazy connections
(TORCH_GLOO_LAZY_INIT): a pair connects at its first message, O(N) connections and store reads
per generation. The first save of a generation pays the connections to rank 0 (milliseconds
here), in the upload's thread. A runtime that cuts the group's connections on failure must find
these too (elastic._worker.group_sockets looks again when it cuts).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
from typing import TYPE_CHECKING, Any

# torch.distributed is imported in the methods: a manager that only lists or fences
# checkpoints (the controller) creates a SideGroup but never uses it.
if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclasses.dataclass(frozen=True)
class GroupView:
    """A snapshot of the side group for one operation (the training thread may re-form later)."""

    pg: Any  # None when torch.distributed is not initialized (single process)
    rank: int
    world_size: int

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.pg is None or self.world_size == 1:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, src), group=self.pg)
        return box[0]

    def gather(self, obj: Any, dst: int = 0) -> list | None:
        """Every rank's `obj` on rank `dst` (in rank order), None on the others: O(N) bytes in
        all, where an all_gather moves O(N^2) (each rank's records to every rank)."""
        if self.pg is None or self.world_size == 1:
            return [obj]
        import torch.distributed as dist
        out: list | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.pg, dst), group=self.pg)
        return out

    def all_gather(self, obj: Any) -> list:
        if self.pg is None or self.world_size == 1:
            return [obj]
        import torch.distributed as dist
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out


class SideGroup:
    """Owns the gloo side group; `view()` is collective only when it (re)creates the group."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pg: ProcessGroup | None = None
        self._for_default: ProcessGroup | None = None      # the default group self._pg was made over

    def view(self) -> GroupView:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return GroupView(None, 0, 1)
        default = dist.group.WORLD
        if self._pg is None or self._for_default is not default:
            # Collective over the default group: every rank reaches here at the same boundary.
            self._pg = new_lazy_gloo_group(self.timeout)
            self._for_default = default
        return GroupView(self._pg, dist.get_rank(self._pg), dist.get_world_size(self._pg))

    def forget(self) -> None:
        """Drop the reference; torch destroys the group with the default group."""
        self._pg = None
        self._for_default = None


_LAZY_INIT_ENV = "TORCH_GLOO_LAZY_INIT"
_lazy_env_lock = threading.Lock()


def new_lazy_gloo_group(timeout: datetime.timedelta) -> ProcessGroup:
    """Collective over the default group: a gloo group whose pairs connect on first use.

    torch 2.13 takes lazy connections from the environment only (ProcessGroupGloo.Options has no
    field for it), read when the group is created: it is set for this one call, under a lock, and
    put back as it was; a user who set it keeps it."""
    import torch.distributed as dist
    with _lazy_env_lock:
        before = os.environ.get(_LAZY_INIT_ENV)
        os.environ[_LAZY_INIT_ENV] = "1"
        try:
            return dist.new_group(backend="gloo", timeout=timeout)
        finally:
            if before is None:
                del os.environ[_LAZY_INIT_ENV]
            else:
                os.environ[_LAZY_INIT_ENV] = before

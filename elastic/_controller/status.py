"""What the controller tells status.json at each tick and transition: its state, generation,
step, the group's workers and the ready spares, and the newest committed checkpoint (listed in
the run record's writer thread, at most every 2 s, so a stalled listing never stalls the loop).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic._controller.worker_group import READY, WorkerView

if TYPE_CHECKING:
    from elastic._controller.controller import CheckpointView
    from elastic._controller.run_record import RunRecord

log = logging.getLogger("elastic.controller")

LIST_EVERY_S = 2.0


class StatusReport:
    def __init__(self, recorder: RunRecord, checkpoints: CheckpointView, clock: Callable[[], float]):
        self._recorder, self._checkpoints, self._clock = recorder, checkpoints, clock
        self.last_committed: int | None = None
        self._announced: int | None = None   # newest commit handed to the recorder
        self._listed_at = -1e9

    def write(self, *, force: bool, state: str, generation: int, step: int, world_size: int,
              members: list[int], views: dict[int, WorkerView]) -> None:
        if force:
            self._listed_at = -1e9       # a transition: list again when status is written
        workers = [{"rank": rank, "pid": v.info.pid, "node_id": v.info.node_id, "actor_id": v.info.actor_id}
                   for rank, wid in enumerate(members) if (v := views.get(wid)) and v.info]
        # Ready workers outside the group: hot spares, or replacements waiting for the next re-form.
        spares = [{"pid": v.info.pid, "node_id": v.info.node_id, "actor_id": v.info.actor_id}
                  for wid, v in sorted(views.items()) if v.status == READY and wid not in members and v.info]
        self._recorder.write_status(force=force, state=state, generation=generation, step=step,
                                    world_size=world_size, last_committed_step=self._committed, workers=workers,
                                    spares=spares)

    def _committed(self) -> int | None:
        """The newest committed step, listed at most every LIST_EVERY_S. The recorder calls it when
        it writes status.json (in its writer thread)."""
        now = self._clock()
        if now - self._listed_at > LIST_EVERY_S:
            self._listed_at = now
            try:
                # Newest first, stopping at the first valid manifest: O(1) reads however many
                # checkpoints are kept; then the manifests of commits not announced yet.
                self.last_committed = self._checkpoints.latest_step()
                new = self._checkpoints.committed_since(self._announced)
                if new:
                    self._announced = new[-1]
                    self._recorder.on_commits(new)          # the callbacks' on_checkpoint
            except Exception:   # status is best effort; storage errors surface in saves
                log.debug("could not read the latest checkpoint", exc_info=True)
        return self.last_committed

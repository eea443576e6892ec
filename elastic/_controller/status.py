"""What the controller tells status.json at each tick and transition: its state, generation,
step, the group's workers and the ready spares, and the newest committed checkpoint (looked at in
the run record's writer thread, at most every 2 s, so a stalled listing never stalls the loop;
through the newest-commit hint, so that "nothing new" costs one small GET, not a listing).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic._controller.states import RunState
from elastic._controller.worker_group import READY, WorkerView

if TYPE_CHECKING:
    from elastic._controller.collaborators import CheckpointView
    from elastic._controller.run_record import RunRecord

log = logging.getLogger("elastic.controller")

LIST_EVERY_S = 2.0       # how often status.json's newest commit is looked at (a small hint read, usually)
LATEST_EVERY_S = 30.0    # ... and listed in full (a checkpoint deleted or found corrupt meanwhile)


class StatusReport:
    def __init__(self, recorder: RunRecord, checkpoints: CheckpointView, clock: Callable[[], float]):
        self._recorder, self._checkpoints, self._clock = recorder, checkpoints, clock
        self.last_committed: int | None = None
        self.world_size = 0                  # of the newest generation that ran
        self._announced: int | None = None   # newest commit handed to the recorder
        self._listed_at = -1e9
        self._latest_at = -1e9

    def write(self, *, force: bool, state: RunState, generation: int, step: int, members: list[int],
              views: dict[int, WorkerView]) -> None:
        """`members`: the newest generation's (its survivors while recovering)."""
        if state == RunState.RUNNING:
            self.world_size = len(members)
        if force:
            self._listed_at = -1e9       # a transition: list again when status is written
        # The lists are built when status.json is written (at most once a second, on the writer's
        # thread), not at every tick: each holds a record per worker. The tick's members and views
        # are what they are built from (the group hands a new views dict at each tick).
        ranked = tuple(members)
        self._recorder.write_status(force=force, state=state.value, generation=generation, step=step,
                                    world_size=self.world_size, last_committed_step=self._committed,
                                    workers=lambda: _workers(ranked, views),
                                    spares=lambda: _spares(ranked, views))

    def _committed(self) -> int | None:
        """The newest committed step, looked at most every LIST_EVERY_S. The recorder calls it when
        it writes status.json (in its writer thread)."""
        now = self._clock()
        if now - self._listed_at > LIST_EVERY_S:
            self._listed_at = now
            try:
                if self._announced is None or now - self._latest_at > LATEST_EVERY_S:
                    # Newest first, stopping at the first valid manifest: O(1) reads however many
                    # checkpoints are kept (never every manifest, even on the first look).
                    self._latest_at = now
                    self.last_committed = self._checkpoints.latest_step()
                    if self._announced is None:
                        self._announced = self.last_committed
                        if self.last_committed is not None:
                            self._recorder.on_commits([self.last_committed])   # the callbacks' on_checkpoint
                        return self.last_committed
                # The manifests of commits not announced yet (a small hint read when there are none).
                new = self._checkpoints.committed_since(self._announced)
                if new:
                    self._announced = self.last_committed = new[-1]
                    self._recorder.on_commits(new)          # the callbacks' on_checkpoint
            except Exception:   # status is best effort; storage errors surface in saves
                log.debug("could not read the latest checkpoint", exc_info=True)
        return self.last_committed


def _workers(members: tuple[int, ...], views: dict[int, WorkerView]) -> list[dict]:
    """status.json's `workers`: the group's members in rank order."""
    return [{"rank": rank, "pid": v.info.pid, "node_id": v.info.node_id, "actor_id": v.info.actor_id,
             "polled_by": "agent" if v.via_agent else "controller"}
            for rank, wid in enumerate(members) if (v := views.get(wid)) and v.info]


def _spares(members: tuple[int, ...], views: dict[int, WorkerView]) -> list[dict]:
    """Ready workers outside the group: hot spares, or replacements waiting for the next re-form."""
    inside = set(members)
    return [{"pid": v.info.pid, "node_id": v.info.node_id, "actor_id": v.info.actor_id}
            for wid, v in sorted(views.items()) if v.status == READY and wid not in inside and v.info]

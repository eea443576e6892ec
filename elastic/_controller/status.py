"""What the controller tells status.json at each tick and transition: its state, generation,
step, the group's workers and the ready spares, and the newest committed checkpoint (a plain
value the commit watch found on its own thread: commit_watch.CommitWatch; the new commits are
announced to the run record from here, on the controller's thread).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from elastic._controller.slot_table import READY, WorkerView
from elastic._controller.states import RunState
from elastic.layout import Layout

if TYPE_CHECKING:
    from elastic._controller.commit_watch import CommitWatch
    from elastic._controller.run_record import RunRecord

log = logging.getLogger("elastic.controller")


class StatusReport:
    def __init__(self, recorder: RunRecord, commits: CommitWatch, *, tp: int = 1, pp: int = 1):
        self._recorder, self._commits, self._tp, self._pp = recorder, commits, tp, pp
        self.last_committed: int | None = None
        self.world_size = 0                  # of the newest generation that ran

    def write(self, *, force: bool, state: RunState, generation: int, step: int, members: list[int],
              views: dict[int, WorkerView], bad_nodes: tuple[str, ...] = ()) -> None:
        """`members`: the newest generation's (its survivors while recovering); `bad_nodes`: the
        nodes silent corruption marked (bad_nodes.BadNodes)."""
        if state == RunState.RUNNING:
            self.world_size = len(members)
        if force:
            self._commits.wake()                    # a transition: a commit may have just landed
        self.last_committed, new = self._commits.take()
        if new:
            self._recorder.on_commits(new)          # the callbacks' on_checkpoint
        # The lists are built when status.json is written (at most once a second, on the writer's
        # thread), not at every tick: each holds a record per worker. The tick's members and views
        # are what they are built from (the group hands a new views dict at each tick).
        ranked = tuple(members)
        layout = Layout.of(self.world_size, self._tp, self._pp) if self.world_size else None
        self._recorder.write_status(force=force, state=state.value, generation=generation, step=step,
                                    world_size=self.world_size, last_committed_step=self.last_committed,
                                    layout=layout.to_dict() if layout else None,
                                    workers=lambda: _workers(ranked, views, Layout(1, self._tp, self._pp)),
                                    spares=lambda: _spares(ranked, views), bad_nodes=list(bad_nodes))


def _workers(members: tuple[int, ...], views: dict[int, WorkerView], layout: Layout) -> list[dict]:
    """status.json's `workers`: the group's members in rank order, with their replica, TP rank and
    pipeline stage (`layout`: any replica count; only its tp and pp are read)."""
    return [{"rank": rank, "replica": layout.dp_rank(rank), "tp_rank": layout.tp_rank(rank),
             "pp_rank": layout.pp_rank(rank), "pid": v.info.pid,
             "node_id": v.info.node_id, "actor_id": v.info.actor_id,
             "polled_by": "agent" if v.via_agent else "controller"}
            for rank, wid in enumerate(members) if (v := views.get(wid)) and v.info]


def _spares(members: tuple[int, ...], views: dict[int, WorkerView]) -> list[dict]:
    """Ready workers outside the group: hot spares, or replacements waiting for the next re-form."""
    inside = set(members)
    return [{"pid": v.info.pid, "node_id": v.info.node_id, "actor_id": v.info.actor_id}
            for wid, v in sorted(views.items()) if v.status == READY and wid not in inside and v.info]

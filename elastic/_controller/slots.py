"""How many workers the run keeps placed, and which of them may join a group.

Pure arithmetic over ScalingConfig and the worker views: the slots to keep alive or pending
(max_workers plus the spares; with no maximum, every placed worker plus one probe placement),
the cap on a group's size and its members' order (whole replicas), the ready workers.
"""
from __future__ import annotations

from collections.abc import Mapping

from elastic._controller.replica_arrangement import arrange
from elastic._controller.slot_table import DEAD, READY, STARTING, WorkerView
from elastic._protocol import WorkerReport
from elastic.config import ScalingConfig


class Slots:
    def __init__(self, scaling: ScalingConfig):
        self._scaling = scaling

    def target(self, views: dict[int, WorkerView], *, broken_world: int | None = None) -> int:
        """Slots to keep alive or pending: max_workers and the spares; with no maximum, every placed
        worker plus one probe placement (a spare whenever capacity appears).

        While a recovery is open (from the failure to the re-formed group's first step),
        `broken_world` is the size of the group that broke: only its lost members are replaced
        then (at least min_workers), and the spares start once the group steps again. A worker's
        start is seconds of CPU on its host (Python, torch, the checkpoint code) that a
        re-forming group sharing the host needs: in the mixed chaos campaign (one-CPU nodes on
        2 cores) the spare replacing the one the group took started during every re-form.

        Under tensor parallelism not even the lost members are replaced during the recovery
        (unless the group needs them to reach min_workers): the re-form never waits on them, as
        the lost rank's replica leaves the group whole, so their start would only compete with it
        (R1-TP in BENCHMARKS.md); they start when the group steps again and regrow the replica."""
        scaling = self._scaling
        if scaling.max_workers is not None:
            wanted = scaling.max_workers + scaling.spare_workers
        else:
            placed = sum(1 for v in views.values() if v.status in (READY, STARTING))
            wanted = max(scaling.min_workers, placed + 1)
        if broken_world is not None and scaling.unit_size > 1:
            alive = sum(1 for v in views.values() if v.status != DEAD)
            return min(wanted, max(scaling.min_workers, alive))
        if broken_world is not None:
            return min(wanted, max(scaling.min_workers, broken_world))
        return wanted

    def cap(self, wids: list[int], *, settled: Mapping[int, WorkerReport] | None = None,
            views: Mapping[int, WorkerView] | None = None, limit: int | None = None) -> list[int]:
        """The group from the candidates `wids`, preferred first: at most max_workers (and
        `limit`), in whole units of ScalingConfig.unit_size ranks (replicas; under hsdp shard
        groups), in rank order (survivors at the position of the shard they hold:
        elastic._controller.replica_arrangement)."""
        most = min(n for n in (self._scaling.max_workers, limit, len(wids)) if n is not None)
        node_of = {w: v.info.node_id for w, v in views.items() if v.info is not None} if views else None
        return arrange(wids, settled or {}, self._scaling.unit_size, limit=most, node_of=node_of)

    @staticmethod
    def ready(views: dict[int, WorkerView]) -> list[int]:
        return sorted(w for w, v in views.items() if v.status == READY)

    @staticmethod
    def spares(views: dict[int, WorkerView], members: list[int]) -> list[int]:
        """Ready workers outside the group of `members`."""
        group = set(members)
        return [w for w in Slots.ready(views) if w not in group]

    @staticmethod
    def pending(views: dict[int, WorkerView]) -> int:
        """Slots placed or starting, not ready yet."""
        return sum(1 for v in views.values() if v.status not in (READY, DEAD))

    @staticmethod
    def starting(views: dict[int, WorkerView]) -> int:
        """Slots placed whose worker is starting."""
        return sum(1 for v in views.values() if v.status == STARTING)

    @staticmethod
    def preempted_spares(views: dict[int, WorkerView], members: list[int]) -> list[int]:
        """Ready workers outside the group that got a preemption notice: nothing to save, they go."""
        group = set(members)
        return [v.wid for v in views.values()
                if v.report is not None and v.report.preempted and v.status == READY and v.wid not in group]

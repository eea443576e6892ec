"""How many workers the run keeps placed, and which of them may join a group.

Pure arithmetic over ScalingConfig and the worker views: the slots to keep alive or pending
(max_workers plus the spares; with no maximum, every placed worker plus one probe placement),
the cap on a group's size, the ready workers.
"""
from __future__ import annotations

from collections.abc import Callable

from elastic._controller.worker_group import READY, STARTING, WorkerView
from elastic.config import ScalingConfig


class Slots:
    def __init__(self, scaling: Callable[[], ScalingConfig]):
        self._scaling = scaling      # read when used (a test may swap the config)

    def target(self, views: dict[int, WorkerView]) -> int:
        """Slots to keep alive or pending: max_workers and the spares; with no maximum, every placed
        worker plus one probe placement (a spare whenever capacity appears)."""
        scaling = self._scaling()
        if scaling.max_workers is not None:
            return scaling.max_workers + scaling.spare_workers
        placed = sum(1 for v in views.values() if v.status in (READY, STARTING))
        return max(scaling.min_workers, placed + 1)

    def cap(self, wids: list[int]) -> list[int]:
        maximum = self._scaling().max_workers
        return wids if maximum is None else wids[:maximum]

    @staticmethod
    def ready(views: dict[int, WorkerView]) -> list[int]:
        return sorted(w for w, v in views.items() if v.status == READY)

    @staticmethod
    def preempted_spares(views: dict[int, WorkerView], members: list[int]) -> list[int]:
        """Ready workers outside the group that got a preemption notice: nothing to save, they go."""
        group = set(members)
        return [v.wid for v in views.values()
                if v.report is not None and v.report.preempted and v.status == READY and v.wid not in group]

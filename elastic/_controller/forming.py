"""Forming a generation: where it restores from, the fence, and every member's plan.

`GenerationFormer` counts generations (they keep growing across runs on the same storage, or the
fence would refuse a later run's checkpoints as a zombie's), reads where the run resumes from,
chooses a re-formed group's restore (a warm broadcast from the survivor furthest ahead that
holds its state, else the newest committed checkpoint), writes the fence and hands every member
its plan, and resets what counts per generation. Who the members are is the controller's
choice; it forms only what it is handed. Storage calls go through the controller's retrying
`storage` call, which fails the run when an error outlasts its retries.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic._controller.collaborators import CheckpointView, WorkerGroup
from elastic._controller.intake import ReportIntake
from elastic._controller.ledgers import RecoveryLedger, StepLedger
from elastic._controller.running import RunningWatch
from elastic._controller.states import Running, Starting
from elastic._controller.stragglers import StragglerDetector
from elastic._controller.worker_group import WorkerView
from elastic._protocol import GenerationPlan, RestoreKind, RestorePlan, WorkerReport, placement
from elastic.config import FailureConfig
from elastic.errors import WorkerLostError

if TYPE_CHECKING:
    from elastic._controller.run_record import RunRecord

log = logging.getLogger("elastic.controller")

StorageCall = Callable[[str, Callable[[], Any]], tuple[bool, Any]]


class GenerationFormer:
    """Starts generations and owns their count."""

    def __init__(self, group: WorkerGroup, checkpoints: Callable[[], CheckpointView], storage: StorageCall, *,
                 recorder: RunRecord, intake: ReportIntake, steps: StepLedger, stragglers: StragglerDetector,
                 recoveries: RecoveryLedger, running: RunningWatch, failure: Callable[[], FailureConfig],
                 clock: Callable[[], float]):
        # The checkpoints are read through the controller's attribute as it is when read (a test may swap it).
        self.group, self._checkpoints, self._storage = group, checkpoints, storage
        self.recorder, self.intake, self.steps, self.stragglers = recorder, intake, steps, stragglers
        self.recoveries, self.running, self._failure, self._clock = recoveries, running, failure, clock
        self.generation = -1

    def resume_plan(self) -> tuple[bool, RestorePlan | None]:
        """The first generation's restore: after the previous run's generations, from its newest
        checkpoint. (False, None): storage said "not now"."""
        return self._storage("read the checkpoints to resume from", self._read_resume_plan)

    def _read_resume_plan(self) -> RestorePlan:
        fence = self._checkpoints().current_fence()
        if fence is not None:
            self.generation = max(self.generation, fence)
        self.intake.first_generation = self.generation + 1
        latest = self._checkpoints().latest_step()
        if latest is None:
            return RestorePlan(RestoreKind.FRESH)
        self.recorder.resumed_from = latest
        self.recorder.load_previous_metrics(latest)
        self.steps.recorded_step = self.intake.step = latest
        return RestorePlan(RestoreKind.CHECKPOINT, step=latest)

    def reform_plan(self, members: list[int], settled: dict[int, WorkerReport]) -> tuple[bool, RestorePlan | None]:
        """A re-formed group's restore: warm from the member furthest ahead that holds its state,
        else from the newest committed checkpoint (or fresh when there is none)."""
        source = next((w for w in members if w in settled and settled[w].has_state), None)
        if source is not None:
            return True, RestorePlan(RestoreKind.BROADCAST, source_rank=members.index(source),
                                     step=settled[source].step)
        ok, latest = self._storage("list the committed checkpoints", self._checkpoints().latest_step)
        if not ok:
            return False, None
        return True, RestorePlan(RestoreKind.CHECKPOINT, step=latest) if latest is not None \
            else RestorePlan(RestoreKind.FRESH)

    def form(self, st: Starting, views: dict[int, WorkerView]) -> tuple[Running, WorkerLostError | None] | None:
        """Fence the storage for the next generation and start it on `st.members`. None: storage
        said "not now". Else the Running state, and the error if not every member was handed
        its plan (the controller recovers at once)."""
        ok, _ = self._storage("write the generation fence",
                              lambda: self._checkpoints().fence(self.generation + 1, start_step=st.restore.step))
        if not ok:
            return None
        self.generation += 1
        world, failure = len(st.members), self._failure()
        start_error = None
        try:
            addr, port = self.group.rendezvous_address(st.members[0])
            places = placement([views[wid].info for wid in st.members])
            self.group.start_generation({wid: GenerationPlan(
                generation=self.generation, rank=rank, world_size=world, master_addr=addr, master_port=port,
                restore=st.restore, timeout_s=failure.collective_timeout_s, **places[rank])
                for rank, wid in enumerate(st.members)})
        except WorkerLostError as error:
            log.warning("generation %d could not start: %s", self.generation, error)
            start_error = error
        if self.recoveries.open is not None:
            self.recoveries.open.to_world, self.recoveries.open.restored_step = world, st.restore.step
        self.recorder.on_generation_start(st.restore.step, world)
        self.intake.restore(self.generation, st.restore.step)
        self.stragglers.reset(world)
        self.running.begin()
        return Running(self.generation, st.members, started_at=self._clock()), start_error

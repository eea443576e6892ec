"""A recovery's course, from the fault or resize that opens it to the re-formed group's plan.

`RecoveryCourse` carries out what a recovery entails besides the changes of state, which it
returns to the controller (the single writer of transitions, as forming.GenerationFormer returns
the Running state): it asks the members to leave the broken group (cutting it when a member was
lost), opens the recovery in the RecoveryLedger, follows the survivors out through the recovery's
judge (recovering.RecoveryWatch: it kills, through the controller, those lost or stuck), charges
the loop's own errors they bring out (triage), and once they have settled re-forms: whom with
(reforming.judge_reform), and from what (forming.GenerationFormer.reform_plan).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from elastic._controller.collaborators import WorkerGroup
from elastic._controller.failure_budget import FailureBudget
from elastic._controller.forming import GenerationFormer
from elastic._controller.ledgers import RecoveryLedger
from elastic._controller.recovering import RecoveryWatch
from elastic._controller.reforming import TooFew, judge_reform
from elastic._controller.running import AllFinished, Fault, Resize
from elastic._controller.slot_table import WorkerView
from elastic._controller.slots import Slots
from elastic._controller.states import Failed, Recovering, Running, Starting
from elastic._controller.triage import Recover, charge_reported
from elastic._protocol import WorkerReport
from elastic.config import FailureConfig, ScalingConfig
from elastic.policies import Cause


class Transition(NamedTuple):
    """The state the controller moves to, and why."""

    state: Recovering | Starting | Failed
    reason: str


class RecoveryCourse:
    """Opens, follows and re-forms one recovery at a time. `kill` is the controller's (a killed
    worker is seen dead in the tick's views), `place` its placement of the slots the run keeps."""

    def __init__(self, group: WorkerGroup, recoveries: RecoveryLedger, former: GenerationFormer, slots: Slots,
                 budget: FailureBudget, *, scaling: ScalingConfig, failure: FailureConfig, total_steps: int,
                 clock: Callable[[], float], kill: Callable[[int, str], None], place: Callable[[], None]):
        self._group, self._recoveries, self._former, self._slots, self._budget = (
            group, recoveries, former, slots, budget)
        self._scaling, self._failure, self._total_steps, self._clock = scaling, failure, total_steps, clock
        self._kill, self._place = kill, place
        self.watch = RecoveryWatch(clock)

    def deadline(self) -> float:
        """When members still in the loop are given up on (a recovery's, or a stop's)."""
        return self._clock() + self._failure.collective_timeout_s + self._failure.heartbeat_timeout_s

    def open_after_fault(self, fault: Fault, members: list[int], generation: int, recover: Recover) -> Transition:
        """Recover from `fault` (triage's `recover`); its lost members are killed already."""
        failure = fault.failure
        # A lost member may never close its connections (its node is gone or cut off): the
        # survivors cut theirs, so none waits out the collective timeout on it.
        self._group.request_stop(recover.survivors, generation, cut_group=bool(fault.lost))
        self._recoveries.begin(failure.cause, len(members), recover.reached, fault.detect_s, list(failure.ranks),
                               why=failure.message, step=failure.step)
        self._place()
        self.watch.begin()
        before = (failure.step if failure.since is None else failure.since) if failure.cause == Cause.SDC else None
        return Transition(Recovering(generation, recover.survivors, self.deadline(), restore_before=before),
                          recover.reason)

    def open_resize(self, st: Running, resize: Resize, step: int) -> Transition:
        """Every member leaves the loop at the next step boundary; re-form at the new size."""
        self._group.request_stop(st.members, st.generation)
        self._recoveries.begin(resize.cause, len(st.members), step)
        self.watch.begin()
        return Transition(Recovering(st.generation, list(st.members), self.deadline(), voluntary=True,
                                     evict=resize.evict, target_world=resize.target_world), resize.reason)

    def follow(self, st: Recovering, views: dict[int, WorkerView], *, step: int,
               step_s: float) -> Transition | AllFinished | None:
        """One tick of the recovery `st`: the run's end (failed on the loop's error, or finished
        after all), the re-formed group to start, or None (wait)."""
        tick = self.watch.assess(st, views, heartbeat_timeout_s=self._failure.heartbeat_timeout_s,
                                 step_s=step_s, total_steps=self._total_steps)
        for wid, reason in tick.kills:
            self._kill(wid, reason)
        for cause, ranks in tick.noted:
            self._recoveries.note(cause, ranks)
        if tick.cold:
            self._recoveries.escalate_cold()
        if tick.errored and (failed := charge_reported(tick.errored, step, self._budget)) is not None:
            return Transition(failed, failed.reason)
        if tick.finished is not None:
            return AllFinished(tick.finished)
        if tick.settled is not None:
            return self._reform(st, tick.settled, views)
        return None

    def _reform(self, st: Recovering, settled: dict[int, WorkerReport],
                views: dict[int, WorkerView]) -> Transition | None:
        """Re-form with the survivors out of the broken group (`settled`, with their reports) and
        the ready spares: warm from the survivor furthest ahead that holds its state, else from the
        newest checkpoint."""
        verdict = judge_reform(st, settled, self._slots.ready(views), functools.partial(self._slots.cap, views=views),
                               self._recoveries.current,
                               now=self._clock(), scaling=self._scaling, failure=self._failure)
        if isinstance(verdict, TooFew):
            self._place()
            return None if verdict.error is None else Transition(Failed.of(verdict.error), str(verdict.error))
        for w in settled:
            self._recoveries.reached(settled[w].step)
        ok, plan = self._former.reform_plan(verdict.members, settled, before=st.restore_before)
        if not ok or plan is None:
            return None
        self._recoveries.planned(plan.kind, plan.reason)
        return Transition(Starting(verdict.members, plan), verdict.reason)

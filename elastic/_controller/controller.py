"""The controller: an explicit state machine that watches the workers and alone acts.

Each `tick()` refreshes the worker group's view, then runs the handler of the current state.
The handlers ask the part that judges their state (scheduling.StartGate, running.RunningWatch,
stopping.assess_stop) what the views say, the policies decide (through the failure budget and
the scaling policy: triage), and this class acts on it: it kills, stops, re-forms and resumes.
A recovery's own steps (asking the members to leave, its ledger, following the survivors with
recovering.RecoveryWatch, the re-form: reforming.judge_reform) are recovery_course's, which
returns each change of state to this class, as forming.GenerationFormer does. Every change of
state goes through `_transition`, which logs it, notifies callbacks and rewrites status.json.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic._controller.adoption import Adoption, AdoptionKind
from elastic._controller.bad_nodes import BadNodes
from elastic._controller.collaborators import CheckpointView, LeaseHold, WorkerGroup
from elastic._controller.commit_watch import CommitWatch
from elastic._controller.failure_budget import FailureBudget
from elastic._controller.forming import GenerationFormer
from elastic._controller.intake import ReportIntake
from elastic._controller.journal import Journal, JournalEntry
from elastic._controller.ledgers import RecoveryLedger, StepLedger
from elastic._controller.recovery_course import RecoveryCourse
from elastic._controller.running import AllFinished, Fault, RunningWatch
from elastic._controller.scheduling import Gate, StartGate, too_few_to_start
from elastic._controller.slot_table import DEAD, WorkerView
from elastic._controller.slots import Slots
from elastic._controller.states import (
    AnyState,
    Failed,
    Finished,
    Recovering,
    Running,
    RunState,
    Scheduling,
    Starting,
    Stopping,
)
from elastic._controller.status import StatusReport
from elastic._controller.stopping import assess_stop, stopping_for
from elastic._controller.storage_retry import StorageRetry
from elastic._controller.stragglers import StragglerDetector
from elastic._controller.triage import triage
from elastic._controller.worker_group import SLOW_TICK_S
from elastic._protocol import RestorePlan, WorkerReport
from elastic.config import FailureConfig, ScalingConfig
from elastic.policies import Cause, Failure, FailurePolicy, ScalingPolicy

MIN_TICK_GAP_S = 0.01     # the least time between two ticks (see run_loop)

if TYPE_CHECKING:
    from elastic._controller.run_record import RunRecord

__all__ = ["CheckpointView", "Controller", "WorkerGroup", "run_loop"]

log = logging.getLogger("elastic.controller")


class Controller:
    """The run's state machine. Composed of: the worker group (acts on workers), the report
    intake (worker reports into the step and recovery ledgers and the run record), the status
    report (status.json), the failure budget and the policies (decisions), and one judge per
    state; it alone acts. What it needs from storage while the run goes comes as plain values
    read on other threads: the run's lease (`lease`: lost or not), the newest commits
    (`commits`), a STOP request (`checkpoints.stop_request()`)."""

    def __init__(self, group: WorkerGroup, recorder: RunRecord, checkpoints: CheckpointView, *,
                 scaling: ScalingConfig, failure: FailureConfig, total_steps: int,
                 failure_policy: FailurePolicy | None = None, scaling_policy: ScalingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 callbacks: tuple[Callable[[RunState, RunState, str], None], ...] = (),
                 commits: CommitWatch | None = None, lease: LeaseHold | None = None,
                 journal: Journal | None = None, resumed: JournalEntry | None = None):
        """`journal`: where this controller keeps its account of the run for a replacement;
        `resumed`: the account of a lost controller this one replaces (its journal's newest
        entry): its ledgers, budget and record go on here, and `take_over` adopts its workers."""
        self.group, self.recorder, self.checkpoints = group, recorder, checkpoints
        self.lease = lease
        self.scaling, self.failure, self.total_steps = scaling, failure, total_steps
        self.scaling_policy = scaling_policy or ScalingPolicy()
        self.clock, self.wall_clock = clock, wall_clock
        self.callbacks = callbacks
        self.journal = journal
        self.state: AnyState = Scheduling(since=clock())
        self.model_sha256: str | None = resumed.model_sha256 if resumed else None
        self.views: dict[int, WorkerView] = {}
        self.history: list[tuple[str, str, str]] = resumed.history if resumed else []
        self.budget = resumed.budget if resumed else FailureBudget(failure_policy or FailurePolicy(), failure, clock)
        if resumed is not None and failure_policy is not None:
            self.budget.policy = failure_policy
        self.storage = StorageRetry(self.budget, clock, failure.rendezvous_timeout_s)
        self.stragglers = StragglerDetector(window=failure.straggler_window,
                                            threshold=failure.straggler_threshold or float("inf"),
                                            min_excess_s=failure.straggler_min_excess_s)
        self.steps = resumed.steps if resumed else StepLedger()
        self.start_gate, self.running = StartGate(scaling, failure.rendezvous_timeout_s), RunningWatch(clock)
        self.recoveries = resumed.recoveries if resumed else RecoveryLedger(clock, wall_clock)
        self.intake = ReportIntake(recorder, self.steps, self.recoveries, self.stragglers, failure)
        # The actor's commit watch looks on a thread of its own; without one, looks are inline (fakes).
        self.status = StatusReport(recorder, commits or CommitWatch(checkpoints, clock, background=False),
                                   tp=scaling.tensor_parallel_size, pp=scaling.pipeline_parallel_size)
        self.slots = Slots(scaling)
        self.bad_nodes = resumed.bad_nodes if resumed else BadNodes()
        self.former = GenerationFormer(group, checkpoints, self._storage, failure=failure, clock=clock,
                                       unit=scaling.unit_size, replica=scaling.replica_size)
        self.recovery = RecoveryCourse(group, self.recoveries, self.former, self.slots, self.budget, scaling=scaling,
                                       failure=failure, total_steps=total_steps, clock=clock, kill=self._kill,
                                       place=self._place_slots)
        if resumed is not None:
            recorder.restore_journal(resumed.record)
            self.intake.continue_from(resumed.intake)
            self.former.generation = resumed.generation
            self.status.last_committed, self.status.world_size = resumed.last_committed, resumed.world_size
            if self.bad_nodes.bad:
                group.avoid_nodes(self.bad_nodes.bad)

    @property
    def done(self) -> bool:
        return self.state.state in (RunState.FINISHED, RunState.FAILED, RunState.STOPPED)

    @property
    def step(self) -> int:
        """The newest step the run keeps (or the step a new generation restores)."""
        return self.intake.step

    @property
    def world_size(self) -> int:
        """Of the newest generation that ran."""
        return self.status.world_size

    @property
    def generation(self) -> int:
        """The newest generation started (-1 before the first)."""
        return self.former.generation

    @property
    def failures(self) -> list[Failure]:
        return self.budget.failures

    @property
    def infra_failures(self) -> int:
        return self.budget.infra_failures

    @property
    def error(self) -> dict[str, Any] | None:
        """What the run failed of (the Failed state's), or None."""
        return self.state.error if isinstance(self.state, Failed) else None

    def crashed(self, error: BaseException) -> None:
        """The controller itself raised (a bug): the run ends failed with that error. (Set, not a
        transition: the status writer and callbacks may be what raised.)"""
        self.state = Failed.of(error)

    def flush_logs(self) -> None:
        self.intake.flush_logs()

    # ---- the tick ----------------------------------------------------------------------
    def tick(self) -> None:
        if self.lease is not None and (lost := self.lease.lost()) is not None:
            # Another run took the storage over: this run must not write there again. It ends here
            # (its workers are killed). A lease that is only unconfirmed (storage stalled) does not
            # end the run: its record is not written meanwhile (RunRecorder's holds_storage).
            self._fail(lost)
            return
        self.views = self.group.tick(self.running.poll_terms(self.state.state, self.failure))
        self.intake.absorb(self.views, self.state, self._current_members(), self.generation)
        for wid in self.slots.preempted_spares(self.views, self._current_members()):
            self._kill(wid, "preempted while spare")
        handler = {RunState.SCHEDULING: self._on_scheduling, RunState.STARTING: self._on_starting,
                   RunState.RUNNING: self._on_running, RunState.RECOVERING: self._on_recovering,
                   RunState.STOPPING: self._on_stopping}.get(self.state.state)
        if handler is not None:
            handler()
        self._write_status(force=False)

    def _transition(self, new: AnyState, reason: str) -> None:
        old = self.state.state
        self.state = new
        self.history.append((old.value, new.state.value, reason))
        log.info("controller: %s -> %s (%s)", old.value, new.state.value, reason)
        for callback in self.callbacks:
            callback(old, new.state, reason)
        self._write_status(force=True)

    # ---- states ------------------------------------------------------------------------
    def _on_scheduling(self) -> None:
        assert isinstance(self.state, Scheduling)
        self._place_slots()
        ready = self.slots.ready(self.views)
        now = self.clock()
        gate = self.start_gate.judge(ready=len(ready), pending=self.slots.pending(self.views),
                                     starting=self.slots.starting(self.views), waited_s=now - self.state.since, now=now)
        if gate == Gate.START:
            ok, plan = self._storage("read the checkpoints to resume from", self._resume_plan)
            if ok and plan is not None:
                self._transition(Starting(self.slots.cap(ready, views=self.views), plan), f"{len(ready)} workers ready")
                self._on_starting()
        elif gate == Gate.TOO_FEW:
            self._fail(too_few_to_start(len(ready), self.scaling, self.failure))

    def _resume_plan(self) -> RestorePlan:
        """The first generation's restore, and what the run keeps of the previous run: its
        generations (the intake's first), its steps and metrics lines up to the checkpoint."""
        plan = self.former.resume_plan()
        self.intake.resumed(plan, first_generation=self.generation + 1)
        return plan

    def _on_starting(self) -> None:
        st = self.state
        assert isinstance(st, Starting)
        formed = self.former.form(st, self.views)
        if formed is None:
            return
        running, started, start_fault = formed
        self.intake.generation_started(started)      # every ledger that counts per generation starts over
        self.running.begin()
        self._transition(running, f"generation {self.generation}: world size {len(st.members)}, "
                                  f"restore {st.restore.kind}")
        if start_fault is not None:
            # Not every member was handed the generation (e.g. rank 0's rendezvous lookup timed
            # out, or a member refused or did not answer its plan): recover now rather than wait in
            # RUNNING for a generation that never starts. The members that took their plan are
            # joining it; the cut (a fault with lost members) releases them from its rendezvous.
            self._recover_from(start_fault, st.members)

    def _on_running(self) -> None:
        st = self.state
        assert isinstance(st, Running)
        verdict = self.running.assess(st, self.views, self.failure, self.steps.step_s)
        if isinstance(verdict, Fault):
            self._recover_from(verdict, st.members)
            if self.state.state == RunState.RECOVERING:
                # The survivors have often left the broken group already (a peer's death breaks
                # their collective before Ray reports it): re-form in this tick, not the next.
                self._on_recovering()
        elif isinstance(verdict, AllFinished):
            self._record_final(verdict.report)
            self._transition(Finished(list(st.members)), f"all {len(st.members)} ranks finished at step {self.step}")
        elif (request := self.checkpoints.stop_request()) is not None:
            # `elastic stop`: the preemption notice's path, for every member at once.
            self.group.request_preemption(st.members)
            self._transition(*stopping_for(st, request, self.recovery.deadline()))
        else:
            self._place_slots()
            if self.recoveries.open is None:
                resize = self.running.resize(st, spares=self.slots.spares(self.views, st.members),
                                             stragglers=self.stragglers, policy=self.scaling_policy,
                                             scaling=self.scaling, window=self.failure.straggler_window)
                if resize is not None:     # every member leaves the loop at the next step boundary
                    self._transition(*self.recovery.open_resize(st, resize, self.step))

    def _recover_from(self, fault: Fault, members: list[int]) -> None:
        """Charge the failure (triage); fail the run, or kill what is lost and recover with the rest."""
        verdict = triage(fault, members, self.views, self.step, self.budget)
        if fault.failure.cause == Cause.SDC:
            # Its ranks' nodes are flagged: one flagged twice gets no new worker of this run.
            marked = [self.bad_nodes.flag(info.node_id, fault.failure.message) for wid in fault.lost
                      if (info := self.views[wid].info) is not None and info.node_id]
            if any(marked):
                self.group.avoid_nodes(self.bad_nodes.bad)
        for wid in fault.lost:
            self._kill(wid, fault.failure.cause)
        if isinstance(verdict, Failed):
            self._transition(verdict, verdict.reason)
        else:
            self._transition(*self.recovery.open_after_fault(fault, members, self.generation, verdict))

    def _on_recovering(self) -> None:
        """The recovery's course says what its survivors' views show: wait, end, or re-form."""
        st = self.state
        assert isinstance(st, Recovering)
        course = self.recovery.follow(st, self.views, step=self.step, step_s=self.steps.step_s)
        if isinstance(course, AllFinished):
            self._record_final(course.report)
            self._transition(Finished(list(st.survivors)), "finished while recovering")
        elif course is not None:
            self._transition(*course)
            if isinstance(course.state, Starting):
                self._on_starting()

    def _on_stopping(self) -> None:
        """Every member commits at its next step boundary and leaves the loop; then the run ends
        (stopping.assess_stop says when, and how)."""
        st = self.state
        assert isinstance(st, Stopping)
        end = assess_stop(st, self.views, now=self.clock(), step=self.step)
        if end is None:
            return
        for wid in end.late:
            self._kill(wid, "still training at the stop's deadline")
        self._transition(end.state, end.reason)

    # ---- helpers -----------------------------------------------------------------------
    def _place_slots(self) -> None:
        """Start placements for the slots the run keeps (Slots.target: while a recovery is open,
        only the lost members' replacements, so that no spare's start competes with the re-form)."""
        recovery = self.recoveries.open
        self.group.scale_to(self.slots.target(self.views, broken_world=recovery.from_world if recovery else None))

    def _kill(self, wid: int, reason: str) -> None:
        """Kill a worker, and see it dead in this tick's views: a recovery may re-form in the
        tick that killed it, and must not take it for a ready spare."""
        self.group.kill(wid, reason)
        view = self.views.get(wid)
        if view is not None:
            self.views[wid] = dataclasses.replace(view, status=DEAD, death=reason)

    def _storage(self, what: str, call: Callable[[], Any]) -> tuple[bool, Any]:
        """A storage call of the control loop (storage_retry): (False, None) means "not now";
        an error that outlasts the retries fails the run."""
        result = self.storage.call(what, call)
        if result.fatal is not None:
            self._fail(result.fatal, result.failure)
        return result.ok, result.value

    def _record_final(self, report: WorkerReport) -> None:
        """The finished state as rank 0 holds it: model hash and data consumed (intake.finished)."""
        self.intake.finished(report, self.generation)
        self.model_sha256 = report.model_sha256 or self.model_sha256

    def _write_status(self, force: bool) -> None:
        self.status.write(force=force, state=self.state.state, generation=self.generation, step=self.step,
                          members=self._current_members(), views=self.views, bad_nodes=self.bad_nodes.bad)
        if self.journal is not None and not self.done and self.journal.due(force):
            self.journal.write(self.journal_entry())

    # ---- a replacement's -----------------------------------------------------------------
    def journal_entry(self) -> JournalEntry:
        """This controller's account of the run now (see elastic._controller.journal)."""
        return JournalEntry(
            written_at=self.wall_clock(), state=self.state, generation=self.generation,
            intake=self.intake.position(), next_wid=self.group.next_wid, record=self.recorder.journal_state(),
            steps=self.steps, recoveries=self.recoveries, budget=self.budget, bad_nodes=self.bad_nodes,
            history=self.history, model_sha256=self.model_sha256, last_committed=self.status.last_committed,
            world_size=self.status.world_size)

    def take_over(self, adoption: Adoption, entry: JournalEntry | None) -> None:
        """Go on from the lost controller's state (its journal's `entry`) with the workers adopted
        (adoption.judge): its generation keeps running, or, caught in the middle of a change, the
        run restarts its workers from storage (see adoption)."""
        was = entry.state.state.value if entry is not None else RunState.SCHEDULING.value
        for wid in adoption.lost:
            self.group.bury(wid, "lost while no controller was there")
        for wid in adoption.replaced:
            self.group.kill(wid, f"found by a replacing controller while {was}: replaced")
        if adoption.kind == AdoptionKind.RUNNING and entry is not None and isinstance(entry.state, Running):
            self.state = entry.state
            self.running.begin()
            self.stragglers.reset(len(entry.state.members))
        else:
            self.state = Scheduling(since=self.clock())
        self.history.append((was, self.state.state.value, adoption.reason))
        log.info("controller: took over in state %s (%s)", self.state.state.value, adoption.reason)
        self._write_status(force=True)

    def _current_members(self) -> list[int]:
        """Workers of the newest generation: its members, or its survivors while recovering."""
        return getattr(self.state, "members", None) or getattr(self.state, "survivors", None) or []

    def _fail(self, error: Exception, failure: Failure | None = None) -> None:
        self._transition(Failed.of(error, failure), str(error))


def run_loop(controller: Controller, sleep: Callable[[float], None] = time.sleep) -> None:
    """Tick `controller` until the run ends; then shut its workers down (gracefully when the
    run finished or stopped).

    The next tick comes as soon as a worker may have news (WorkerGroup.wait: a death, a failed
    collective, a phase change, a replacement up), else FailureConfig.heartbeat_interval_s after
    this one: a fixed interval alone added half of it on average to the detection of every
    failure, and as much again to every step of a recovery that waits on the workers. Between
    two ticks lies at least twice the last tick's duration (and MIN_TICK_GAP_S), so that however
    many answers arrive, ticking takes at most a third of the controller's time (a tick is
    milliseconds at a few ranks, ~0.1 s at 10,000: there the interval rules, as before)."""
    try:
        while not controller.done:
            started = time.monotonic()
            controller.tick()
            took = time.monotonic() - started
            if took > SLOW_TICK_S:
                # Detection waits for the tick: say so when one took seconds (Ray calls can block it).
                log.warning("controller tick took %.1fs in state %s: failures were not detected meanwhile",
                            took, controller.state.state.value)
            if not controller.done:
                interval = controller.failure.heartbeat_interval_s
                gap = min(interval, max(MIN_TICK_GAP_S, 2 * took))
                sleep(gap)
                controller.group.wait(interval - gap)
    finally:
        controller.group.shutdown(graceful=controller.state.state in (RunState.FINISHED, RunState.STOPPED))

"""The controller: an explicit state machine that watches the workers and alone acts.

Each `tick()` refreshes the worker group's view, then runs the handler of the current state.
The handlers ask the part that judges their state (scheduling.StartGate, running.RunningWatch,
recovering.RecoveryWatch) what the views say, the policies decide (through the failure budget
and the scaling policy), and only this class acts on it: it kills, stops, re-forms and resumes.
Every change of state goes through `_transition`, which logs it, notifies callbacks and
rewrites status.json.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic._controller.collaborators import CheckpointView, LeaseHold, WorkerGroup
from elastic._controller.commit_watch import CommitWatch
from elastic._controller.failure_budget import FailureBudget
from elastic._controller.forming import GenerationFormer, GenerationStarted
from elastic._controller.intake import ReportIntake
from elastic._controller.ledgers import RecoveryLedger, StepLedger
from elastic._controller.recovering import RecoveryWatch, plan_members, too_few_to_reform
from elastic._controller.running import AllFinished, Fault, Resize, RunningWatch, reported_failure, still_in_loop
from elastic._controller.scheduling import Gate, StartGate, too_few_to_start
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
    Stopped,
    Stopping,
)
from elastic._controller.status import StatusReport
from elastic._controller.storage_retry import StorageRetry
from elastic._controller.stragglers import StragglerDetector
from elastic._controller.worker_group import DEAD, READY, SLOW_TICK_S, WorkerView
from elastic._protocol import RestoreKind, RestorePlan, WorkerPhase, WorkerReport
from elastic.config import FailureConfig, ScalingConfig
from elastic.policies import Failure, FailurePolicy, ScalingPolicy

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
                 commits: CommitWatch | None = None, lease: LeaseHold | None = None):
        self.group, self.recorder, self.checkpoints = group, recorder, checkpoints
        self.lease = lease
        self.scaling, self.failure, self.total_steps = scaling, failure, total_steps
        self.scaling_policy = scaling_policy or ScalingPolicy()
        self.clock, self.wall_clock = clock, wall_clock
        self.callbacks = callbacks
        self.state: AnyState = Scheduling(since=clock())
        self.model_sha256: str | None = None
        self.views: dict[int, WorkerView] = {}
        self.history: list[tuple[str, str, str]] = []
        self.budget = FailureBudget(failure_policy or FailurePolicy(), failure, clock)
        self.storage = StorageRetry(self.budget, clock, failure.rendezvous_timeout_s)
        self.stragglers = StragglerDetector(window=failure.straggler_window,
                                            threshold=failure.straggler_threshold or float("inf"),
                                            min_excess_s=failure.straggler_min_excess_s)
        self.steps = StepLedger()
        self.start_gate, self.running, self.recovering = StartGate(), RunningWatch(clock), RecoveryWatch(clock)
        self.recoveries = RecoveryLedger(clock, wall_clock)
        self.intake = ReportIntake(recorder, self.steps, self.recoveries, self.stragglers, failure)
        # The actor's commit watch looks on a thread of its own; without one, looks are inline (fakes).
        self.status = StatusReport(recorder, commits or CommitWatch(checkpoints, clock, background=False),
                                   tp=scaling.tensor_parallel_size)
        self.slots = Slots(scaling)
        self.former = GenerationFormer(group, checkpoints, self._storage, failure=failure, clock=clock,
                                       tp=scaling.tensor_parallel_size)

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
        gate = self.start_gate.judge(
            ready=len(ready), pending=sum(1 for v in self.views.values() if v.status not in (READY, DEAD)),
            waited_s=now - self.state.since, now=now, scaling=self.scaling,
            rendezvous_timeout_s=self.failure.rendezvous_timeout_s)
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
        self.intake.resume(first_generation=self.generation + 1, step=plan.step)
        if plan.kind == RestoreKind.CHECKPOINT:
            self.recorder.resumed(plan.step)
        return plan

    def _on_starting(self) -> None:
        st = self.state
        assert isinstance(st, Starting)
        formed = self.former.form(st, self.views)
        if formed is None:
            return
        running, started, start_fault = formed
        self._generation_started(started)
        self._transition(running, f"generation {self.generation}: world size {len(st.members)}, "
                                  f"restore {st.restore.kind}")
        if start_fault is not None:
            # Not every member was handed the generation (e.g. rank 0's rendezvous lookup timed
            # out, or a member refused or did not answer its plan): recover now rather than wait in
            # RUNNING for a generation that never starts. The members that took their plan are
            # joining it; the cut (a fault with lost members) releases them from its rendezvous.
            self._recover_from(start_fault, st.members)

    def _generation_started(self, started: GenerationStarted) -> None:
        """Every part that counts per generation starts over from the new one, here and only here."""
        self.recoveries.formed(started.world_size, started.step)
        self.recorder.on_generation_start(started.step, started.world_size)
        self.intake.restore(started.generation, started.step)
        self.stragglers.reset(started.world_size)
        self.running.begin()

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
            reason = str(request.get("reason") or "elastic stop")
            self._transition(Stopping(st.generation, list(st.members), self._recovery_deadline(), reason),
                             f"stop requested: {reason}")
        else:
            self._place_slots()
            if self.recoveries.open is None:
                members = set(st.members)
                spares = [w for w in self.slots.ready(self.views) if w not in members]
                resize = self.running.resize(st, spares=spares, stragglers=self.stragglers, policy=self.scaling_policy,
                                             scaling=self.scaling, window=self.failure.straggler_window)
                if resize is not None:
                    self._resize(st, resize)

    def _resize(self, st: Running, resize: Resize) -> None:
        """Every member leaves the loop at the next step boundary; re-form at the new size."""
        self.group.request_stop(st.members, st.generation)
        self.recoveries.begin(resize.cause, len(st.members), self.step)
        self._begin_recovery(Recovering(st.generation, list(st.members), self._recovery_deadline(), voluntary=True,
                                        evict=resize.evict, target_world=resize.target_world), resize.reason)

    def _recover_from(self, fault: Fault, members: list[int]) -> None:
        """Charge the failure; fail the run, or kill what is lost and recover with the rest."""
        failure = fault.failure
        reached = max([self.step] + [report.step for w in members if (report := self.views[w].report) is not None])
        decision = self.budget.charge(failure, reached)
        for wid in fault.lost:
            self._kill(wid, failure.cause)
        if decision.action == "fail":
            if fault.report is not None and not failure.is_infrastructure:
                self._transition(Failed.of_report(decision.reason, failure, fault.report), decision.reason)
            else:
                self._fail(self.budget.exhausted(decision, failure), failure)
            return
        lost = set(fault.lost)
        survivors = [w for w in members if w not in lost]
        # A lost member may never close its connections (its node is gone or cut off): the
        # survivors cut theirs, so none waits out the collective timeout on it.
        self.group.request_stop(survivors, self.generation, cut_group=bool(fault.lost))
        self.recoveries.begin(failure.cause, len(members), reached, fault.detect_s, list(failure.ranks),
                              why=failure.message)
        self._place_slots()
        self._begin_recovery(Recovering(self.generation, survivors, self._recovery_deadline()),
                             f"{failure.cause} on ranks {list(failure.ranks)}; {decision.reason}")

    def _begin_recovery(self, state: Recovering, reason: str) -> None:
        self.recovering.begin()
        self._transition(state, reason)

    def _recovery_deadline(self) -> float:
        return self.clock() + self.failure.collective_timeout_s + self.failure.heartbeat_timeout_s

    def _on_recovering(self) -> None:
        st = self.state
        assert isinstance(st, Recovering)
        tick = self.recovering.assess(st, self.views, heartbeat_timeout_s=self.failure.heartbeat_timeout_s,
                                      step_s=self.steps.step_s, total_steps=self.total_steps)
        for wid, reason in tick.kills:
            self._kill(wid, reason)
        for cause, ranks in tick.noted:
            self.recoveries.note(cause, ranks)
        if tick.cold:
            self.recoveries.escalate_cold()
        if tick.errored:
            failure = reported_failure(tick.errored)
            decision = self.budget.charge(failure, self.step)
            if decision.action == "fail":
                self._transition(Failed.of_report(decision.reason, failure, next(iter(tick.errored.values()))),
                                 decision.reason)
                return
        if tick.finished is not None:
            self._record_final(tick.finished)
            self._transition(Finished(list(st.survivors)), "finished while recovering")
        elif tick.settled is not None:
            self._reform(st, tick.settled)

    def _on_stopping(self) -> None:
        """Every member commits at its next step boundary and leaves the loop; then the run ends.
        A member still in the loop at the deadline is killed (the commit it was part of is lost;
        the run resumes from the one before)."""
        st = self.state
        assert isinstance(st, Stopping)
        in_loop = still_in_loop(st.generation, st.members, self.views)
        if in_loop and self.clock() < st.deadline:
            return
        for wid in in_loop:
            self._kill(wid, "still training at the stop's deadline")
        # A member that left with an error (its stop commit failed: check_committed raised) did
        # not commit the step the run stops at: the run fails with that error, never "stopped".
        errored = {rank: report for rank, wid in enumerate(st.members)
                   if (report := self.views[wid].report) is not None and report.generation == st.generation
                   and report.phase == WorkerPhase.FAILED}
        if errored:
            failure = reported_failure(errored)
            reason = f"the stop at step {self.step} did not commit: {failure.message}"
            self._transition(Failed.of_report(reason, failure, next(iter(errored.values()))), reason)
            return
        self._transition(Stopped(list(st.members), st.reason), f"stopped at step {self.step}: {st.reason}")

    def _reform(self, st: Recovering, settled: dict[int, WorkerReport]) -> None:
        """Re-form with the survivors out of the broken group (`settled`, with their reports) and
        the ready spares: warm from the survivor furthest ahead that holds its state, else from the
        newest checkpoint."""
        members, survivors = plan_members(st, settled, self.slots.ready(self.views),
                                          functools.partial(self.slots.cap, views=self.views))
        recovery = self.recoveries.current
        if len(members) < self.scaling.min_workers:
            self._place_slots()
            if self.clock() - recovery.detected_at > self.failure.rendezvous_timeout_s:
                self._fail(too_few_to_reform(len(members), recovery.cause, self.scaling, self.failure))
            return
        for w in settled:
            self.recoveries.reached(settled[w].step)
        ok, plan = self.former.reform_plan(members, settled)
        if not ok or plan is None:
            return
        self.recoveries.planned(plan.kind, plan.reason)
        self._transition(Starting(members, plan),
                         f"re-forming with {len(survivors)} survivor(s) and {len(members) - len(survivors)} new")
        self._on_starting()

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
        """The finished state as rank 0 holds it: model hash and data consumed. A recovery still
        open (the re-formed group finished without another step) is recorded too."""
        self.intake.close_recovery(self.generation)
        self.model_sha256 = report.model_sha256 or self.model_sha256
        self.recorder.on_final_data(report.samples_seen, report.data_order)

    def _write_status(self, force: bool) -> None:
        self.status.write(force=force, state=self.state.state, generation=self.generation, step=self.step,
                          members=self._current_members(), views=self.views)

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

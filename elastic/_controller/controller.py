"""The controller: an explicit state machine that watches the workers and alone acts.

Each `tick()` refreshes the worker group's view, then runs the handler of the current state.
Workers report; policies decide; only this class kills, re-forms and resumes. Every change of
state goes through `_transition`, which logs it, notifies callbacks and rewrites status.json.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from elastic._controller.intake import ReportIntake
from elastic._controller.ledgers import OpenRecovery, RecoveryLedger, Rung, StepLedger
from elastic._controller.recurrence import ErrorSighting, RecurringErrors
from elastic._controller.states import AnyState, Failed, Finished, Recovering, Running, RunState, Scheduling, Starting
from elastic._controller.status import StatusReport
from elastic._controller.stragglers import StragglerDetector
from elastic._controller.worker_group import DEAD, READY, SLOW_TICK_S, STARTING, WorkerView
from elastic._protocol import GenerationPlan, RestoreKind, RestorePlan, WorkerPhase, WorkerReport, placement
from elastic.config import FailureConfig, ScalingConfig
from elastic.errors import InsufficientWorkersError, TooManyFailuresError, WorkerLostError
from elastic.policies import CAUSE_OF_ERROR_KIND, Cause, Failure, FailurePolicy, ScalingPolicy

if TYPE_CHECKING:
    from elastic._controller.run_record import RunRecord

log = logging.getLogger("elastic.controller")

PROBE_GRACE_S = 2.0      # no maximum: start once the ready count held this long (the cluster is full)
STUCK_GRACE_S = 2.0      # floor of how long a survivor may lag the first one out of a broken group


# The controller's view of its collaborators. Each is met by the real class and by the unit
# tests' fake; tests/unit/protocol_checks.py has the type checker (`make lint`) hold both to it.

class WorkerGroup(Protocol):
    """The workers (RayWorkerGroup; fakes.FakeGroup)."""

    poll_hold_s: float            # a worker may hold its answer this long when nothing happens
    def scale_to(self, n: int) -> None: ...
    def tick(self) -> dict[int, WorkerView]: ...
    def rendezvous_address(self, wid: int) -> tuple[str, int]: ...
    def start_generation(self, plans: dict[int, GenerationPlan]) -> None: ...
    def request_stop(self, wids: list[int], generation: int, cut_group: bool = False) -> None: ...
    def kill(self, wid: int, reason: str) -> None: ...
    def shutdown(self, graceful: bool = True) -> None: ...


class CheckpointView(Protocol):
    """The committed checkpoints and the fence (actor.CheckpointView; fakes.FakeCheckpoints)."""

    def latest_step(self) -> int | None: ...
    def committed_steps(self) -> list[int]: ...
    def fence(self, generation: int, start_step: int | None = None) -> None: ...
    def committed_since(self, step: int | None) -> list[int]: ...
    def current_fence(self) -> int | None: ...


class Controller:
    """The run's state machine. Composed of: the worker group (acts on workers), the report
    intake (worker reports into the step and recovery ledgers and the run record), the status
    report (status.json), the policies (decisions); it alone decides and acts."""

    def __init__(self, group: WorkerGroup, recorder: RunRecord, checkpoints: CheckpointView, *,
                 scaling: ScalingConfig, failure: FailureConfig, total_steps: int,
                 failure_policy: FailurePolicy | None = None, scaling_policy: ScalingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 callbacks: tuple[Callable[[RunState, RunState, str], None], ...] = ()):
        self.group, self.recorder, self.checkpoints = group, recorder, checkpoints
        self.scaling, self.failure, self.total_steps = scaling, failure, total_steps
        self.failure_policy = failure_policy or FailurePolicy()
        self.scaling_policy = scaling_policy or ScalingPolicy()
        self.clock, self.wall_clock = clock, wall_clock
        self.callbacks = callbacks
        self.state: AnyState = Scheduling(since=clock())
        self.generation = -1
        self.world_size = 0        # of the newest generation
        self.infra_failures = 0
        self.failures: list[Failure] = []
        self.model_sha256: str | None = None
        self.views: dict[int, WorkerView] = {}
        self.history: list[tuple[str, str, str]] = []
        self.stragglers = StragglerDetector(window=failure.straggler_window,
                                            threshold=failure.straggler_threshold or float("inf"),
                                            min_excess_s=failure.straggler_min_excess_s)
        self.steps = StepLedger()
        # Through the controller's clocks as they are when read (a test may swap them).
        self.recoveries = RecoveryLedger(lambda: self.clock(), lambda: self.wall_clock())
        self.intake = ReportIntake(recorder, self.steps, self.recoveries, self.stragglers, lambda: self.failure)
        self.status = StatusReport(recorder, checkpoints, clock)
        self._crash: dict[str, Any] | None = None   # the controller's own crash (see crashed())
        self._eviction_asked: dict[int, int] = {}   # rank -> step the policy was last asked at
        self._recurring = RecurringErrors(attempts=2)   # broken groups with no lost peer: a fault, or the loop's bug
        self._storage_trouble: dict[str, float] | None = None   # an ongoing storage error: since, attempts, retry_at

    @property
    def done(self) -> bool:
        return self.state.state in (RunState.FINISHED, RunState.FAILED)

    @property
    def step(self) -> int:
        """The newest step the run keeps (or the step a new generation restores)."""
        return self.intake.step

    @step.setter
    def step(self, value: int) -> None:
        self.intake.step = value

    @property
    def error(self) -> dict[str, Any] | None:
        """What the run failed of (the Failed state's), or None."""
        if isinstance(self.state, Failed):
            return self.state.error
        return self._crash

    def crashed(self, error: BaseException) -> None:
        """The controller itself raised (a bug): the run ends failed with that error."""
        self._crash = {"type": type(error).__name__, "message": str(error), "traceback": None,
                       "exception": error, "ranks": []}

    def flush_logs(self) -> None:
        self.intake.flush_logs()

    # ---- loop --------------------------------------------------------------------------
    def run(self, sleep: Callable[[float], None] = time.sleep) -> None:
        try:
            while not self.done:
                started = time.monotonic()
                self.tick()
                took = time.monotonic() - started
                if took > SLOW_TICK_S:
                    # Detection waits for the tick: say so when one took seconds (Ray calls can block it).
                    log.warning("controller tick took %.1fs in state %s: failures were not detected meanwhile",
                                took, self.state.state.value)
                if not self.done:
                    sleep(self.failure.heartbeat_interval_s)
        finally:
            self.group.shutdown(graceful=self.state.state == RunState.FINISHED)

    def tick(self) -> None:
        # While training runs, polls are held (answered at once on news, else once a hold): the
        # 5 Hz polls cost each worker ~2 % of its CPU. Otherwise they are answered at once.
        self.group.poll_hold_s = self.failure.poll_hold_s if self.state.state == RunState.RUNNING else 0.0
        self.views = self.group.tick()
        self.intake.absorb(self.views, self.state, self._current_members(), self.generation)
        members = set(self._current_members())
        for view in self.views.values():
            if view.report is not None and view.report.preempted and view.status == READY and view.wid not in members:
                self.group.kill(view.wid, "preempted while spare")
        handler = {RunState.SCHEDULING: self._on_scheduling, RunState.STARTING: self._on_starting,
                   RunState.RUNNING: self._on_running, RunState.RECOVERING: self._on_recovering}.get(self.state.state)
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
        st = self.state
        assert isinstance(st, Scheduling)
        self.group.scale_to(self._slot_target())
        ready = self._ready_ids()
        pending = [w for w, v in self.views.items() if v.status not in (READY, DEAD)]
        now = self.clock()
        waited = now - st.since
        if len(ready) != st.ready_count:
            st.ready_count, st.ready_since = len(ready), now
        maximum = self.scaling.max_workers
        # With no maximum, the probe placement stays pending once the cluster is full.
        settled = not pending if maximum is not None else (
            len(pending) <= 1 and now - st.ready_since >= PROBE_GRACE_S)
        enough = len(ready) >= self.scaling.min_workers
        if (maximum is not None and len(ready) >= maximum) or (
                enough and (settled or waited >= self.scaling.startup_wait_s)):
            ok, plan = self._storage("read the checkpoints to resume from", self._resume_plan)
            if not ok:
                return
            self._transition(Starting(self._capped(ready), plan), f"{len(ready)} workers ready")
            self._on_starting()
        elif not enough and waited > self.failure.rendezvous_timeout_s:
            self._fail(InsufficientWorkersError(
                f"only {len(ready)} of min_workers={self.scaling.min_workers} workers could be placed in "
                f"{self.failure.rendezvous_timeout_s:.0f}s; add resources, lower ScalingConfig.min_workers "
                f"or raise FailureConfig.rendezvous_timeout_s"))

    def _resume_plan(self) -> RestorePlan:
        """Where the run starts: after the previous run's generations, from its newest checkpoint."""
        # Generations keep growing across runs on the same storage, or the fence would refuse
        # this run's checkpoints as a zombie's.
        fence = self.checkpoints.current_fence()
        if fence is not None:
            self.generation = max(self.generation, fence)
        self.intake.first_generation = self.generation + 1
        latest = self.checkpoints.latest_step()
        if latest is None:
            return RestorePlan(RestoreKind.FRESH)
        self.recorder.resumed_from = latest
        self.recorder.load_previous_metrics(latest)
        self.steps.recorded_step = self.step = latest
        return RestorePlan(RestoreKind.CHECKPOINT, step=latest)

    def _on_starting(self) -> None:
        st = self.state
        assert isinstance(st, Starting)
        ok, _ = self._storage("write the generation fence",
                              lambda: self.checkpoints.fence(self.generation + 1, start_step=st.restore.step))
        if not ok:
            return
        self.generation += 1
        world = len(st.members)
        start_error = None
        try:
            addr, port = self.group.rendezvous_address(st.members[0])
            places = placement([self.views[wid].info for wid in st.members])
            self.group.start_generation({wid: GenerationPlan(
                generation=self.generation, rank=rank, world_size=world, master_addr=addr, master_port=port,
                restore=st.restore, timeout_s=self.failure.collective_timeout_s, **places[rank])
                for rank, wid in enumerate(st.members)})
        except WorkerLostError as error:
            log.warning("generation %d could not start: %s", self.generation, error)
            start_error = error
        if self.recoveries.open is not None:
            self.recoveries.open.to_world, self.recoveries.open.restored_step = world, st.restore.step
        self.recorder.on_generation_start(st.restore.step, world)
        self.intake.restore(self.generation, st.restore.step)
        self.stragglers.reset(world)
        self._eviction_asked = {}
        self._transition(Running(self.generation, st.members, start_step=st.restore.step, started_at=self.clock()),
                         f"generation {self.generation}: world size {world}, restore {st.restore.kind}")
        if start_error is not None:
            # Not every member was handed the generation (e.g. rank 0's rendezvous lookup timed
            # out): recover now rather than wait in RUNNING for a generation that never starts.
            self._handle_failure(st.members, Failure(Cause.HANG, (0,), f"generation {self.generation} could not "
                                                                       f"start: {start_error}"), [], 0.0)

    def _on_running(self) -> None:
        st = self.state
        assert isinstance(st, Running)
        lost: list[tuple[int, Cause, float]] = []
        preempted: list[int] = []
        # Reports of this generation by rank: failed, interrupted (a broken collective), finished.
        errored: dict[int, WorkerReport] = {}
        comm: dict[int, WorkerReport] = {}
        finished: list[WorkerReport] = []
        for rank, wid in enumerate(st.members):
            view, report = self.views[wid], self.views[wid].report
            if view.status == DEAD:
                lost.append((wid, view.death_cause or Cause.WORKER_DIED, view.silent_s))
            elif view.silent_s > self.failure.heartbeat_timeout_s:
                lost.append((wid, Cause.HANG, view.silent_s))
            elif report is not None and report.preempted and report.phase != WorkerPhase.RUNNING:
                preempted.append(wid)     # committed its last step and left the loop
            elif report is not None and report.generation == st.generation:
                if report.phase == WorkerPhase.FAILED:
                    errored[rank] = report
                elif report.phase == WorkerPhase.INTERRUPTED:
                    comm[rank] = report
                elif report.phase == WorkerPhase.FINISHED:
                    finished.append(report)
        if errored:
            report = next(iter(errored.values()))
            cause = CAUSE_OF_ERROR_KIND.get(report.error_kind or "user", Cause.USER_ERROR)
            # A failed GPU stays failed: its worker is replaced, not taken into the next group.
            broken = [st.members[r] for r, failed in errored.items() if failed.error_kind == "hardware"]
            self._handle_failure(st.members, Failure(cause, tuple(errored),
                                                     f"{report.error_type}: {report.error_message}",
                                                     **_error_of(report)),
                                 broken if cause == Cause.HARDWARE_ERROR else [], 0.0, report)
        elif lost:
            ranks = tuple(st.members.index(w) for w, _, _ in lost)
            self._handle_failure(st.members, Failure(lost[0][1], ranks, f"lost worker(s) {[w for w, _, _ in lost]}"),
                                 [w for w, _, _ in lost], max(s for _, _, s in lost))
        elif preempted:
            ranks = tuple(st.members.index(w) for w in preempted)
            self._handle_failure(st.members, Failure(Cause.PREEMPTED, ranks, f"preemption notice to {preempted}"),
                                 preempted, 0.0)
        elif comm:
            # A broken collective with no lost peer yet: give the lost peer a heartbeat timeout to show.
            st.suspect_since = st.suspect_since or self.clock()
            if self.clock() - st.suspect_since > self.failure.heartbeat_timeout_s:
                self._on_broken_group(st, comm)
        elif self._generation_stalled(st):
            pass
        elif len(finished) == len(st.members):
            self._record_final(finished[0])      # rank 0's
            self._transition(Finished(list(st.members)), f"all {len(finished)} ranks finished at step {self.step}")
        else:
            self.group.scale_to(self._slot_target())
            if not self._maybe_evict(st):
                self._maybe_grow(st)

    def _on_broken_group(self, st: Running, reports: dict[int, WorkerReport]) -> None:
        """The group broke and no peer was lost (`reports`: the interrupted ranks'): a fault,
        recovered; or, when the same error broke it at the same step the time before too, the
        loop's own bug (elastic._controller.recurrence): the run fails with that error as the user's."""
        recurring = self._recurring.observe([ErrorSighting(rank, r.step, r.error_type, r.error_message)
                                             for rank, r in reports.items()])
        if recurring is None:
            first = next(iter(reports.values()))
            self._handle_failure(st.members, Failure(
                Cause.COLLECTIVE_ERROR, tuple(reports), f"process group broke with no lost peer: "
                                                    f"{first.error_type}: {first.error_message}",
                **_error_of(first)), [], 0.0)
            return
        report = reports[recurring.rank]
        self._handle_failure(st.members, Failure(
            Cause.USER_ERROR, (recurring.rank,), f"{report.error_type}: {report.error_message} broke the group at "
                                                 f"step {report.step + 1} in {self._recurring.attempts} attempts in "
                                                 f"a row with no lost peer: a bug in the loop's collectives, not a "
                                                 f"fault", **_error_of(report)),
            [], 0.0, report)

    def _generation_stalled(self, st: Running) -> bool:
        """Handle a generation that never started on some members within rendezvous_timeout_s,
        or in which no step completed within FailureConfig.step_timeout_s (every rank stuck
        outside a collective: no heartbeat shows that). Returns whether it did."""
        now = self.clock()
        if any(self.views[w].records for w in st.members):
            st.progress_at = now
        not_started = [rank for rank, w in enumerate(st.members)
                       if (report := self.views[w].report) is None or report.generation != st.generation]
        if not_started and now - st.started_at > self.failure.rendezvous_timeout_s:
            self._handle_failure(st.members, Failure(Cause.HANG, tuple(not_started), (
                f"generation {st.generation} did not start on ranks {not_started} within "
                f"FailureConfig.rendezvous_timeout_s={self.failure.rendezvous_timeout_s:.0f}s")),
                [st.members[r] for r in not_started], now - st.started_at)
            return True
        bound = self.failure.step_timeout(self.steps.step_s)
        quiet = now - max(st.started_at, st.progress_at or 0.0)
        if not_started or bound is None or quiet <= bound:
            return False
        self._handle_failure(st.members, Failure(Cause.HANG, tuple(range(len(st.members))), (
            f"no step completed for {quiet:.0f}s (FailureConfig.step_timeout_s: {bound:.0f}s); every rank is "
            f"replaced")), list(st.members), quiet)
        return True

    def _storage(self, what: str, call: Callable[[], Any]) -> tuple[bool, Any]:
        """A storage call of the control loop. A transient storage error is retried on later
        ticks with backoff, counted once as a storage_error, instead of ending the run; it fails
        the run only once it has lasted FailureConfig.rendezvous_timeout_s."""
        from checkpointing import FencedError, StorageError
        now, trouble = self.clock(), self._storage_trouble
        if trouble is not None and now < trouble["retry_at"]:
            return False, None
        try:
            value = call()
        except FencedError as error:
            # Another run holds the storage now (it took it over), or is past this one: stop.
            self._fail(error)
            return False, None
        except StorageError as error:
            if trouble is None:
                trouble = self._storage_trouble = {"since": now, "attempts": 0, "retry_at": now}
                failure = Failure(Cause.STORAGE_ERROR, (), f"{what}: {error}")
                self.failures.append(failure)
                decision = self.failure_policy.decide(failure, infra_failures_so_far=self.infra_failures,
                                                      max_failures=self.failure.max_failures)
                self.infra_failures += 1
                if decision.action == "fail":
                    self._fail(TooManyFailuresError(f"{decision.reason}; causes so far: "
                                                    f"{', '.join(f.cause for f in self.failures)}"), failure)
                    return False, None
            trouble["attempts"] += 1
            if now - trouble["since"] > self.failure.rendezvous_timeout_s:
                self._fail(error)
                return False, None
            delay = min(10.0, 0.5 * 2 ** trouble["attempts"])
            trouble["retry_at"] = now + delay
            log.warning("storage: %s failed (%s); retrying in %.1fs", what, error, delay)
            return False, None
        self._storage_trouble = None
        return True, value

    def _record_final(self, report: WorkerReport) -> None:
        """The finished state as rank 0 holds it: model hash and data consumed. A recovery still
        open (the re-formed group finished without another step) is recorded too."""
        self.intake.close_recovery(self.generation)
        self.model_sha256 = report.model_sha256 or self.model_sha256
        self.recorder.on_final_data(report.samples_seen, report.data_order)

    def _maybe_evict(self, st: Running) -> bool:
        """Ask the scaling policy about the slowest flagged straggler (again after a window)."""
        flagged = self.stragglers.flagged()
        if not flagged or self.recoveries.open is not None:
            return False
        flag = flagged[0]
        asked = self._eviction_asked.get(flag.rank)
        if asked is not None and flag.step - asked < self.failure.straggler_window:
            return False
        self._eviction_asked[flag.rank] = flag.step
        decision = self.scaling_policy.decide_eviction(rank=flag.rank, score=flag.score, world_size=len(st.members),
                                                       min_workers=self.scaling.min_workers)
        if decision is None or decision.target_world_size >= len(st.members):
            return False
        self.group.request_stop(st.members, st.generation)
        self.recoveries.begin(Cause.STRAGGLER, len(st.members), self.step)
        self._transition(Recovering(st.generation, list(st.members), self._recovery_deadline(),
                                    voluntary=True, evict=[st.members[flag.rank]]), decision.reason)
        return True

    def _maybe_grow(self, st: Running) -> None:
        spares = [w for w in self._ready_ids() if w not in st.members]
        if not spares or self.recoveries.open is not None:
            return
        decision = self.scaling_policy.decide_resize(
            world_size=len(st.members), ready_spares=len(spares),
            min_workers=self.scaling.min_workers, max_workers=self.scaling.max_workers)
        if decision is None or decision.target_world_size <= len(st.members):
            return
        self.group.request_stop(st.members, st.generation)
        self.recoveries.begin(Cause.SCALE_UP, len(st.members), self.step)
        self._transition(Recovering(st.generation, list(st.members), self._recovery_deadline(), voluntary=True),
                         decision.reason)

    def _handle_failure(self, members: list[int], failure: Failure, lost: list[int], detect_s: float,
                        report: WorkerReport | None = None) -> None:
        """Ask the failure policy; fail, or kill what is lost and recover with the rest."""
        self.failures.append(failure)
        decision = self.failure_policy.decide(failure, infra_failures_so_far=self.infra_failures,
                                              max_failures=self.failure.max_failures)
        self.infra_failures += failure.is_infrastructure
        for wid in lost:
            self.group.kill(wid, failure.cause)
        survivors = [w for w in members if w not in lost]
        if decision.action == "fail":
            if report is not None and not failure.is_infrastructure:
                error = {"type": report.error_type, "message": report.error_message,
                         "traceback": report.error_traceback, "exception": report.error, "ranks": list(failure.ranks)}
                self._transition(Failed(decision.reason, failure, error), decision.reason)
            else:
                last = f"; last error: {failure.error_type}: {failure.error_message}" if failure.error_type else ""
                self._fail(TooManyFailuresError(f"{decision.reason}; causes so far: "
                                                f"{', '.join(f.cause for f in self.failures)}{last}"), failure)
            return
        # A lost member may never close its connections (its node is gone or cut off): the
        # survivors cut theirs, so none waits out the collective timeout on it.
        self.group.request_stop(survivors, self.generation, cut_group=bool(lost))
        self.group.scale_to(self._slot_target())
        max_step = max([self.step] + [report.step for w in members if (report := self.views[w].report) is not None])
        self.recoveries.begin(failure.cause, len(members), max_step, detect_s, list(failure.ranks))
        self._transition(Recovering(self.generation, survivors, self._recovery_deadline()),
                         f"{failure.cause} on ranks {list(failure.ranks)}; {decision.reason}")

    def _recovery_deadline(self) -> float:
        return self.clock() + self.failure.collective_timeout_s + self.failure.heartbeat_timeout_s

    def _on_recovering(self) -> None:
        st = self.state
        assert isinstance(st, Recovering)
        settled: dict[int, WorkerReport] = {}      # out of the broken group, by worker
        running: list[int] = []
        for wid in st.survivors:
            view, report = self.views[wid], self.views[wid].report
            if view.status == DEAD or view.silent_s > self.failure.heartbeat_timeout_s:
                self._lost_while_recovering(st, wid)
                continue
            elif report is None or (report.phase == WorkerPhase.RUNNING and report.generation == st.generation):
                running.append(wid)
            elif report.phase == WorkerPhase.FINISHED and report.step >= self.total_steps:
                self._record_final(report)
                return self._transition(Finished(list(st.survivors)), "finished while recovering")
            else:
                settled[wid] = report
        if settled and st.first_settled_at is None:
            st.first_settled_at = self.clock()
        if running:
            # A survivor still in the old loop waits on a peer that has left the collective: give
            # it a few step times to notice, then replace it (cold) rather than wait out the
            # collective timeout. With no survivor out yet, the deadline is the timeout itself.
            # The lag is judged on the survivor's own answers: only an answer given after the
            # grace that still says "running" proves it stuck. One that is merely slow to answer
            # (a loaded machine) is left to the heartbeat timeout above.
            grace_s = max(STUCK_GRACE_S, 3 * self.steps.step_s)
            stuck = [w for w in running if self._answered_running_after(w, st, grace_s)]
            if len(stuck) < len(running) and self.clock() < st.deadline:
                return
            for wid in running:
                st.lost.add(wid)      # a consequence of the failure being handled, not one of its own
                lag = self.clock() - self.views[wid].silent_s - (st.first_settled_at or self.clock())
                self.group.kill(wid, f"still in the broken collective {lag:.1f}s after its peers left "
                                     f"(last answer {self.views[wid].silent_s:.1f}s ago)")
            self._open_recovery().rung = Rung.COLD
        for wid in st.evict:
            if wid in settled:
                del settled[wid]
                st.lost.add(wid)
                self.group.kill(wid, "straggler evicted")
        self._reform(st, settled)

    def _open_recovery(self) -> OpenRecovery:
        """The recovery being carried out (Recovering always has one)."""
        recovery = self.recoveries.open
        assert recovery is not None, "recovering without an open recovery"
        return recovery

    def _lost_while_recovering(self, st: Recovering, wid: int) -> None:
        """A survivor died or hung during the recovery: kill it (hung) and note the failure once."""
        if wid in st.lost:
            return
        st.lost.add(wid)
        view = self.views[wid]
        if view.status == DEAD:
            cause = view.death_cause or Cause.WORKER_DIED
        else:
            cause = Cause.HANG
            self.group.kill(wid, "hang during recovery")
            self._open_recovery().rung = Rung.COLD
        rank = view.report.rank if view.report is not None else None
        self.recoveries.note(cause, [] if rank is None else [rank])

    def _answered_running_after(self, wid: int, st: Recovering, grace_s: float) -> bool:
        """Whether `wid` answered "still running the old generation" more than `grace_s` after the
        first survivor left the broken group."""
        if st.first_settled_at is None:
            return False
        answered_at = self.clock() - self.views[wid].silent_s
        return answered_at - st.first_settled_at >= grace_s

    def _reform(self, st: Recovering, settled: dict[int, WorkerReport]) -> None:
        """Re-form with the survivors out of the broken group (`settled`, with their reports) and
        the ready spares: warm from the survivor furthest ahead that holds its state, else from the
        newest checkpoint."""
        survivors = sorted(settled, key=lambda w: (-settled[w].step, st.survivors.index(w)))
        spares = [w for w in self._ready_ids() if w not in survivors and w not in st.survivors]
        members = self._capped(survivors + spares)
        if len(members) < self.scaling.min_workers:
            self.group.scale_to(self._slot_target())
            recovery = self._open_recovery()
            if self.clock() - recovery.detected_at > self.failure.rendezvous_timeout_s:
                self._fail(InsufficientWorkersError(
                    f"{len(members)} workers left after {recovery.cause}, fewer than "
                    f"min_workers={self.scaling.min_workers}, and no replacement was placed within "
                    f"FailureConfig.rendezvous_timeout_s={self.failure.rendezvous_timeout_s:.0f}s"))
            return
        recovery = self._open_recovery()
        recovery.max_step = max([recovery.max_step] + [settled[w].step for w in survivors])
        warm = [w for w in survivors if settled[w].has_state]
        if warm:
            plan = RestorePlan(RestoreKind.BROADCAST, source_rank=members.index(warm[0]), step=settled[warm[0]].step)
        else:
            ok, latest = self._storage("list the committed checkpoints", self.checkpoints.latest_step)
            if not ok:
                return
            plan = RestorePlan(RestoreKind.CHECKPOINT, step=latest) if latest is not None \
                else RestorePlan(RestoreKind.FRESH)
            if recovery.rung != Rung.COLD:
                recovery.rung = Rung.CHECKPOINT
        self.step = plan.step
        self._transition(Starting(members, plan),
                         f"re-forming with {len(survivors)} survivor(s) and {len(members) - len(survivors)} new")
        self._on_starting()

    def _write_status(self, force: bool) -> None:
        members = self._current_members()
        if isinstance(self.state, Running):
            self.world_size = len(members)
        self.status.write(force=force, state=self.state.state.value, generation=self.generation, step=self.step,
                          world_size=self.world_size, members=members, views=self.views)

    def _slot_target(self) -> int:
        """Slots to keep alive or pending: max_workers and the spares; with no maximum, every placed
        worker plus one probe placement (a spare whenever capacity appears)."""
        if self.scaling.max_workers is not None:
            return self.scaling.max_workers + self.scaling.spare_workers
        placed = sum(1 for v in self.views.values() if v.status in (READY, STARTING))
        return max(self.scaling.min_workers, placed + 1)

    def _capped(self, wids: list[int]) -> list[int]:
        return wids if self.scaling.max_workers is None else wids[:self.scaling.max_workers]

    def _current_members(self) -> list[int]:
        """Workers of the newest generation: its members, or its survivors while recovering."""
        return getattr(self.state, "members", None) or getattr(self.state, "survivors", None) or []

    def _ready_ids(self) -> list[int]:
        return sorted(w for w, v in self.views.items() if v.status == READY)

    def _fail(self, error: Exception, failure: Failure | None = None) -> None:
        # The traceback is the worker's, when a worker's error led here: the controller's own says nothing.
        self._transition(Failed(str(error), failure, {
            "type": type(error).__name__, "message": str(error),
            "traceback": failure.error_traceback if failure else None,
            "exception": error, "ranks": list(failure.ranks) if failure else []}), str(error))


def _error_of(report: WorkerReport) -> dict[str, str | None]:
    """A worker's reported error, as Failure's fields."""
    return {"error_type": report.error_type, "error_message": report.error_message,
            "error_traceback": report.error_traceback}

"""What a running generation's reports say: a fault to recover from, the end of the run, a
resize worth asking for, or nothing.

`RunningWatch` reads the worker views of one tick and returns a verdict; it kills nothing and
changes no state (the controller acts on the verdict). It keeps what it must remember between
ticks of one generation (since when a broken group is suspected, when the last step came, which
straggler the scaling policy was last asked about) and, across generations, the errors of
earlier broken groups (a loop's bug breaks the group again at the same step). A rank that holds
the others up beyond the bound learned from the step times is judged by its own part,
elastic._controller.hang_watch; its verdict is a HANG fault like a heartbeat timeout's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic._controller.hang_watch import HangWatch
from elastic._controller.recurrence import ErrorSighting, RecurringErrors
from elastic._controller.replica_arrangement import whole_replicas
from elastic._controller.slot_table import DEAD, WorkerView
from elastic._controller.states import Running, RunState
from elastic._controller.stragglers import StragglerDetector
from elastic._controller.worker_group import PollTerms
from elastic._protocol import WorkerPhase, WorkerReport
from elastic.config import FailureConfig, ScalingConfig
from elastic.policies import CAUSE_OF_ERROR_KIND, Cause, Failure, ScalingPolicy

# Where the workers hold their polls (answered at once on news, else once a hold): while a
# generation trains, and while one recovers or stops, where the news awaited is a member leaving
# the loop. A held answer wakes the controller (run_loop); an unheld one comes at each tick.
HELD_POLLS = frozenset({RunState.RUNNING, RunState.RECOVERING, RunState.STOPPING})


@dataclass(frozen=True)
class Fault:
    """Recover from `failure`: kill and replace `lost`, re-form with the rest."""

    failure: Failure
    lost: list[int]                       # worker ids
    detect_s: float                       # the failure to its detection, where known
    report: WorkerReport | None = None    # the failing rank's, when its error may end the run


@dataclass(frozen=True)
class AllFinished:
    report: WorkerReport                  # rank 0's: the model hash and the data consumed


@dataclass(frozen=True)
class Resize:
    """Leave the loop at the next boundary and re-form at another size (nothing failed)."""

    cause: Cause                          # STRAGGLER or SCALE_UP
    reason: str
    target_world: int
    evict: list[int] = field(default_factory=list)   # worker ids to leave out


RunningVerdict = Fault | AllFinished | None


class RunningWatch:
    """Judges a running generation from its members' views, tick by tick."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._recurring = RecurringErrors(attempts=2)   # broken groups with no lost peer: a fault, or the loop's bug
        self.hangs = HangWatch(clock)                    # its step times outlive a generation (not its size)
        self.terms = PollTerms()                         # the polls' terms this tick (poll_terms)
        self.begin()

    def begin(self) -> None:
        """A new generation runs: forget what the last one showed."""
        self._suspect_since: float | None = None   # a rank reported a broken group, no peer is known lost yet
        self._progress_at: float | None = None     # controller clock of the newest step record
        self._eviction_asked: dict[int, int] = {}  # rank -> step the scaling policy was last asked at

    def poll_terms(self, state: RunState, failure: FailureConfig) -> PollTerms:
        """The terms of this tick's polls. While a generation runs, recovers or stops, polls are
        held (answered at once on news, else once a hold): the 5 Hz polls cost each worker ~2 % of
        its CPU. Otherwise they are answered at once. While it runs, a rank that has waited for
        the others as long as the hang bound answers then, not at its next hold (thread_position).
        The hang judge judges silence by the hold given here."""
        self.terms = PollTerms(failure.poll_hold_s if state in HELD_POLLS else 0.0,
                               self.hangs.bound(failure) if state == RunState.RUNNING else None)
        return self.terms

    def assess(self, st: Running, views: dict[int, WorkerView], failure: FailureConfig,
               step_s: float) -> RunningVerdict:
        self.hangs.learn(st, views)
        lost: list[tuple[int, Cause, float]] = []
        preempted: list[int] = []
        # Reports of this generation by rank: failed, interrupted (a broken collective), finished.
        errored: dict[int, WorkerReport] = {}
        comm: dict[int, WorkerReport] = {}
        finished: list[WorkerReport] = []
        for rank, wid in enumerate(st.members):
            view, report = views[wid], views[wid].report
            if view.status == DEAD:
                lost.append((wid, view.death_cause or Cause.WORKER_DIED, view.silent_s))
            elif view.silent_s > failure.heartbeat_timeout_s:
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
            return reported_fault(errored, st.members)
        # Ranks by worker id, built once: .index() per lost worker is O(N^2) when all are lost.
        rank_of = {w: r for r, w in enumerate(st.members)} if lost or preempted else {}
        if lost:
            ranks = tuple(rank_of[w] for w, _, _ in lost)
            silent = [_last_heard(w, views[w], failure) for w, _, _ in lost if views[w].status != DEAD]
            return Fault(Failure(lost[0][1], ranks, "; ".join([f"lost worker(s) {[w for w, _, _ in lost]}", *silent])),
                         [w for w, _, _ in lost], max(s for _, _, s in lost))
        if preempted:
            ranks = tuple(rank_of[w] for w in preempted)
            return Fault(Failure(Cause.PREEMPTED, ranks, f"preemption notice to {preempted}"), preempted, 0.0)
        if comm:
            # A broken collective with no lost peer yet: give the lost peer a heartbeat timeout to show.
            self._suspect_since = self._suspect_since or self._clock()
            if self._clock() - self._suspect_since > failure.heartbeat_timeout_s:
                return self._broken_group(comm)
            return None
        hung = self.hangs.assess(st, views, failure, hold_s=self.terms.hold_s)
        if hung is not None:
            return Fault(Failure(Cause.HANG, hung.ranks, hung.reason), hung.lost, hung.detect_s)
        stalled = self._stalled(st, views, failure, step_s)
        if stalled is not None:
            return stalled
        if len(finished) == len(st.members):
            return AllFinished(finished[0])
        return None

    def _broken_group(self, reports: dict[int, WorkerReport]) -> Fault:
        """The group broke and no peer was lost (`reports`: the interrupted ranks'): a fault,
        recovered; or, when the same error broke it at the same step the time before too, the
        loop's own bug (elastic._controller.recurrence): the run fails with that error as the user's."""
        recurring = self._recurring.observe([ErrorSighting(rank, r.step, r.error_type, r.error_message)
                                             for rank, r in reports.items()])
        if recurring is None:
            first = next(iter(reports.values()))
            return Fault(Failure(Cause.COLLECTIVE_ERROR, tuple(reports),
                                 f"process group broke with no lost peer: {first.error_type}: {first.error_message}",
                                 **_error_of(first)), [], 0.0)
        report = reports[recurring.rank]
        return Fault(Failure(Cause.USER_ERROR, (recurring.rank,),
                             f"{report.error_type}: {report.error_message} broke the group at step {report.step + 1} "
                             f"in {self._recurring.attempts} attempts in a row with no lost peer: a bug in the loop's "
                             f"collectives, not a fault", **_error_of(report)), [], 0.0, report)

    def _stalled(self, st: Running, views: dict[int, WorkerView], failure: FailureConfig,
                 step_s: float) -> Fault | None:
        """A generation that never started on some members within rendezvous_timeout_s, or in
        which no step completed within FailureConfig.step_timeout_s (every rank stuck outside a
        collective: no heartbeat shows that)."""
        now = self._clock()
        if any(views[w].records for w in st.members):
            self._progress_at = now
        not_started = [rank for rank, w in enumerate(st.members)
                       if (report := views[w].report) is None or report.generation != st.generation]
        if not_started and now - st.started_at > failure.rendezvous_timeout_s:
            return Fault(Failure(Cause.HANG, tuple(not_started), (
                f"generation {st.generation} did not start on ranks {not_started} within "
                f"FailureConfig.rendezvous_timeout_s={failure.rendezvous_timeout_s:.0f}s")),
                [st.members[r] for r in not_started], now - st.started_at)
        bound = failure.step_timeout(step_s)
        quiet = now - max(st.started_at, self._progress_at or 0.0)
        if not_started or bound is None or quiet <= bound:
            return None
        return Fault(Failure(Cause.HANG, tuple(range(len(st.members))), (
            f"no step completed for {quiet:.0f}s (FailureConfig.step_timeout_s: {bound:.0f}s); every rank is "
            f"replaced")), list(st.members), quiet)

    def resize(self, st: Running, *, spares: list[int], stragglers: StragglerDetector, policy: ScalingPolicy,
               scaling: ScalingConfig, window: int) -> Resize | None:
        """Ask the scaling policy about the slowest flagged straggler (again after `window`
        steps), else about growing onto the ready `spares`."""
        world, tp = len(st.members), scaling.unit_size   # ranks that leave and join together
        flagged = stragglers.flagged()
        if flagged:
            flag = flagged[0]
            asked = self._eviction_asked.get(flag.rank)
            if asked is None or flag.step - asked >= window:
                self._eviction_asked[flag.rank] = flag.step
                decision = policy.decide_eviction(rank=flag.rank, score=flag.score, world_size=world,
                                                  min_workers=scaling.min_workers)
                if decision is not None and decision.target_world_size < world and world - tp >= scaling.min_workers:
                    # Its replica leaves with it (the group is whole replicas); its TP peers stay
                    # outside as warm members.
                    return Resize(Cause.STRAGGLER, decision.reason, world - tp, [st.members[flag.rank]])
        # Only spares that complete whole units can join: the policy is asked about those alone
        # (asked about a part of a unit, it would decide a growth the group cannot make, and say
        # so at every tick while the rest of the unit starts).
        usable = whole_replicas(world + len(spares), tp) - world
        if usable > 0:
            grow = policy.decide_resize(world_size=world, ready_spares=usable,
                                        min_workers=scaling.min_workers, max_workers=scaling.max_workers)
            target = whole_replicas(grow.target_world_size, tp) if grow is not None else world
            if grow is not None and target > world:
                return Resize(Cause.SCALE_UP, grow.reason, target)
        return None


def reported_fault(errored: dict[int, WorkerReport], members: list[int]) -> Fault:
    """The fault of the ranks that reported an error of their own (`errored`, by rank)."""
    failure = reported_failure(errored)
    first = next(iter(errored.values()))
    broken: list[int] = []
    if failure.cause == Cause.HARDWARE_ERROR:
        # A failed GPU stays failed: its worker is replaced, not taken into the next group.
        broken = [members[r] for r, failed in errored.items() if failed.error_kind == "hardware"]
    elif failure.cause == Cause.SDC:
        # Every rank raised the same verdict: the ranks a majority of their replicas named are
        # replaced; mere suspects (no majority) stay, and the rollback covers them.
        broken = [members[r] for r in getattr(first.error, "ranks", ()) if 0 <= r < len(members)]
    return Fault(failure, broken, 0.0, first)


def reported_failure(errored: dict[int, WorkerReport]) -> Failure:
    """The failure of the ranks that reported an error of their own, as the first one says (a
    silent corruption names the ranks and the step of its verdict)."""
    report = next(iter(errored.values()))
    cause = CAUSE_OF_ERROR_KIND.get(report.error_kind or "user", Cause.USER_ERROR)
    ranks, step, since = tuple(errored), None, None
    if cause == Cause.SDC:
        ranks = tuple(getattr(report.error, "ranks", ())) + tuple(getattr(report.error, "suspects", ()))
        step = getattr(report.error, "step", None)
        since = getattr(report.error, "since", step)
    return Failure(cause, ranks, f"{report.error_type}: {report.error_message}", step=step, since=since,
                   **_error_of(report))


def _error_of(report: WorkerReport) -> dict[str, Any]:
    """A worker's reported error, as Failure's fields."""
    return {"error_type": report.error_type, "error_message": report.error_message,
            "error_traceback": report.error_traceback}


def _last_heard(wid: int, view: WorkerView, failure: FailureConfig) -> str:
    """Why a silent worker is lost, and where its training thread last said it was: the place
    an operator (or the hang judge's tests) looks at when the heartbeat, not the hang bound,
    found a frozen rank."""
    position = view.report.position if view.report is not None else None
    where = f"; its last answer: {position.place}, {position.step} steps done" if position is not None else ""
    return f"worker {wid} silent for {view.silent_s:.1f}s (heartbeat_timeout_s={failure.heartbeat_timeout_s:g}{where})"

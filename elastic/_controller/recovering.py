"""What a recovery waits for: the survivors leaving the broken group, and who re-forms it.

`RecoveryWatch` reads the survivors' views of one tick and returns what it found: survivors
lost meanwhile (to note in the open recovery, and to kill when hung), survivors stuck in the
old collective (to kill: the recovery turns cold), the run finishing after all, or the settled
survivors to re-form with. It kills nothing itself. Whom the settled survivors re-form with is
reforming's word (and the new group's restore, forming.GenerationFormer.reform_plan's).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from elastic._controller.hang_watch import WAITING
from elastic._controller.slot_table import DEAD, WorkerView
from elastic._controller.states import Recovering
from elastic._protocol import WorkerPhase, WorkerReport
from elastic.policies import Cause

STUCK_GRACE_S = 2.0      # floor of how long a survivor may lag the first one out of a broken group


@dataclass
class RecoveryTick:
    """What one tick of a recovery found."""

    kills: list[tuple[int, str]] = field(default_factory=list)     # worker id, reason
    noted: list[tuple[Cause, list[int]]] = field(default_factory=list)   # failures absorbed: cause, ranks
    cold: bool = False                         # a survivor is replaced: the state comes from storage
    finished: WorkerReport | None = None       # a survivor finished the run meanwhile
    # Survivors (by rank) that left the broken group with an error of the loop's own (e.g. a
    # pending step's non-finite loss): the run fails with it as it would while running.
    errored: dict[int, WorkerReport] = field(default_factory=dict)
    settled: dict[int, WorkerReport] | None = None   # re-form with these (by worker id); None: wait


class RecoveryWatch:
    """Follows the survivors of one recovery out of the broken group."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.begin()

    def begin(self) -> None:
        """A new recovery starts."""
        self._first_settled_at: float | None = None   # when the first survivor left the broken group
        self._lost: set[int] = set()                  # survivors lost meanwhile (noted once)

    def assess(self, st: Recovering, views: dict[int, WorkerView], *, heartbeat_timeout_s: float,
               step_s: float, total_steps: int) -> RecoveryTick:
        tick = RecoveryTick()
        settled: dict[int, WorkerReport] = {}      # out of the broken group, by worker
        running: list[int] = []
        for wid in st.survivors:
            view, report = views[wid], views[wid].report
            if view.status == DEAD or view.silent_s > heartbeat_timeout_s:
                self._lost_meanwhile(view, tick)
            elif report is None or (report.phase == WorkerPhase.RUNNING and report.generation == st.generation):
                running.append(wid)
            elif report.phase == WorkerPhase.FINISHED and report.step >= total_steps:
                tick.finished = report
                return tick
            else:
                settled[wid] = report
                if (report.phase == WorkerPhase.FAILED and report.generation == st.generation
                        and report.error_kind == "user" and report.rank is not None):
                    tick.errored[report.rank] = report
        now = self._clock()
        if settled and self._first_settled_at is None:
            self._first_settled_at = now
        if running:
            # A survivor still in the old loop waits on a peer that has left the collective: give
            # it a few step times to notice, then replace it (cold) rather than wait out the
            # collective timeout. With no survivor out yet, the deadline is the timeout itself.
            # The lag is judged on the survivor's own answers: only an answer given after the
            # grace that still says "running", from a collective it has waited in for the grace
            # at least, proves it stuck. One that is merely slow to answer (a loaded machine) is
            # left to the heartbeat timeout above; one still computing, or held, is on its way to
            # the broken collective, where it fails at once (on a loaded machine that took 2.5 s:
            # a TP rank killed for it cost a warm recovery in CI), and the ranks waiting in a
            # collective may be waiting for it: none is stuck while one still moves.
            grace_s = max(STUCK_GRACE_S, 3 * step_s)
            stuck = [w for w in running if self._stuck(views[w], grace_s)]
            if len(stuck) < len(running) and now < st.deadline:
                return tick
            for wid in running:
                self._lost.add(wid)      # a consequence of the failure being handled, not one of its own
                silent_s = views[wid].silent_s
                lag = now - silent_s - (self._first_settled_at or now)
                report = views[wid].report
                position = report.position if report is not None else None
                where = f", {position.place} at step {position.step} for {position.age_s:.1f}s" if position else ""
                tick.kills.append((wid, f"still in the broken collective {lag:.1f}s after its peers left "
                                        f"(last answer {silent_s:.1f}s ago{where})"))
            tick.cold = True
        for wid in st.evict:
            if wid in settled:
                del settled[wid]
                self._lost.add(wid)
                tick.kills.append((wid, "straggler evicted"))
        tick.settled = settled
        return tick

    def _lost_meanwhile(self, view: WorkerView, tick: RecoveryTick) -> None:
        """A survivor died or hung during the recovery: noted once, killed when hung."""
        if view.wid in self._lost:
            return
        self._lost.add(view.wid)
        if view.status == DEAD:
            cause = view.death_cause or Cause.WORKER_DIED
        else:
            cause = Cause.HANG
            tick.kills.append((view.wid, "hang during recovery"))
            tick.cold = True
        rank = view.report.rank if view.report is not None else None
        tick.noted.append((cause, [] if rank is None else [rank]))

    def _stuck(self, view: WorkerView, grace_s: float) -> bool:
        """Whether the survivor answered "still running the old generation" more than `grace_s`
        after the first survivor left the broken group, from a place where it waits on the others
        (a collective) and has been for `grace_s` at least."""
        if self._first_settled_at is None:
            return False
        answered_at = self._clock() - view.silent_s
        if answered_at - self._first_settled_at < grace_s:
            return False
        position = view.report.position if view.report is not None else None
        return position is None or (position.place in WAITING and position.age_s >= grace_s)

"""Hangs found from where the training threads are, within a bound learned from the run.

The judge of one question, tick by tick: is a rank holding up the others, and for longer than
the group's own steps make plausible? Each poll answer carries where the rank's training thread
is (elastic._worker.thread_position: computing a step, waiting for a neighbouring stage in a
pipeline's send/recv, for the others in DDP's gradient sync or in the step boundary's exchange, in
a checkpoint save or ctx.restore) and since when, as
an age measured on that worker. Why this and not the heartbeat alone: a frozen process is
silent, but a training thread stuck in a hung kernel or on a dead data service is not (the
actor's poll thread answers on), and before this only the collective timeout (about 70 s) or
step_timeout_s (minutes) found it. A silent process is still found by heartbeat_timeout_s too.

The rule. The *front* is the rank that has waited the longest at the furthest place any
answering rank has reached (a place is a step and a stage within it). Once its own answer says
it has waited the bound B, the ranks that have not reached the front's place are *suspects*,
and a suspect is declared hung when
- it is silent (no answer for poll_hold_s + SILENCE_MARGIN_S, while answers are held at most
  poll_hold_s): a frozen or cut-off process; or, when no rank is behind the front, a silent
  rank at the front's place (stopped inside the sync it was waiting in);
- or it answers, and it has stayed where it is while the front waited for the bound: its
  training thread has not moved. The interval is the overlap of two facts, each measured on one
  worker: the suspect was there from (its answer's receive time - its age) to its answer, and
  the front has waited since (its answer's time - its wait) up to its answer; when the suspect
  is the only one behind, the front's answer also proves it had not arrived by then.
A suspect that answers from a pipeline's send/recv is waiting for a neighbouring stage: it is
named only when no other rank is (a stage stuck in its compute, or frozen, is the one named, and
its pipeline leaves with it as a unit).
Only facts from answers count (ages at the moment of answering), never an age extrapolated past
an answer, which could make a wait that already ended look long. The front's answer comes when
it matters: a worker's held poll returns when its wait crosses HANG_FLOOR_S, half of it, and the
bound (the controller sends it with each poll while a generation runs).

Never judged (the other rules stand: heartbeat_timeout_s, the collective timeout,
step_timeout_s): a rank in a checkpoint save, in ctx.restore or joining the group (their length
is not a step's, and a save may hold the GIL from the poll thread) while it may still be there:
once the front has collected the exchange of a later step (PositionReport.exchanged; every rank
entered it), such an answer is stale and a silent rank is judged like any other (a rank last
heard in its save, frozen two steps later, is found in the bound, not by the heartbeat). A rank
silent in one of these places is judged too once its silence passes the *quiet limit*:
HANG_FACTOR x the longest gap the run has seen between two answers of its first member within a
generation (at least the bound, and only once MIN_ANSWER_GAPS gaps are known). A healthy rank answers every
poll hold even in a save (the save's copies and uploads release the GIL); a save, or a loaded
host, that has kept answers away for a while shows in those gaps and lengthens the limit. (The
mixed chaos campaign gates its faults on commits, so partitions and freezes often land in a
save: each was found by the 10 s heartbeat, now in about 4 poll holds.) Nor is judged an
answering one in the boundary's own work after an exchange or in the tests' hold; a front within its
generation's first FIRST_STEPS steps (group formation, DDP's first buckets, lazy allocations);
and, with the bound "auto", a run with fewer than MIN_STEP_TIMES step times learned.

The bound: FailureConfig.hang_timeout(p99), that is max(HANG_FACTOR x p99, HANG_FLOOR_S) over
the last STEP_TIMES_KEPT step times, as the first member measures them (from the compute mark
of a step to the end of its exchange: checkpoint saves and a generation's first step are not
in them). Step times are forgotten when the world size changes: a smaller group may take longer
per step. A number in hang_timeout_s pins the bound; None turns this judge off.
Two kinds of step are told apart: a step that follows boundary work (a save, a copy to memory:
PositionReport.after_work) shares the host with that work's background part and takes longer.
Mixed in, the few of them set the p99 (G1: a 0.47 s median, a 1.9 s step after each save, a
bound of 7.6 s). So the ordinary steps' p99 sets the bound of an ordinary step, and a front
waiting in a step after boundary work is judged as every step was before: by the p99 of all the
steps kept, slow ones included (that kind alone, a few samples, would be judged by its maximum,
a longer bound than before).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from elastic._controller.slot_table import WorkerView
from elastic._controller.states import Running
from elastic._protocol import PositionReport, ThreadPlace, WorkerPhase, WorkerReport
from elastic.config import FailureConfig

STEP_TIMES_KEPT = 200
MIN_STEP_TIMES = 20
ANSWER_GAPS_KEPT = 200
MIN_ANSWER_GAPS = 20
FIRST_STEPS = 2
SILENCE_MARGIN_S = 1.0      # beyond the poll hold: a healthy rank's answer is never this late
WAKE_SLACK_S = 0.05         # a front that woke at the bound may report a hair less than it

# The order of places within a step (a position's step is the steps completed when it got there:
# a boundary's work comes after its step is counted, then the next step's compute).
_ORDER = {ThreadPlace.JOINING: 0, ThreadPlace.RESTORING: 1, ThreadPlace.BOUNDARY: 2, ThreadPlace.CHECKPOINT: 3,
          ThreadPlace.HELD: 4, ThreadPlace.COMPUTING: 5, ThreadPlace.PIPELINE: 6, ThreadPlace.SYNC: 7,
          ThreadPlace.EXCHANGE: 8}
WAITING = frozenset({ThreadPlace.PIPELINE, ThreadPlace.SYNC, ThreadPlace.EXCHANGE})
# Long work a rank may do while the others wait: never judged. A silent rank is judged in the
# boundary's own work and in the tests' hold (neither blocks its poll thread), an answering one not.
NOT_JUDGED_SILENT = frozenset({ThreadPlace.JOINING, ThreadPlace.RESTORING, ThreadPlace.CHECKPOINT})
NOT_JUDGED = NOT_JUDGED_SILENT | {ThreadPlace.BOUNDARY, ThreadPlace.HELD}


@dataclass(frozen=True)
class Hung:
    """Ranks `ranks` (worker ids `lost`) held the group up beyond the bound."""

    ranks: tuple[int, ...]
    lost: list[int]
    detect_s: float          # since each was last known to move (or to answer), the longest
    reason: str


class _Seen(NamedTuple):
    """One member's newest answer, as facts on the controller's clock."""

    rank: int
    wid: int
    position: PositionReport
    answered_at: float       # when its answer came (controller clock)
    there_since: float       # when its thread got where it is (answered_at - its age)
    silent_s: float

    @property
    def place(self) -> tuple[int, int]:
        return self.position.step, _ORDER[self.position.place]


def _p99(times: deque[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class HangWatch:
    """Learns the hang bound from the run's step times and judges the members' positions."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._all_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)     # both kinds, steps after a save or copy too
        self._world: int | None = None
        self._fed: WorkerReport | None = None     # the report whose step times were taken last
        # Seconds between two answers of the first member within one generation (receive times),
        # and its last answer. Not across generations: learn() sees no answer while the group
        # recovers, and a gap that spans a recovery (seconds: detection, the re-form) says nothing
        # about how long a save or the host keeps answers away, yet would lengthen the limit to
        # the heartbeat's (G1 saw a rank silent in a save found at 10 s that way).
        self._answer_gaps: deque[float] = deque(maxlen=ANSWER_GAPS_KEPT)
        self._last_answer: tuple[int, int, float] | None = None    # (worker id, generation, received at)

    def learn(self, st: Running, views: dict[int, WorkerView]) -> None:
        """Take the step times the first member's newest answer brings, and the gap since its
        previous answer in the same generation (once per answer)."""
        if len(st.members) != self._world:
            self._world = len(st.members)
            self._step_times.clear()
            self._all_times.clear()
        first = views[st.members[0]]
        report = first.report
        if report is None or report is self._fed or report.position is None:
            return
        self._fed = report
        received_at = self._clock() - first.silent_s
        if self._last_answer is not None and self._last_answer[:2] == (first.wid, report.generation):
            self._answer_gaps.append(received_at - self._last_answer[2])
        self._last_answer = (first.wid, report.generation, received_at)
        if report.generation == st.generation:
            self._step_times.extend(report.position.step_times)
            self._all_times.extend(report.position.step_times)
            self._all_times.extend(report.position.after_work_times)

    def p99_s(self, after_work: bool = False) -> float | None:
        """The p99 of the ordinary step times kept; with `after_work`, or while fewer than
        MIN_STEP_TIMES of them are kept (copies taken at every step make every step one after
        boundary work), of every step time kept. None before MIN_STEP_TIMES step times."""
        if len(self._all_times) < MIN_STEP_TIMES:
            return None
        if len(self._step_times) < MIN_STEP_TIMES:
            return _p99(self._all_times)
        ordinary = _p99(self._step_times)
        # Sorted only when asked: `assess` asks for the ordinary bound at every tick.
        return max(ordinary, _p99(self._all_times)) if after_work else ordinary

    def bound(self, failure: FailureConfig, after_work: bool = False) -> float | None:
        """The bound a front waiting in an ordinary step (or, `after_work`, in a step after
        boundary work) is judged by; the polls carry the ordinary one."""
        return failure.hang_timeout(self.p99_s(after_work))

    def quiet_limit(self, bound: float) -> float | None:
        """How long a rank may be silent in a save, ctx.restore or joining before it is judged
        (see the module docstring); None before MIN_ANSWER_GAPS gaps are known."""
        if len(self._answer_gaps) < MIN_ANSWER_GAPS:
            return None
        return max(bound, FailureConfig.HANG_FACTOR * max(self._answer_gaps))

    def assess(self, st: Running, views: dict[int, WorkerView], failure: FailureConfig, *,
               hold_s: float | None = None) -> Hung | None:
        bounds = {False: self.bound(failure)}
        if bounds[False] is None:
            return None

        def bound_for(after_work: bool) -> float:
            # A step after boundary work's bound (a sort of every step time) only when one is judged.
            if after_work not in bounds:
                bounds[after_work] = self.bound(failure, after_work=True)
            return bounds[after_work] or 0.0
        now = self._clock()
        # Silence is judged against the hold the polls were given (None: the config's, as given while running).
        fresh_s = (failure.poll_hold_s if hold_s is None else hold_s) + SILENCE_MARGIN_S
        seen: list[_Seen] = []
        front: _Seen | None = None
        for rank, wid in enumerate(st.members):
            view = views[wid]
            report, position = view.report, view.report.position if view.report is not None else None
            if report is None or position is None or report.generation != st.generation \
                    or position.generation != st.generation or report.phase != WorkerPhase.RUNNING:
                return None       # not every member trains this generation: the other rules judge
            answered_at = now - view.silent_s
            member = _Seen(rank, wid, position, answered_at, answered_at - position.age_s, view.silent_s)
            seen.append(member)
            if position.place in WAITING and view.silent_s <= fresh_s and position.nth > FIRST_STEPS \
                    and position.age_s + WAKE_SLACK_S >= bound_for(position.after_work) \
                    and (front is None or member.place > front.place
                         or (member.place == front.place and member.there_since < front.there_since)):
                front = member
        if front is None:
            return None
        bound = bound_for(front.position.after_work)
        behind = [m for m in seen if m.place < front.place]
        quiet_limit = self.quiet_limit(bound)
        hung: list[tuple[_Seen, float, str]] = []
        for m in seen:
            if m is front or m.place > front.place:
                continue
            # A save, ctx.restore or joining is exempt while the rank may still be in it: not once
            # the front has collected an exchange the rank entered after it (its answer is stale),
            # nor once it has been silent past the quiet limit.
            quiet = ""
            if m.position.place in NOT_JUDGED_SILENT and front.position.exchanged <= m.position.step:
                if quiet_limit is None or m.silent_s < quiet_limit:
                    continue
                quiet = (f", beyond the quiet limit {quiet_limit:.1f}s ({FailureConfig.HANG_FACTOR:g} x the "
                         f"longest gap between a member's answers)")
            if m.silent_s > fresh_s and (m.place < front.place or not behind):
                hung.append((m, min(m.silent_s, now - m.there_since),
                             f"rank {m.rank} silent for {m.silent_s:.1f}s (last {m.position.place} at step "
                             f"{m.position.step + 1}{quiet})"))
            elif m.silent_s <= fresh_s and m.place < front.place and m.position.place not in NOT_JUDGED:
                known_until = max(m.answered_at, front.answered_at if len(behind) == 1 else m.answered_at)
                stalled = min(known_until, front.answered_at) - max(m.there_since, front.there_since)
                if stalled + WAKE_SLACK_S >= bound:
                    hung.append((m, now - m.there_since,
                                 f"rank {m.rank}'s training thread has not moved for {now - m.there_since:.1f}s "
                                 f"({m.position.place} at step {m.position.step + 1})"))
        if any(m.position.place is not ThreadPlace.PIPELINE or m.silent_s > fresh_s for m, _, _ in hung):
            # A stage that answers from a pipeline's send/recv waits for a neighbour: when a rank
            # is to blame, it is that one (a stage stuck in its compute, or a silent one). Named
            # alone, such waiters are a pipeline whose stages wait on each other.
            hung = [h for h in hung if h[0].position.place is not ThreadPlace.PIPELINE or h[0].silent_s > fresh_s]
        if not hung:
            return None
        wait = front.answered_at - front.there_since
        p99 = self.p99_s(front.position.after_work)
        kind = "p99 step time" + (" (of all steps: this one follows a save or copy)"
                                   if front.position.after_work else "")
        learned = f"{failure.HANG_FACTOR:g} x {kind} {p99:.2f}s, at least {failure.HANG_FLOOR_S:g}s" \
            if p99 is not None and failure.hang_timeout_s == "auto" else "pinned"
        return Hung(ranks=tuple(m.rank for m, _, _ in hung), lost=[m.wid for m, _, _ in hung],
                    detect_s=round(max(d for _, d, _ in hung), 3),
                    reason=(f"rank {front.rank} waited {wait:.1f}s in {front.position.place} at step "
                            f"{front.position.step + 1}, beyond the hang bound {bound:.1f}s (FailureConfig."
                            f"hang_timeout_s={failure.hang_timeout_s!r}: {learned}): "
                            + "; ".join(why for _, _, why in hung)))

"""A stop (`elastic stop`): its state, what it waits for, and how it ends: stopped, or failed
when its commit did not.

`stopping_for` is the STOPPING state a STOP request puts a running generation in. While the run
is STOPPING every member commits at its next step boundary and leaves the loop.
`assess_stop` reads the members' views of one tick and returns None (wait: a member still trains
and the deadline has not come) or how the stop ends: the members still in the loop at the
deadline (to kill: the commit they were part of is lost, the run resumes from the one before)
and the state the run ends in. It kills nothing and changes no state (the controller does both).
"""
from __future__ import annotations

from dataclasses import dataclass

from elastic._controller.running import reported_failure
from elastic._controller.slot_table import DEAD, WorkerView
from elastic._controller.states import Failed, Running, Stopped, Stopping
from elastic._protocol import WorkerPhase


@dataclass(frozen=True)
class StopEnd:
    """The stop is over: kill `late`, then end in `state` (for `reason`)."""

    late: list[int]              # worker ids still training at the stop's deadline
    state: Stopped | Failed
    reason: str


def stopping_for(st: Running, request: dict, deadline: float) -> tuple[Stopping, str]:
    """The state `request` (the STOP file's) stops the generation of `st` in, and why."""
    reason = str(request.get("reason") or "elastic stop")
    return Stopping(st.generation, list(st.members), deadline, reason), f"stop requested: {reason}"


def assess_stop(st: Stopping, views: dict[int, WorkerView], *, now: float, step: int) -> StopEnd | None:
    """The stop of `st` as its members' views show it (`step`: the newest step the run keeps)."""
    in_loop = still_in_loop(st.generation, st.members, views)
    if in_loop and now < st.deadline:
        return None
    # A member that left with an error (its stop commit failed: check_committed raised) did
    # not commit the step the run stops at: the run fails with that error, never "stopped".
    errored = {rank: report for rank, wid in enumerate(st.members)
               if (report := views[wid].report) is not None and report.generation == st.generation
               and report.phase == WorkerPhase.FAILED}
    if errored:
        failure = reported_failure(errored)
        reason = f"the stop at step {step} did not commit: {failure.message}"
        return StopEnd(in_loop, Failed.of_report(reason, failure, next(iter(errored.values()))), reason)
    return StopEnd(in_loop, Stopped(list(st.members), st.reason), f"stopped at step {step}: {st.reason}")


def still_in_loop(generation: int, members: list[int], views: dict[int, WorkerView]) -> list[int]:
    """Members still training in `generation` (not dead, not out of its loop)."""
    return [w for w in members if views[w].status != DEAD and (report := views[w].report) is not None
            and report.generation == generation and report.phase == WorkerPhase.RUNNING]

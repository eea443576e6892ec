"""What a failure means for the run: charged to the failure budget, it ends the run or is recovered from.

`triage` takes a fault the running judge found (running.Fault) and returns the run's end (the
Failed state, with the worker's own error when its code raised, else the budget's) or `Recover`:
the members the recovery keeps, the newest step any of them had reached (what is lost is counted
from it) and why. `charge_reported` does the same for the loop's own errors that survivors bring
out of a broken group. Neither acts: the controller kills, asks the survivors to leave and
changes the state.
"""
from __future__ import annotations

from dataclasses import dataclass

from elastic._controller.failure_budget import FailureBudget
from elastic._controller.running import Fault, reported_failure
from elastic._controller.slot_table import WorkerView
from elastic._controller.states import Failed
from elastic._protocol import WorkerReport


@dataclass(frozen=True)
class Recover:
    """Recover from the fault with `survivors` (worker ids, in rank order)."""

    survivors: list[int]
    reached: int          # the newest step any member had reached when the fault came
    reason: str


def triage(fault: Fault, members: list[int], views: dict[int, WorkerView], step: int,
           budget: FailureBudget) -> Recover | Failed:
    """Charge `fault` (of the generation of `members`; `step`: the newest step the run keeps)."""
    failure = fault.failure
    reached = max([step] + [report.step for w in members if (report := views[w].report) is not None])
    decision = budget.charge(failure, reached)
    if decision.action == "fail":
        if fault.report is not None and not failure.is_infrastructure:
            return Failed.of_report(decision.reason, failure, fault.report)
        return Failed.of(budget.exhausted(decision, failure), failure)
    lost = set(fault.lost)
    return Recover([w for w in members if w not in lost], reached,
                   f"{failure.cause} on ranks {list(failure.ranks)}; {decision.reason}")


def charge_reported(errored: dict[int, WorkerReport], step: int, budget: FailureBudget) -> Failed | None:
    """Charge the errors the loop raised (`errored`, by rank); the run's end, or None: recover on."""
    failure = reported_failure(errored)
    decision = budget.charge(failure, step)
    if decision.action == "fail":
        return Failed.of_report(decision.reason, failure, next(iter(errored.values())))
    return None

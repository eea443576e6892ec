"""The controller's states: one enum, one small payload class per state, built once with its
payload and never changed (what the controller learns while in a state lives with the part that
judges it: scheduling.StartGate, running.RunningWatch, recovering.RecoveryWatch). The open
recovery is not part of any state either: ledgers.RecoveryLedger owns it across Recovering,
Starting and the first steps of Running; the step a generation really restored is the report
intake's (ReportIntake.start_step)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from elastic._protocol import RestorePlan, WorkerReport
from elastic.policies import Failure


class RunState(enum.StrEnum):
    SCHEDULING = "scheduling"   # placing workers until min_workers are ready
    STARTING = "starting"       # forming a generation's process group
    RUNNING = "running"
    RECOVERING = "recovering"   # waiting for survivors to leave the loop, then re-forming
    STOPPING = "stopping"       # `elastic stop`: every rank commits at the next boundary and leaves
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"         # ended on purpose with a commit; resumable


@dataclass(frozen=True)
class Scheduling:
    since: float
    state: RunState = RunState.SCHEDULING


@dataclass(frozen=True)
class Starting:
    members: list[int]
    restore: RestorePlan
    state: RunState = RunState.STARTING


@dataclass(frozen=True)
class Running:
    generation: int
    members: list[int]                 # worker ids in rank order
    started_at: float = 0.0              # controller clock when the generation was started
    state: RunState = RunState.RUNNING


@dataclass(frozen=True)
class Recovering:
    generation: int
    survivors: list[int]
    deadline: float
    voluntary: bool = False            # a resize the controller chose, not a failure
    evict: list[int] = field(default_factory=list)   # survivors to leave out (stragglers)
    target_world: int | None = None    # a resize's size (ResizeDecision.target_world_size); None: all there are
    # A silent corruption found at this step: the survivors' live state may have trained on it,
    # so the group restores a state from before it (a copy in memory, else a checkpoint).
    restore_before: int | None = None
    state: RunState = RunState.RECOVERING


@dataclass(frozen=True)
class Stopping:
    generation: int
    members: list[int]
    deadline: float                    # members still in the loop by then are killed (their commit is lost)
    reason: str = ""                   # the operator's, from the STOP request
    state: RunState = RunState.STOPPING


@dataclass(frozen=True)
class Stopped:
    members: list[int] = field(default_factory=list)
    reason: str = ""
    state: RunState = RunState.STOPPED


@dataclass(frozen=True)
class Finished:
    members: list[int] = field(default_factory=list)     # the last generation's (status.json keeps them)
    state: RunState = RunState.FINISHED


@dataclass(frozen=True)
class Failed:
    reason: str
    failure: Failure | None = None
    # What the run failed of: type, message, traceback (the worker's when a worker's error led
    # here), the exception itself, and the ranks (summary.json `error`, Result.error).
    error: dict[str, Any] = field(default_factory=dict)
    state: RunState = RunState.FAILED

    @classmethod
    def of(cls, error: BaseException, failure: Failure | None = None) -> Failed:
        """The run fails with `error` (a worker's `failure` led to it, if given)."""
        # The traceback is the worker's, when a worker's error led here: the controller's own says nothing.
        return cls(str(error), failure, {"type": type(error).__name__, "message": str(error),
                                         "traceback": failure.error_traceback if failure else None,
                                         "exception": error, "ranks": list(failure.ranks) if failure else []})

    @classmethod
    def of_report(cls, reason: str, failure: Failure, report: WorkerReport) -> Failed:
        """The run fails with the error a worker reported (the user's code raised)."""
        return cls(reason, failure, {"type": report.error_type, "message": report.error_message,
                                     "traceback": report.error_traceback, "exception": report.error,
                                     "ranks": list(failure.ranks)})


AnyState = Scheduling | Starting | Running | Recovering | Stopping | Finished | Failed | Stopped

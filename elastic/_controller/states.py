"""The controller's states: one enum, one small payload class per state. (The open recovery is
not part of any state: elastic._controller.ledgers.RecoveryLedger owns it across Recovering, Starting and
the first steps of Running.)"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from elastic._protocol import RestorePlan
from elastic.policies import Failure


class RunState(enum.StrEnum):
    SCHEDULING = "scheduling"   # placing workers until min_workers are ready
    STARTING = "starting"       # forming a generation's process group
    RUNNING = "running"
    RECOVERING = "recovering"   # waiting for survivors to leave the loop, then re-forming
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class Scheduling:
    since: float
    ready_count: int = 0               # ready workers at the last tick ...
    ready_since: float = 0.0           # ... and since when that count holds
    state: RunState = RunState.SCHEDULING


@dataclass
class Starting:
    members: list[int]
    restore: RestorePlan
    state: RunState = RunState.STARTING


@dataclass
class Running:
    generation: int
    members: list[int]                 # worker ids in rank order
    suspect_since: float | None = None   # a rank reported a broken group, no peer is known lost yet
    restore_confirmed: bool = False      # rank 0 reported the step it actually restored
    start_step: int = 0                  # the step the generation restored
    started_at: float = 0.0              # controller clock when the generation was started
    progress_at: float | None = None     # controller clock of its newest step record
    state: RunState = RunState.RUNNING


@dataclass
class Recovering:
    generation: int
    survivors: list[int]
    deadline: float
    voluntary: bool = False            # a resize the controller chose, not a failure
    first_settled_at: float | None = None   # when the first survivor left the broken group
    evict: list[int] = field(default_factory=list)   # survivors to leave out (stragglers)
    lost: set[int] = field(default_factory=set)      # survivors lost meanwhile (noted in the recovery)
    state: RunState = RunState.RECOVERING


@dataclass
class Finished:
    members: list[int] = field(default_factory=list)     # the last generation's (status.json keeps them)
    state: RunState = RunState.FINISHED


@dataclass
class Failed:
    reason: str
    failure: Failure | None = None
    # What the run failed of: type, message, traceback (the worker's when a worker's error led
    # here), the exception itself, and the ranks (summary.json `error`, Result.error).
    error: dict[str, Any] = field(default_factory=dict)
    state: RunState = RunState.FAILED


AnyState = Scheduling | Starting | Running | Recovering | Finished | Failed

"""Fakes for driving the controller without Ray: a worker group, a recorder, checkpoints, a lease,
a clock.

Each stands in for a Protocol of the controller's (WorkerGroup, RunRecord, CheckpointView, LeaseHold);
protocol_checks.py has the type checker hold them to it (`make lint`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from elastic._controller.journal import RecordState
from elastic._controller.slot_table import DEAD, READY, WorkerView
from elastic._controller.worker_group import PollTerms
from elastic._protocol import GenerationPlan, StepRecord, WorkerInfo, WorkerPhase, WorkerReport
from elastic.policies import Cause


class NoNodeCopies:
    """A worker group whose nodes' keepers hold nothing: for a GenerationFormer on its own."""

    def node_copies(self) -> list[tuple[str, int, int, int, int]]:
        return []


class FakeGroup:
    """Workers become ready at once, up to `capacity` live ones. Tests script their reports."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.poll_hold_s = 0.0                  # the terms of the last tick's polls, as the controller gave them
        self.poll_wake_s: float | None = None
        self.views: dict[int, WorkerView] = {}
        self.killed: list[tuple[int, str]] = []
        self.generations: list[dict[int, GenerationPlan]] = []
        self.stops: list[tuple[list[int], int]] = []
        self.cuts: list[bool] = []              # request_stop's cut_group, per call
        self.preempted: list[list[int]] = []    # request_preemption's workers, per call
        self.avoided: tuple[str, ...] = ()      # avoid_nodes' last
        self.shut_down = False
        self.waits: list[float] = []            # wait()'s timeouts, per call
        self.kept: list[tuple[str, int, int, int, int]] = []   # the nodes' keepers' copies (node_copies)
        self._next = 0

    def live(self) -> list[int]:
        return [w for w, v in self.views.items() if v.status != DEAD]

    def scale_to(self, n: int) -> None:
        while len(self.live()) < min(n, self.capacity):
            wid, self._next = self._next, self._next + 1
            self.views[wid] = WorkerView(wid=wid, status=READY, info=WorkerInfo(100 + wid, "node", f"a{wid}", "ip"))

    def avoid_nodes(self, node_ids: tuple[str, ...]) -> None:
        self.avoided = node_ids

    def tick(self, terms: PollTerms | None = None) -> dict[int, WorkerView]:
        if terms is not None:
            self.poll_hold_s, self.poll_wake_s = terms
        out = {w: replace(v) for w, v in self.views.items()}
        for v in self.views.values():
            v.records = []
        return out

    def wait(self, timeout_s: float) -> None:
        self.waits.append(timeout_s)            # a scripted run has its news at once

    def rendezvous_address(self, wid: int) -> tuple[str, int]:
        return "127.0.0.1", 29500

    def start_generation(self, plans: dict[int, GenerationPlan]) -> None:
        self.generations.append(plans)
        for wid, plan in plans.items():
            self.set_report(wid, WorkerPhase.RUNNING, generation=plan.generation, rank=plan.rank,
                            step=plan.restore.step, has_state=True)

    def request_stop(self, wids: list[int], generation: int, cut_group: bool = False) -> None:
        self.stops.append((list(wids), generation))
        self.cuts.append(cut_group)

    def request_preemption(self, wids: list[int]) -> None:
        self.preempted.append(list(wids))

    def kill(self, wid: int, reason: str) -> None:
        self.killed.append((wid, reason))
        self.views[wid].status = DEAD
        self.views[wid].death = reason
        self.views[wid].death_cause = Cause.WORKER_DIED

    def shutdown(self, graceful: bool = True) -> None:
        self.shut_down = True

    @property
    def next_wid(self) -> int:
        return self._next

    def bury(self, wid: int, reason: str) -> None:
        self.views[wid] = WorkerView(wid=wid, status=DEAD, death=reason, death_cause=Cause.WORKER_DIED)
        self._next = max(self._next, wid + 1)

    def node_copies(self) -> list[tuple[str, int, int, int, int]]:
        return list(self.kept)

    # ---- scripting --------------------------------------------------------------------
    def set_report(self, wid: int, phase: WorkerPhase, *, generation: int, rank: int = 0, step: int = 0,
                   has_state: bool = True, **error: Any) -> None:
        self.views[wid].report = WorkerReport(phase=phase, generation=generation, rank=rank, step=step,
                                              has_state=has_state, records=[], **error)

    def complete_steps(self, wid: int, first: int, last: int, world_size: int, compute_s: tuple[float, ...] = (),
                       generation: int | None = None) -> None:
        report = self.views[wid].report
        assert report is not None, f"worker {wid} has not reported yet: set_report first"
        generation = report.generation if generation is None else generation
        self.views[wid].records = [StepRecord(step=s, loss=1.0 / s, world_size=world_size, time=float(s),
                                              samples_seen=s * world_size, global_batch=world_size,
                                              compute_s=tuple(compute_s), generation=generation)
                                   for s in range(first, last + 1)]
        self.views[wid].report = replace(report, step=last)

    def die(self, wid: int, reason: str = "actor died: killed", silent_s: float = 0.3,
            cause: Cause | None = None) -> None:
        self.views[wid].status = DEAD
        self.views[wid].death = reason
        self.views[wid].death_cause = cause or (
            Cause.NODE_LOST if reason.startswith("node lost") else Cause.WORKER_DIED)
        self.views[wid].silent_s = silent_s


class FakeRecorder:
    """Keeps what it is told, in lists the tests read."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.logs: list[StepRecord] = []
        self.rollbacks: list[int] = []
        self.recoveries: list[dict[str, Any]] = []
        self.generations: list[tuple[int, int]] = []
        self.statuses: list[dict[str, Any]] = []
        self.commits: list[list[int]] = []
        self.stragglers: list[dict[str, Any]] = []
        self.fallbacks: list[dict[str, Any]] = []
        self.final_data: tuple[int, str | None] | None = None
        self.resumed_from: int | None = None

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record.step)

    def journal_state(self) -> RecordState:
        return RecordState(summary=None, metrics_step=max(self.steps, default=0),   # type: ignore[arg-type]
                           pending_lines=[], newest_commit=0, feed_next=1)

    def restore_journal(self, state: RecordState) -> None:
        self.steps = [s for s in self.steps if s <= state.metrics_step]

    def on_log(self, record: StepRecord) -> None:
        self.logs.append(record)

    def rollback_to(self, step: int) -> None:
        self.steps = [s for s in self.steps if s <= step]
        self.rollbacks.append(step)

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        self.recoveries.append(recovery)

    def on_final_data(self, samples_consumed: int, data_order: str | None) -> None:
        self.final_data = (samples_consumed, data_order)

    def on_commits(self, steps: list[int]) -> None:
        self.commits.append(list(steps))

    def on_straggler(self, flag: dict[str, Any]) -> None:
        self.stragglers.append(flag)

    def on_checkpoint_fallback(self, fallback: dict[str, Any]) -> None:
        self.fallbacks.append(fallback)

    def on_generation_start(self, step: int, world_size: int) -> None:
        self.generations.append((step, world_size))

    def resumed(self, step: int) -> None:
        self.resumed_from = step

    def correct_generation_start(self, step: int, *, resumed: bool = False) -> None:
        self.generations[-1] = (step, self.generations[-1][1])
        if resumed and self.resumed_from is not None:
            self.resumed_from = step

    def write_status(self, *, force: bool = False, **status: Any) -> None:
        self.statuses.append(status)


class FakeCheckpoints:
    def __init__(self, latest: int | None = None, fence: int | None = None):
        self.latest = latest
        self.fences: list[int] = [] if fence is None else [fence]
        self.start_steps: dict[int, int | None] = {}   # generation -> the start step recorded with it
        self.calls: list[tuple] = []           # ("fence", generation, start_step) and ("list",), in order
        self.stop: dict | None = None          # a STOP request (elastic stop), as read

    def latest_step(self) -> int | None:
        self.calls.append(("list",))
        return self.latest

    def committed_steps(self) -> list[int]:
        return [] if self.latest is None else [self.latest]

    def committed_since(self, step: int | None) -> list[int]:
        return [s for s in self.committed_steps() if step is None or s > step]

    def fence(self, generation: int, start_step: int | None = None) -> None:
        # Like advance_fence: a compare-and-swap to a generation never older; the same generation
        # again only records its start step.
        assert not self.fences or generation >= self.fences[-1], "generations must never go back"
        self.calls.append(("fence", generation, start_step))
        if not self.fences or generation > self.fences[-1]:
            self.fences.append(generation)
        if start_step is not None or generation not in self.start_steps:
            self.start_steps[generation] = start_step

    def current_fence(self) -> int | None:
        return self.fences[-1] if self.fences else None

    def stop_request(self) -> dict | None:
        return self.stop


class FakeLease:
    """The run's lease as the controller sees it: held until a test sets `lost_with`."""

    def __init__(self) -> None:
        self.lost_with: Exception | None = None

    def lost(self) -> Exception | None:
        return self.lost_with

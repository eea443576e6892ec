"""Fakes for driving the controller without Ray: a worker group, a recorder, checkpoints, a clock."""
from __future__ import annotations

from dataclasses import replace

from elastic._protocol import StepRecord, WorkerInfo, WorkerPhase, WorkerReport
from elastic._controller.worker_group import DEAD, READY, WorkerView
from elastic.policies import Cause


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeGroup:
    """Workers become ready at once, up to `capacity` live ones. Tests script their reports."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.views: dict[int, WorkerView] = {}
        self.killed: list[tuple[int, str]] = []
        self.generations: list[dict] = []
        self.stops: list[tuple[list[int], int]] = []
        self.cuts: list[bool] = []              # request_stop's cut_group, per call
        self.shut_down = False
        self._next = 0

    def live(self) -> list[int]:
        return [w for w, v in self.views.items() if v.status != DEAD]

    def scale_to(self, n: int) -> None:
        while len(self.live()) < min(n, self.capacity):
            wid, self._next = self._next, self._next + 1
            self.views[wid] = WorkerView(wid=wid, status=READY, info=WorkerInfo(100 + wid, "node", f"a{wid}", "ip"))

    def tick(self) -> dict[int, WorkerView]:
        out = {w: replace(v) for w, v in self.views.items()}
        for v in self.views.values():
            v.records = []
        return out

    def rendezvous_address(self, wid):
        return "127.0.0.1", 29500

    def start_generation(self, plans):
        self.generations.append(plans)
        for wid, plan in plans.items():
            self.set_report(wid, WorkerPhase.RUNNING, generation=plan.generation, rank=plan.rank,
                            step=plan.restore.step, has_state=True)

    def request_stop(self, wids, generation, cut_group=False):
        self.stops.append((list(wids), generation))
        self.cuts.append(cut_group)

    def kill(self, wid, reason):
        self.killed.append((wid, reason))
        self.views[wid].status = DEAD
        self.views[wid].death = reason
        self.views[wid].death_cause = Cause.WORKER_DIED

    def shutdown(self, graceful=True):
        self.shut_down = True

    # ---- scripting --------------------------------------------------------------------
    def set_report(self, wid, phase, *, generation, rank=0, step=0, has_state=True, **error):
        self.views[wid].report = WorkerReport(phase=phase, generation=generation, rank=rank, step=step,
                                              has_state=has_state, records=[], **error)

    def complete_steps(self, wid, first, last, world_size, compute_s=(), generation=None):
        report = self.views[wid].report
        generation = report.generation if generation is None else generation
        self.views[wid].records = [StepRecord(step=s, loss=1.0 / s, world_size=world_size, time=float(s),
                                              samples_seen=s * world_size, global_batch=world_size,
                                              compute_s=tuple(compute_s), generation=generation)
                                   for s in range(first, last + 1)]
        self.views[wid].report = replace(report, step=last)

    def die(self, wid, reason="actor died: killed", silent_s=0.3, cause=None):
        self.views[wid].status = DEAD
        self.views[wid].death = reason
        self.views[wid].death_cause = cause or (Cause.NODE_LOST if reason.startswith("node lost") else Cause.WORKER_DIED)
        self.views[wid].silent_s = silent_s


class FakeRecorder:
    def __init__(self):
        self.steps, self.recoveries, self.generations, self.statuses = [], [], [], []
        self.resumed_from = None

    def on_step(self, record):
        self.steps.append(record.step)

    def rollback_to(self, step):
        self.steps = [s for s in self.steps if s <= step]
        self.rollbacks = getattr(self, "rollbacks", []) + [step]

    def on_recovery(self, recovery):
        self.recoveries.append(recovery)

    def on_final_data(self, samples_consumed, data_order):
        self.final_data = (samples_consumed, data_order)

    def on_straggler(self, flag):
        self.stragglers = getattr(self, "stragglers", []) + [flag]

    def on_checkpoint_fallback(self, fallback):
        self.fallbacks = getattr(self, "fallbacks", []) + [fallback]

    def on_generation_start(self, step, world_size):
        self.generations.append((step, world_size))

    def load_previous_metrics(self, up_to_step):
        pass

    def correct_generation_start(self, step):
        self.generations[-1] = (step, self.generations[-1][1])

    def write_status(self, force=False, **status):
        self.statuses.append(status)


class FakeCheckpoints:
    def __init__(self, latest=None, fence=None):
        self.latest = latest
        self.fences = [] if fence is None else [fence]

    def latest_step(self):
        return self.latest

    def committed_steps(self):
        return [] if self.latest is None else [self.latest]

    def committed_since(self, step):
        return [s for s in self.committed_steps() if step is None or s > step]

    def fence(self, generation, start_step=None):
        assert not self.fences or generation >= self.fences[-1], "generations must never go back"
        self.fences.append(generation)

    def current_fence(self):
        return self.fences[-1] if self.fences else None

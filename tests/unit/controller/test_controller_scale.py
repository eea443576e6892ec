"""What keeps the controller's work per tick and per step linear in the ranks (issue 15): one
sort for every straggler score, compute times sent by one rank, sampled per-rank arrays in the
metrics lines, status.json's lists built when written, dead slots dropped (no Ray)."""
import random
import statistics
from collections import deque

import pytest
from fake_ray import Actor, FakeRay, spec_of
from fakes import FakeRecorder
from harness import make, start

import elastic._controller.placement as placement
import elastic._controller.ray_calls as ray_calls
import elastic._controller.worker_group as ray_group
from elastic._controller.intake import carries_compute_times
from elastic._controller.slot_table import DEAD, READY, Slot
from elastic._controller.stragglers import StragglerDetector, others_medians
from elastic._controller.worker_group import RayWorkerGroup
from elastic._protocol import COMPUTE_TIMES_PER_LINE, WorkerReport
from elastic.config import FailureConfig, ScalingConfig

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 10, 101, 1000])
def test_the_median_of_the_others_is_statistics_median_for_every_rank(n):
    rng = random.Random(n)
    for values in ([round(rng.uniform(0.9, 1.1), 2) for _ in range(n)],   # ties
                   [rng.uniform(0.0, 5.0) for _ in range(n)]):
        expected = [statistics.median(v for r, v in enumerate(values) if r != rank) for rank in range(n)]
        assert others_medians(values) == expected


class ReferenceDetector:
    """The O(N^2 log N) scoring the detector replaced, as it was: the semantics to keep."""

    def __init__(self, window, threshold, min_excess_s):
        self.window, self.threshold, self.min_excess_s = window, threshold, min_excess_s

    def reset(self, n):
        self.ratios = [deque(maxlen=self.window) for _ in range(n)]
        self.excess = [deque(maxlen=self.window) for _ in range(n)]
        self.flagged = {}

    def observe(self, step, compute_s):
        new = []
        for rank, own in enumerate(compute_s):
            others = statistics.median(c for r, c in enumerate(compute_s) if r != rank)
            if others <= 0:
                continue
            self.ratios[rank].append(own / others)
            self.excess[rank].append(own - others)
            if len(self.ratios[rank]) < self.window:
                continue
            score = statistics.median(self.ratios[rank])
            if score >= self.threshold and statistics.median(self.excess[rank]) >= self.min_excess_s:
                if rank not in self.flagged:
                    new.append((rank, step, score))
                self.flagged[rank] = (rank, step, score)
            elif score < 0.9 * self.threshold:
                self.flagged.pop(rank, None)
        return new


@pytest.mark.parametrize("window", [5, 8, 12])
def test_scores_flags_and_clearing_are_those_of_the_quadratic_scoring(window):
    rng, n = random.Random(window), 16
    fast = StragglerDetector(window=window, threshold=1.25, min_excess_s=0.01)
    slow = ReferenceDetector(window, 1.25, 0.01)
    fast.reset(n)
    slow.reset(n)
    for step in range(1, 300):
        # ranks turn slow and recover in phases; some steps have zeros (skipped ranks)
        times = [0.1 * rng.uniform(0.8, 1.2) * (1.6 if (r + step // 40) % 7 == 0 else 1.0) for r in range(n)]
        if step % 50 == 0:
            times = [0.0] * (n // 2 + 1) + times[n // 2 + 1:]
        got = [(f.rank, f.step, f.score) for f in fast.observe(step, times)]
        assert got == slow.observe(step, times), step
        assert {f.rank: (f.rank, f.step, f.score) for f in fast.flagged()} == slow.flagged, step


def test_compute_times_sent_by_one_rank_only_are_scored_whichever_tick_they_come_in():
    controller, group, clock, _ = make(min_workers=3, max_workers=3, capacity=3)   # window 20, threshold 1.35
    members = start(controller, group)
    slow = [0.1, 0.1, 0.2]
    group.complete_steps(members[0], 1, 1, 3)     # the generation's first step: its restore, no step time
    controller.tick()
    for step in range(2, 26):
        group.complete_steps(members[1], step, step, 3)                   # no compute times
        if step % 2:
            group.complete_steps(members[2], step, step, 3, compute_s=slow)   # in the same tick
            controller.tick()
        else:
            controller.tick()                                              # the times come a tick later
            group.complete_steps(members[2], step, step, 3, compute_s=slow)
            controller.tick()
    assert controller.step == 25 and controller.recorder.steps == list(range(1, 26))
    assert [f["rank"] for f in controller.recorder.stragglers] == [2]
    assert controller.recorder.stragglers[0]["step"] == 21         # steps 2..21: a window of 20


class Lines(FakeRecorder):
    def __init__(self):
        super().__init__()
        self.records = []

    def on_step(self, record):
        super().on_step(record)
        self.records.append(record)


@pytest.mark.parametrize("world", [3, COMPUTE_TIMES_PER_LINE, 4 * COMPUTE_TIMES_PER_LINE])
def test_per_rank_compute_times_reach_a_sample_of_the_metrics_lines_only(world):
    recorder = Lines()
    controller, group, clock, _ = make(min_workers=world, max_workers=world, capacity=world, recorder=recorder)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 8, world, compute_s=[0.1] * world)
    controller.tick()
    carried = [r.step for r in recorder.records if r.compute_s]
    assert carried == ([1, 2, 3, 4, 5, 6, 7, 8] if world <= COMPUTE_TIMES_PER_LINE else [4, 8])
    assert all(carries_compute_times(s, world) for s in carried)


def test_status_lists_are_built_when_written_from_the_ticks_members():
    controller, group, clock, _ = make(spare_workers=1, capacity=4)
    members = start(controller, group)
    status = controller.recorder.statuses[-1]
    assert callable(status["workers"]) and callable(status["spares"])
    assert [w["rank"] for w in status["workers"]()] == [0, 1, 2]
    assert [w["pid"] for w in status["workers"]()] == [100 + wid for wid in members]
    assert [s["pid"] for s in status["spares"]()] == [100 + wid for wid in group.live() if wid not in members]


def test_a_dead_slot_is_dropped_once_no_recovery_can_ask_about_it(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(ray_group, "ray", fake)
    monkeypatch.setattr(placement, "ray", fake)
    monkeypatch.setattr(ray_calls, "ray", fake)
    monkeypatch.setattr(ray_group, "remove_placement_group", lambda pg: None)
    now = [1000.0]
    failure = FailureConfig(heartbeat_timeout_s=5.0, collective_timeout_s=30.0, rendezvous_timeout_s=60.0)
    group = RayWorkerGroup(spec_of(ScalingConfig(min_workers=1, max_workers=2), failure), clock=lambda: now[0])
    report = WorkerReport(phase="running", generation=3, rank=0, step=0, has_state=True, records=[])
    for wid in (0, 1):
        group._slots.add(Slot(wid=wid, pg=None, pg_ready=None, created_at=0.0, status=READY,
                              actor=Actor(poll=report, request_stop=None)))
    group.kill(1, "test")
    assert group.tick()[1].status == DEAD           # the controller sees it dead
    now[0] += 2 * (5.0 + 30.0 + 60.0) - 1
    assert 1 in group.tick()                         # a recovery may still ask about it
    now[0] += 2
    assert sorted(group.tick()) == [0]
    group.kill(1, "again")                           # late calls about it are no-ops
    group.request_stop([0, 1], generation=3)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", [[], ["--node-agents"]])
def test_the_scale_benchmark_runs_and_agents_send_each_steps_record_once(mode):
    """benchmarks/controller_scale.py (S1) at a small N, so that the benchmark keeps working as
    the controller changes; through node agents the step records are sent once per node."""
    import json
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "controller_scale.py")
    done = subprocess.run([sys.executable, script, "--ranks", "64", "--reps", "1", "--compute-times", "one", *mode],
                          capture_output=True, text=True, timeout=25)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["node_agents"] == bool(mode) and out["recoveries_closed"] == 1
    # 64 ranks: every rank's answer carries a record (~680 B each), or one answer per node of 8 does.
    assert (out["record_bytes_per_step"] < 64 * 300) == bool(mode), out


def test_the_controller_process_collects_young_garbage_less_often_and_keeps_the_older_thresholds():
    import gc

    from elastic._controller.actor import GC_YOUNG_THRESHOLD, tune_gc
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 10, 10)
        gc.set_threshold(50_000, 5, 7)
        tune_gc()
        assert gc.get_threshold() == (50_000, 5, 7)          # never lowered
    finally:
        gc.set_threshold(*before)

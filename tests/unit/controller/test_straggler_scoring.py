"""Straggler scoring, the default eviction rule, and the controller acting on them (no Ray)."""
import random

import pytest
from harness import interrupt, make, start

from elastic._controller.states import RunState
from elastic._controller.stragglers import StragglerDetector
from elastic.policies import ScalingPolicy

pytestmark = pytest.mark.timeout(30)


def noisy(rng, base, n, slow_rank=None, s=1.0, jitter=0.15):
    return [base * (s if r == slow_rank else 1.0) * rng.uniform(1 - jitter, 1 + jitter) for r in range(n)]


def test_a_rank_that_stays_slow_is_flagged_once_after_a_window():
    detector, rng = StragglerDetector(window=12, threshold=1.25), random.Random(0)
    detector.reset(4)
    flags = []
    for step in range(1, 41):
        flags += detector.observe(step, noisy(rng, 0.05, 4, slow_rank=2, s=1.5))
    assert [f.rank for f in flags] == [2] and flags[0].step == 12
    assert 1.35 < flags[0].score < 1.65
    assert [f.rank for f in detector.flagged()] == [2]


def test_a_high_ratio_on_milliseconds_of_compute_is_not_a_straggler():
    # 1.5x on 10 ms costs the group 5 ms a step: below the floor, no flag; without it, flagged.
    for floor, expected in ((0.02, []), (0.0, [1])):
        detector, rng = StragglerDetector(window=12, threshold=1.25, min_excess_s=floor), random.Random(1)
        detector.reset(3)
        flags = []
        for step in range(1, 41):
            flags += detector.observe(step, noisy(rng, 0.01, 3, slow_rank=1, s=1.5))
        assert [f.rank for f in flags] == expected, floor


def test_two_ranks_one_slow_scores_against_the_other_not_against_itself():
    detector = StragglerDetector(window=5, threshold=1.25)
    detector.reset(2)
    for step in range(1, 6):
        flags = detector.observe(step, [0.10, 0.15])
    assert [(f.rank, round(f.score, 3)) for f in flags] == [(1, 1.5)]


def test_noise_and_one_off_hiccups_raise_no_flag():
    detector, rng = StragglerDetector(window=12, threshold=1.25), random.Random(1)
    detector.reset(4)
    flags = []
    for step in range(1, 501):
        times = noisy(rng, 0.05, 4, jitter=0.2)
        if step % 37 == 0:
            times[step % 4] *= 5        # a GC pause on one rank
        flags += detector.observe(step, times)
    assert flags == [] and detector.flagged() == []


def test_a_flag_clears_with_hysteresis_and_a_new_generation_starts_over():
    detector = StragglerDetector(window=3, threshold=1.25)
    detector.reset(3)
    for step in range(1, 4):
        detector.observe(step, [1.0, 1.0, 1.3])
    assert [f.rank for f in detector.flagged()] == [2]
    for step in range(4, 7):
        detector.observe(step, [1.0, 1.0, 1.2])       # under the threshold, above 90 % of it
    assert [f.rank for f in detector.flagged()] == [2]
    for step in range(7, 10):
        detector.observe(step, [1.0, 1.0, 1.0])
    assert detector.flagged() == []
    detector.reset(2)
    assert detector.observe(10, [1.0, 2.0]) == []     # a new window must fill first


@pytest.mark.parametrize("world, score, min_workers, evict", [
    (4, 1.5, 2, True),      # 1.5 > 4/3
    (2, 1.5, 1, False),     # 1.5 < 2/1
    (3, 1.4, 2, False),     # 1.4 < 3/2
    (3, 1.6, 2, True),
    (4, 3.0, 4, False),     # never below min_workers
])
def test_default_policy_evicts_only_when_the_group_goes_faster_without_the_rank(world, score, min_workers, evict):
    decision = ScalingPolicy().decide_eviction(rank=1, score=score, world_size=world, min_workers=min_workers)
    assert (decision is not None) == evict
    if evict:
        assert decision.target_world_size == world - 1


def run_slow_rank(controller, group, slow_rank, steps=12, s=1.5):
    members = controller.state.members
    n = len(members)
    group.complete_steps(members[0], 1, steps, n, compute_s=[0.1 * (s if r == slow_rank else 1.0) for r in range(n)])
    controller.tick()
    return members


def test_controller_flags_and_evicts_a_straggler_then_replaces_it():
    controller, group, clock, _ = make(min_workers=2, max_workers=4, capacity=4)
    members = start(controller, group)
    assert len(members) == 4
    run_slow_rank(controller, group, slow_rank=3, steps=22)
    # Step 1 of a generation carries its restore and is not scored: the window of 20 fills at 21.
    assert controller.recorder.stragglers == [{"rank": 3, "step": 21, "score": 1.5}]
    assert controller.state.state == RunState.RECOVERING and controller.recoveries.open.cause == "straggler"
    assert controller.state.evict == [members[3]] and members[3] not in [w for w, _ in group.killed]
    interrupt(group, members, 0, 22)       # every rank leaves at the same step boundary
    controller.tick()
    assert (members[3], "straggler evicted") in group.killed
    assert controller.state.state == RunState.RUNNING and controller.state.members == members[:3]
    group.complete_steps(members[0], 23, 23, 3)
    controller.tick()
    (recovery,) = controller.recorder.recoveries
    assert recovery["cause"] == "straggler" and recovery["rung"] == "warm" and recovery["to_world"] == 3
    assert recovery["lost_steps"] == 0 and controller.infra_failures == 0


def test_a_user_policy_that_never_evicts_is_obeyed():
    class NeverEvict(ScalingPolicy):
        def decide_eviction(self, **kwargs):
            return None

    controller, group, clock, _ = make(min_workers=2, max_workers=4, capacity=4, scaling_policy=NeverEvict())
    start(controller, group)
    run_slow_rank(controller, group, slow_rank=1, steps=30, s=3.0)
    assert [f["rank"] for f in controller.recorder.stragglers] == [1]
    assert controller.state.state == RunState.RUNNING and not group.killed


def test_two_workers_one_slow_is_flagged_but_kept():
    controller, group, clock, _ = make(min_workers=1, max_workers=2, capacity=2)
    start(controller, group)
    run_slow_rank(controller, group, slow_rank=0, steps=30)
    assert [f["rank"] for f in controller.recorder.stragglers] == [0]
    assert controller.state.state == RunState.RUNNING


def test_scoring_off_records_nothing():
    from elastic.config import FailureConfig
    controller, group, clock, _ = make(min_workers=2, max_workers=4, capacity=4,
                                       failure=FailureConfig(straggler_threshold=None))
    start(controller, group)
    run_slow_rank(controller, group, slow_rank=1, steps=30, s=3.0)
    assert getattr(controller.recorder, "stragglers", []) == []

"""The controller's state machine, driven by a fake worker group (no Ray)."""
from dataclasses import replace

import pytest
from fakes import FakeGroup
from harness import interrupt, make, start, stop_requested

from elastic._controller.controller import run_loop
from elastic._controller.slot_table import PENDING, READY, STARTING
from elastic._controller.states import RunState
from elastic._protocol import PositionReport, ThreadPlace, WorkerPhase
from elastic.config import FailureConfig
from elastic.errors import InsufficientWorkersError, TooManyFailuresError
from elastic.policies import FailureDecision, FailurePolicy, ScalingPolicy
from support import FakeClock

pytestmark = pytest.mark.timeout(30)


def test_happy_path_every_transition_is_announced():
    controller, group, clock, transitions = make()
    members = start(controller, group)
    assert len(members) == 3 and group.generations[0][members[0]].restore.kind == "fresh"
    group.complete_steps(members[0], 1, 100, 3)
    for rank, wid in enumerate(members):
        group.set_report(wid, WorkerPhase.FINISHED, generation=0, rank=rank, step=100)
    controller.tick()
    assert controller.state.state == RunState.FINISHED and controller.step == 100
    assert [t[1] for t in transitions] == [RunState.STARTING, RunState.RUNNING, RunState.FINISHED]
    run_loop(controller, sleep=lambda s: None)
    assert group.shut_down


@pytest.mark.parametrize("startup_wait_s", [5.0, 90.0])   # 90: longer than the rendezvous timeout (60)
def test_start_waits_startup_wait_s_for_max_workers_then_starts_with_the_ready_ones(startup_wait_s):
    controller, group, clock, _ = make(min_workers=2, max_workers=3, startup_wait_s=startup_wait_s)
    controller.tick()                                  # places 3 workers
    group.views[2].status = PENDING                    # the third's placement waits for resources
    clock.advance(startup_wait_s - 1)
    controller.tick()
    assert controller.state.state == RunState.SCHEDULING   # still waiting, and not failed
    clock.advance(2)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and sorted(controller.state.members) == [0, 1]


def test_a_worker_placed_and_starting_is_waited_for_up_to_starting_wait_s():
    """Review 3 (user), point 11: one of two workers still importing when startup_wait_s ran out
    made a run of world 1 that re-formed at step 1 (a 7 s scale-up). A placed worker is coming:
    it is waited for up to starting_wait_s (60 s)."""
    controller, group, clock, _ = make(min_workers=2, max_workers=3, startup_wait_s=10.0)
    controller.tick()
    group.views[2].status = STARTING                   # placed, its process still starting
    clock.advance(30)
    controller.tick()
    assert controller.state.state == RunState.SCHEDULING
    group.views[2].status = READY
    controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 3
    # One that never gets ready: the run starts with the others once starting_wait_s is over.
    controller, group, clock, _ = make(min_workers=2, max_workers=3, startup_wait_s=10.0)
    controller.tick()
    group.views[2].status = STARTING
    clock.advance(59)
    controller.tick()
    assert controller.state.state == RunState.SCHEDULING
    clock.advance(2)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and sorted(controller.state.members) == [0, 1]


def test_start_goes_at_once_when_the_last_worker_becomes_ready_within_the_wait():
    controller, group, clock, _ = make(min_workers=2, max_workers=3, startup_wait_s=90.0)
    controller.tick()
    group.views[2].status = STARTING
    clock.advance(30)
    controller.tick()
    group.views[2].status = READY
    controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 3


def test_resume_starts_from_the_latest_checkpoint():
    controller, group, _, _ = make(latest=40)
    members = start(controller, group)
    plan = group.generations[0][members[0]].restore
    assert plan.kind == "checkpoint" and plan.step == 40
    assert controller.recorder.resumed_from == 40 and controller.recorder.generations == [(40, 3)]


def test_dead_worker_rescales_warm_with_the_most_advanced_survivor_as_source():
    controller, group, clock, _ = make(capacity=3)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 10, 3)
    group.die(members[1])
    group.capacity = 2            # no room for a replacement yet
    controller.tick()
    assert controller.state.state == RunState.RECOVERING
    assert group.stops[-1] == ([members[0], members[2]], 0)
    assert group.cuts[-1] is True       # a member is lost: the survivors cut their connections
    interrupt(group, [members[0]], 0, 10)
    interrupt(group, [members[2]], 0, 11)      # rank 2 finished one more step than rank 0
    controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.generation == 1
    plans = group.generations[-1]
    assert [plans[w].rank for w in (members[2], members[0])] == [0, 1]
    assert plans[members[2]].restore.kind == "broadcast" and plans[members[2]].restore.source_rank == 0
    assert plans[members[2]].restore.step == 11 and plans[members[0]].world_size == 2
    group.complete_steps(members[2], 12, 12, 2)
    controller.tick()
    (recovery,) = controller.recorder.recoveries
    assert recovery["cause"] == "worker_died" and recovery["rung"] == "warm"
    assert recovery["from_world"] == 3 and recovery["to_world"] == 2 and recovery["lost_steps"] == 0
    assert controller.recorder.generations == [(0, 3), (11, 2)]
    assert group.generations[-1][members[2]].generation == 1 and controller.checkpoints.fences == [0, 1]


def test_survivors_already_out_of_the_broken_group_re_form_in_the_tick_that_sees_the_death():
    controller, group, clock, _ = make(capacity=3)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 10, 3)
    group.capacity = 2                       # no replacement: re-form with the two survivors
    # A peer's death breaks the survivors' collective before Ray reports the death itself.
    interrupt(group, [members[0], members[2]], 0, 10)
    group.die(members[1])
    controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.generation == 1
    assert sorted(group.generations[-1]) == sorted([members[0], members[2]])


def test_run_loop_waits_for_news_between_ticks_at_most_the_heartbeat_interval(monkeypatch):
    import time
    from types import SimpleNamespace
    group, ticks, slept, clock = FakeGroup(1), [], [], FakeClock(0.0)
    monkeypatch.setattr(time, "monotonic", clock)      # run_loop times its ticks by it

    def tick():
        ticks.append(1)
        if len(ticks) == 2:
            clock.advance(0.06)              # a slow tick: the next waits at least twice as long
        controller.done = len(ticks) == 3
    controller = SimpleNamespace(done=False, tick=tick, group=group, failure=FailureConfig(heartbeat_interval_s=0.2),
                                 state=SimpleNamespace(state=RunState.FINISHED))
    run_loop(controller, sleep=slept.append)
    assert len(ticks) == 3 and group.shut_down
    assert slept[0] == 0.01 and slept[1] >= 0.12                 # MIN_TICK_GAP_S; 2 x the slow tick
    assert [round(gap + wait, 6) for gap, wait in zip(slept, group.waits, strict=True)] == [0.2, 0.2]


def test_a_hot_spare_replaces_a_lost_member_at_once_and_is_itself_replaced():
    controller, group, clock, _ = make(min_workers=3, max_workers=3, capacity=4, spare_workers=1)
    members = start(controller, group)
    spare = next(w for w in group.live() if w not in members)
    assert len(members) == 3 and len(group.live()) == 4       # three members and one idle spare
    group.complete_steps(members[0], 1, 10, 3)
    group.capacity = 3                                         # no room for a new worker now
    group.die(members[1])
    controller.tick()
    interrupt(group, [members[0], members[2]], 0, 10)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.generation == 1
    assert sorted(controller.state.members) == sorted([members[0], members[2], spare])
    assert group.generations[-1][spare].world_size == 3        # back at full size without waiting
    group.capacity = 4
    controller.tick()
    # The spare that replaces it starts once the re-formed group has stepped, not during the
    # re-form (its start would take CPU the re-form needs).
    assert len(group.live()) == 3
    group.complete_steps(controller.state.members[0], 11, 11, 3)
    controller.tick()
    assert len(group.live()) == 4                              # a new spare is placed


def test_a_lost_group_starts_only_the_replacements_it_needs_until_it_steps_again():
    # Every member lost at once (a kill-all): the spare and two new workers re-form the group;
    # the spare that replaces the spare starts after the re-formed group's first step.
    controller, group, clock, _ = make(min_workers=3, max_workers=3, capacity=8, spare_workers=1)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 10, 3)
    for wid in members:
        group.die(wid)
    controller.tick()
    assert len(group.live()) == 3                  # the spare and two replacements, not a third
    controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 3
    new_rank0 = next(w for w, p in group.generations[-1].items() if p.rank == 0)
    group.complete_steps(new_rank0, 1, 1, 3)
    controller.tick()
    assert len(group.live()) == 4


def test_replacement_is_added_when_capacity_returns():
    controller, group, clock, _ = make(capacity=3)
    members = start(controller, group)
    group.die(members[1])
    group.capacity = 2
    controller.tick()
    interrupt(group, [members[0], members[2]], 0, 5)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 2
    group.capacity = 3
    controller.tick()             # the group places a new worker: a ready spare
    controller.tick()
    # No second rescale before the re-formed group has completed a step.
    assert controller.state.state == RunState.RUNNING
    group.complete_steps(controller.state.members[0], 6, 6, 2)
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and controller.state.voluntary
    survivors = controller.state.survivors
    for wid in survivors:
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=1, step=9)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 3


def test_hung_worker_is_killed_and_counted_as_hang():
    controller, group, clock, _ = make()
    members = start(controller, group)
    group.views[members[2]].silent_s = 5.5
    controller.tick()
    assert (members[2], "hang") in group.killed
    assert controller.state.state == RunState.RECOVERING and controller.failures[-1].cause == "hang"


def test_survivor_stuck_in_a_collective_is_replaced_cold():
    controller, group, clock, _ = make(capacity=4)
    members = start(controller, group)
    group.die(members[0])
    controller.tick()
    interrupt(group, [members[1]], 0, 7)       # members[2] stays RUNNING: stuck
    controller.tick()
    assert controller.state.state == RunState.RECOVERING
    clock.advance(1.5)                         # within the grace after the first survivor left
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and not any(w == members[2] for w, _ in group.killed)
    clock.advance(1.0)
    controller.tick()
    assert any(w == members[2] and "broken collective" in why for w, why in group.killed)
    assert controller.state.state == RunState.RUNNING
    assert controller.recoveries.open.rung == "cold"


def test_survivor_still_on_its_way_to_the_broken_collective_is_not_taken_for_stuck():
    # Seen in CI on a loaded machine: a TP survivor was still computing the step (it would fail
    # in the step's collective at once) 2.5 s after its peers left, and was killed as stuck: a
    # cold recovery instead of a warm one. Only a wait in a collective, as long as the grace,
    # proves a survivor stuck; while one still moves, the others may be waiting for it.
    controller, group, clock, _ = make(capacity=4)
    members = start(controller, group)
    group.die(members[0])
    controller.tick()
    interrupt(group, [members[1]], 0, 7)
    controller.tick()

    def answers_from(place: ThreadPlace, age_s: float) -> None:
        report = group.views[members[2]].report
        group.views[members[2]].report = replace(report, position=PositionReport(
            generation=0, place=place, step=7, nth=8, age_s=age_s))
        group.views[members[2]].silent_s = 0.0

    clock.advance(3.0)                         # past the grace, answering from its compute
    answers_from(ThreadPlace.COMPUTING, 2.9)
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and not group.killed[1:]
    clock.advance(1.0)                         # now in the step's gradient sync, but only just
    answers_from(ThreadPlace.SYNC, 0.5)
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and not group.killed[1:]
    clock.advance(2.0)                         # and still there, for longer than the grace: stuck
    answers_from(ThreadPlace.SYNC, 2.5)
    controller.tick()
    assert any(w == members[2] and "broken collective" in why for w, why in group.killed)
    assert controller.recoveries.open.rung == "cold"


def test_survivor_slow_to_answer_is_not_taken_for_stuck_and_stays_warm():
    # On a loaded machine a survivor may answer late: without an answer given after the grace
    # there is no evidence it is stuck, so it is not replaced, and it comes back warm.
    controller, group, clock, _ = make(capacity=4)
    members = start(controller, group)
    group.die(members[0])
    controller.tick()
    interrupt(group, [members[1]], 0, 7)       # members[2]'s last answer still says RUNNING
    controller.tick()
    clock.advance(2.5)                         # past the grace, but members[2] has not answered since
    group.views[members[2]].silent_s = 2.6
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and not group.killed[1:]
    group.views[members[2]].silent_s = 0.0     # it answers: it left the broken group too
    interrupt(group, [members[2]], 0, 7)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.recoveries.open.rung == "warm"
    assert set(controller.state.members) >= {members[1], members[2]}


def test_max_failures_exhausted_fails_with_the_causes_listed():
    controller, group, clock, _ = make(capacity=10, max_failures=1, min_workers=1, max_workers=2)
    members = start(controller, group)
    group.die(members[0])
    controller.tick()
    interrupt(group, [members[1]], 0, 3)
    controller.tick()
    members = controller.state.members
    group.views[members[0]].silent_s = 6.0
    controller.tick()
    assert controller.state.state == RunState.FAILED
    assert isinstance(controller.error["exception"], TooManyFailuresError)
    assert "worker_died" in controller.error["message"] and "hang" in controller.error["message"]


def test_user_error_fails_fast_without_recovery():
    controller, group, clock, _ = make()
    members = start(controller, group)
    boom = ValueError("bad batch")
    for rank, wid in enumerate(members):
        group.set_report(wid, WorkerPhase.FAILED, generation=0, rank=rank, step=4, error_type="ValueError",
                         error_message="bad batch", error_traceback="Traceback ...", error_kind="user", error=boom)
    controller.tick()
    assert controller.state.state == RunState.FAILED and controller.infra_failures == 0
    assert controller.error["exception"] is boom and controller.error["traceback"] == "Traceback ..."
    assert not controller.recorder.recoveries and not group.stops


def test_broken_collective_without_a_lost_peer_waits_a_heartbeat_timeout():
    controller, group, clock, _ = make()
    members = start(controller, group)
    interrupt(group, [members[0]], 0, 3)
    controller.tick()
    assert controller.state.state == RunState.RUNNING
    clock.advance(5.1)
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and controller.failures[-1].cause == "collective_error"


def test_below_min_without_replacements_fails_after_rendezvous_timeout():
    controller, group, clock, _ = make(min_workers=2, max_workers=2, capacity=2)
    members = start(controller, group)
    group.capacity = 1
    group.die(members[1])
    controller.tick()
    interrupt(group, [members[0]], 0, 3)
    controller.tick()
    assert controller.state.state == RunState.RECOVERING      # waiting for a replacement
    clock.advance(61)
    controller.tick()
    assert controller.state.state == RunState.FAILED
    assert isinstance(controller.error["exception"], InsufficientWorkersError)


def test_user_policies_are_obeyed():
    class NeverGrow(ScalingPolicy):
        def decide_resize(self, **kwargs):
            return None

    class AlwaysFail(FailurePolicy):
        def decide(self, failure, **kwargs):
            return FailureDecision("fail", "this policy never retries")

    controller, group, clock, _ = make(capacity=2, scaling_policy=NeverGrow())
    start(controller, group)
    group.capacity = 3
    for _ in range(3):
        controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 2

    controller, group, clock, _ = make(failure_policy=AlwaysFail())
    members = start(controller, group)
    group.die(members[0])
    controller.tick()
    assert controller.state.state == RunState.FAILED and "never retries" in controller.error["message"]


def test_no_workers_placed_fails_with_insufficient_workers():
    controller, group, clock, _ = make(capacity=1)
    controller.tick()
    clock.advance(61)
    controller.tick()
    assert controller.state.state == RunState.FAILED
    assert "min_workers=2" in controller.error["message"]


@pytest.mark.parametrize("fence", [0, 4])
def test_a_resumed_run_continues_the_generations_of_the_previous_one(fence):
    controller, group, _, _ = make(latest=40, fence=fence)
    members = start(controller, group)
    assert controller.generation == fence + 1 and group.generations[0][members[0]].generation == fence + 1
    assert controller.checkpoints.fences == [fence, fence + 1]


def error_report(group, wid, kind, error):
    group.set_report(wid, WorkerPhase.FAILED, generation=0, step=4, error_type=type(error).__name__,
                     error_message=str(error), error_traceback="tb", error_kind=kind, error=error)


def test_storage_error_is_recovered_and_counted():
    controller, group, _, _ = make(max_failures=3)
    members = start(controller, group)
    error_report(group, members[0], "infra", OSError("S3 503"))
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and controller.infra_failures == 1
    assert controller.failures[-1].cause == "storage_error"
    assert group.cuts == [False]        # no member lost: the group leaves at a step boundary


def test_fatal_error_fails_at_once_with_the_original_exception():
    controller, group, _, _ = make(max_failures=None)
    members = start(controller, group)
    fenced = RuntimeError("fenced")
    error_report(group, members[1], "fatal", fenced)
    controller.tick()
    assert controller.state.state == RunState.FAILED and controller.error["exception"] is fenced
    assert controller.infra_failures == 0


def test_a_user_policy_may_retry_user_errors_and_they_do_not_count():
    class RetryEverything(FailurePolicy):
        def decide(self, failure, **kwargs):
            return FailureDecision("recover", "retry all")

    controller, group, _, _ = make(max_failures=0, failure_policy=RetryEverything())
    members = start(controller, group)
    error_report(group, members[0], "user", ValueError("flaky"))
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and controller.infra_failures == 0
    interrupt(group, members[1:], 0, 4)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 3


def test_no_maximum_grows_while_the_cluster_has_room():
    controller, group, clock, _ = make(min_workers=2, max_workers=None, capacity=3)
    for _ in range(4):
        controller.tick()
        clock.advance(1.0)
    assert controller.state.state == RunState.SCHEDULING    # ready count still changing
    clock.advance(2.0)
    controller.tick()
    members = controller.state.members
    assert len(members) == 3          # everything that fits; the probe placement found no room
    group.capacity = 4
    controller.tick()                 # the probe is placed: a spare
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and controller.state.voluntary


def test_preempted_member_leaves_after_its_checkpoint_and_the_rest_go_on():
    controller, group, _, _ = make(capacity=3, max_failures=5)
    members = start(controller, group)
    group.capacity = 2
    for wid in members:        # every rank left the loop at the same boundary, after the commit
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=0, step=20)
    group.views[members[1]].report = replace(group.views[members[1]].report, preempted=True)
    controller.tick()      # the others are out of the loop already: re-formed in the same tick
    assert (members[1], "preempted") in group.killed
    assert controller.state.state == RunState.RUNNING and controller.state.members == [members[0], members[2]]
    assert group.generations[-1][members[0]].restore.step == 20
    assert controller.failures[-1].cause == "preempted"


def test_the_step_workers_really_restored_wins_over_the_planned_one():
    controller, group, _, _ = make(latest=20)
    members = start(controller, group)
    assert controller.recorder.resumed_from == 20          # the plan: the newest manifest
    # The newest checkpoint failed its checksums: the ranks loaded step 10 instead.
    group.views[members[0]].report = replace(group.views[members[0]].report, step=10, restored_step=10)
    controller.tick()
    assert controller.recorder.resumed_from == 10 and controller.recorder.generations == [(10, 3)]
    assert controller.step == 10


def test_polls_are_held_while_a_generation_trains_recovers_or_stops():
    controller, group, clock, _ = make()
    controller.tick()
    assert group.poll_hold_s == 0.0                  # scheduling: answers at once
    members = start(controller, group)
    controller.tick()
    assert group.poll_hold_s == 1.0                  # running: min(1 s, heartbeat_timeout_s 5 / 5)
    group.die(members[1])
    controller.tick()                                 # -> recovering
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and group.poll_hold_s == 1.0


def test_a_running_groups_polls_wake_at_the_hang_bound_the_controller_judges_by():
    controller, group, clock, _ = make()
    members = start(controller, group)
    controller.tick()
    assert group.poll_wake_s is None                 # no step times learned yet: no bound
    # Rank 0's answer brings 20 step times of 0.6 s: the bound is 4 x 0.6 s, above the 2 s floor,
    # and the polls sent from the next tick on carry it.
    position = PositionReport(generation=0, place=ThreadPlace.COMPUTING, step=20, nth=21, age_s=0.1,
                              step_times=(0.6,) * 20, exchanged=20)
    group.set_report(members[0], WorkerPhase.RUNNING, generation=0, step=20)
    group.views[members[0]].report = replace(group.views[members[0]].report, position=position)
    controller.tick()
    controller.tick()
    assert group.poll_wake_s == pytest.approx(2.4) == controller.running.hangs.bound(controller.failure)
    group.die(members[1])
    controller.tick()                                 # -> recovering
    controller.tick()                                 # no hang is judged there: no wake
    assert controller.state.state == RunState.RECOVERING and group.poll_wake_s is None


def test_a_grow_stops_at_the_scaling_policys_target_world_size():
    class GrowByOne(ScalingPolicy):
        def decide_resize(self, *, world_size, ready_spares, min_workers, max_workers):
            decision = super().decide_resize(world_size=world_size, ready_spares=ready_spares,
                                             min_workers=min_workers, max_workers=max_workers)
            return decision and type(decision)(world_size + 1, "one at a time")

    controller, group, clock, _ = make(min_workers=2, max_workers=4, capacity=4, scaling_policy=GrowByOne())
    controller.tick()
    group.capacity = 2                     # only two are placed before the start
    for wid in group.live()[2:]:
        group.die(wid)
    controller.tick()
    clock.advance(11)                      # startup_wait_s: start with the two ready
    controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 2
    group.capacity = 4
    controller.tick()                      # two spares placed ...
    controller.tick()                      # ... and ready: grow
    assert controller.state.state == RunState.RECOVERING and controller.state.target_world == 3
    for wid in controller.state.survivors:
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=controller.generation, step=3)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and len(controller.state.members) == 3


def test_a_stop_request_preempts_every_member_and_ends_the_run_stopped():
    controller, group, clock, transitions = make()
    members = stop_requested(controller, group)
    assert controller.state.state == RunState.STOPPING and group.preempted == [members]
    assert not group.killed
    # Ranks 0 and 1 committed step 8 and left; rank 2 is still at its boundary: wait for it.
    for rank, wid in enumerate(members[:2]):
        group.set_report(wid, WorkerPhase.FINISHED, generation=0, rank=rank, step=8)
    controller.tick()
    assert controller.state.state == RunState.STOPPING
    group.set_report(members[2], WorkerPhase.FINISHED, generation=0, rank=2, step=8)
    controller.tick()
    assert controller.state.state == RunState.STOPPED and controller.done and not group.killed
    assert controller.state.reason == "maintenance"
    run_loop(controller, sleep=lambda s: None)
    assert group.shut_down


def test_a_member_still_training_at_the_stops_deadline_is_killed():
    controller, group, clock, _ = make()
    members = start(controller, group)
    controller.checkpoints.stop = {"format": 1}
    controller.tick()
    assert controller.state.state == RunState.STOPPING
    clock.advance(36)                      # collective + heartbeat timeouts
    controller.tick()
    assert controller.state.state == RunState.STOPPED
    assert sorted(w for w, _ in group.killed) == sorted(members)


def _fsdp_interrupt(group, held, generation, step, at):
    """FSDP survivors (no full state) out of generation `generation` at step `at`, with their
    copies in memory: `held` maps worker -> the old ranks whose copies it holds, at `step`."""
    from elastic._protocol import ReplicaHeld
    for wid, ranks in held.items():
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=generation, step=at, has_state=False,
                         replicas=ReplicaHeld(generation, 3, step, ranks),
                         error_type="RuntimeError", error_message="gloo: Connection reset by peer")


@pytest.mark.parametrize(("latest", "rung"), [(None, "memory"), (8, "memory"), (12, "checkpoint")])
def test_fsdp_survivors_with_every_ranks_copy_restore_from_memory_unless_a_checkpoint_is_newer(latest, rung):
    # Copies every 5 steps (the last at 10), a checkpoint maybe at 12, the fault at 13.
    controller, group, clock, _ = make(capacity=3, latest=latest)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 13, 3)
    group.die(members[1])            # old rank 1: its copy is held by old rank 2
    group.capacity = 2
    controller.tick()
    _fsdp_interrupt(group, {members[0]: (0, 2), members[2]: (2, 1)}, 0, 10, at=13)
    controller.tick()
    plans = group.generations[-1]
    restore = plans[members[0]].restore
    if rung == "memory":
        assert restore.kind == "memory" and restore.step == 10 and restore.replica is not None
        new_rank = {w: p.rank for w, p in plans.items()}
        assert restore.replica.holders == (new_rank[members[0]], new_rank[members[2]], new_rank[members[2]])
    else:
        assert restore.kind == "checkpoint" and restore.step == 12
    group.complete_steps(members[0], restore.step + 1, restore.step + 1, 2)
    controller.tick()
    (recovery,) = controller.recorder.recoveries
    assert recovery["rung"] == rung and recovery["lost_steps"] == 13 - restore.step
    assert ("no storage read" in recovery["reason"]) == (rung == "memory")
    if rung == "checkpoint":
        assert recovery["reason"] == "the newest checkpoint (step 12) is ahead of the copies in memory (step 10)"


def test_fsdp_survivors_missing_two_neighbours_copies_take_the_checkpoint_and_say_why():
    controller, group, clock, _ = make(min_workers=1, capacity=3, latest=5)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 11, 3)
    group.die(members[1])
    group.die(members[2])            # old ranks 1 and 2: 1's copy was on 2
    group.capacity = 1
    controller.tick()
    _fsdp_interrupt(group, {members[0]: (0, 2)}, 0, 10, at=11)
    controller.tick()
    assert group.generations[-1][members[0]].restore.kind == "checkpoint"
    group.complete_steps(members[0], 6, 6, 1)
    controller.tick()
    (recovery,) = controller.recorder.recoveries
    assert recovery["rung"] == "checkpoint" and "rank(s) [1]" in recovery["reason"]


def test_a_stop_whose_commit_failed_on_its_members_fails_the_run_not_stopped():
    """R3-2: a member leaving the stop with its commit refused reports FAILED (check_committed
    raised); the run must say so, not end "stopped" with the step uncommitted."""
    controller, group, clock, _ = make()
    members = stop_requested(controller, group)
    for rank, wid in enumerate(members):
        group.set_report(wid, WorkerPhase.FAILED, generation=0, rank=rank, step=8, error_kind="infra",
                         error_type="CheckpointError",
                         error_message="the checkpoint of step 8, taken before the group changes, was not committed")
    controller.tick()
    assert controller.state.state == RunState.FAILED
    assert "was not committed" in controller.error["message"] and "did not commit" in controller.state.reason


def test_a_survivor_leaving_a_broken_group_with_a_nonfinite_loss_fails_the_run_not_a_warm_re_form():
    """R3-3: a step whose exchange was abandoned (the group broke) had a non-finite loss; the
    survivor reports it as the user's error. A warm re-form would restore and commit that step."""
    controller, group, clock, _ = make()
    members = start(controller, group)
    group.complete_steps(members[0], 1, 9, 3)
    controller.tick()
    group.die(members[2])
    controller.tick()
    assert controller.state.state == RunState.RECOVERING
    interrupt(group, [members[0]], 0, 10)
    group.set_report(members[1], WorkerPhase.FAILED, generation=0, rank=1, step=10, error_kind="user",
                     error_type="NonFiniteLossError", error_message="the loss of step 10 is nan")
    controller.tick()
    assert controller.state.state == RunState.FAILED and controller.generation == 0
    assert controller.error["type"] == "NonFiniteLossError"

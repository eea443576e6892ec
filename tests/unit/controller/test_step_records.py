"""The controller takes each step's record once, from any rank, and never one a restore discarded;
failures that happen while a recovery is open are listed in it (fake worker group, no Ray)."""
import pytest
from harness import interrupt, make, start

from elastic._controller.states import RunState
from elastic._protocol import WorkerPhase

pytestmark = pytest.mark.timeout(30)


def test_steps_rank_0_never_reported_come_from_a_survivor_once_each():
    controller, group, clock, _ = make(capacity=3)
    members = start(controller, group)
    for wid in members:                       # every rank holds the records of steps 1..5
        group.complete_steps(wid, 1, 5, 3)
    controller.tick()
    assert controller.recorder.steps == [1, 2, 3, 4, 5]     # each step once, not once per rank
    group.complete_steps(members[1], 6, 9, 3)    # rank 0 completed 6..9 too, but dies before its poll
    group.complete_steps(members[2], 6, 8, 3)
    group.die(members[0])
    group.capacity = 2
    controller.tick()
    assert controller.state.state == RunState.RECOVERING
    assert controller.recorder.steps == list(range(1, 10))
    interrupt(group, [members[1]], 0, 9)
    interrupt(group, [members[2]], 0, 8)
    controller.tick()
    assert controller.state.state == RunState.RUNNING
    source = group.generations[-1][members[1]]
    assert source.rank == 0 and source.restore.kind == "broadcast" and source.restore.step == 9
    group.complete_steps(members[2], 10, 11, 2)  # the new generation's rank 1 reports first
    controller.tick()
    group.complete_steps(members[1], 10, 11, 2)
    controller.tick()
    assert controller.recorder.steps == list(range(1, 12))
    (recovery,) = controller.recorder.recoveries
    assert recovery["lost_steps"] == 0 and recovery["step"] == 9


def test_records_past_a_checkpoint_restore_are_not_taken():
    controller, group, clock, _ = make(capacity=3)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 12, 3)
    controller.tick()
    group.die(members[0])
    group.capacity = 2
    controller.tick()
    controller.checkpoints.latest = 10
    for wid in members[1:]:                      # no warm state (FSDP): the checkpoint of step 10
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=0, step=12, has_state=False)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and group.generations[-1][members[1]].restore.step == 10
    assert controller.recorder.steps == list(range(1, 11)) and controller.recorder.rollbacks == [10]
    # A survivor's records of the lost attempts of 11..13 arrive late: they are not the run's.
    group.complete_steps(members[2], 11, 13, 3, generation=0)
    controller.tick()
    assert controller.recorder.steps == list(range(1, 11))
    group.complete_steps(members[1], 11, 12, 2)
    controller.tick()
    assert controller.recorder.steps == list(range(1, 13))
    (recovery,) = controller.recorder.recoveries
    assert recovery["rung"] == "checkpoint" and recovery["lost_steps"] == 2


def test_a_failure_before_the_reformed_group_steps_joins_the_open_recovery():
    controller, group, clock, _ = make(capacity=4, max_failures=5, unix_wall=True)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 5, 3)
    group.die(members[1])
    controller.tick()
    interrupt(group, [members[0], members[2]], 0, 5)
    clock.advance(1.0)
    controller.tick()
    new_members = controller.state.members
    assert controller.state.state == RunState.RUNNING and len(new_members) == 3
    group.capacity = 2                           # no room for another replacement
    clock.advance(2.0)
    group.die(new_members[2], silent_s=0.5)      # before the re-formed group completed a step
    controller.tick()
    assert controller.state.state == RunState.RECOVERING
    interrupt(group, new_members[:2], 1, 5)
    controller.tick()
    assert controller.state.state == RunState.RUNNING
    group.complete_steps(controller.state.members[0], 6, 6, 2)
    clock.advance(1.0)
    controller.tick()
    (recovery,) = controller.recorder.recoveries
    assert recovery["cause"] == "worker_died" and recovery["from_world"] == 3 and recovery["to_world"] == 2
    assert [(f["cause"], f["ranks"]) for f in recovery["failures"]] == [("worker_died", [1]), ("worker_died", [2])]
    first, second = (f["detected_at"] for f in recovery["failures"])
    assert recovery["detected_at"] == first == 1.7e9 + 1000.0 and second - first == pytest.approx(3.0)
    assert recovery["recovered_at"] == pytest.approx(first + 4.0) and recovery["recover_s"] == pytest.approx(4.0)


def test_a_survivor_lost_while_recovering_is_listed_once():
    controller, group, clock, _ = make(capacity=4, max_failures=5)
    members = start(controller, group)
    group.die(members[0])
    controller.tick()
    interrupt(group, [members[1]], 0, 4)
    group.views[members[2]].silent_s = 6.0       # hangs before it left the broken group
    controller.tick()
    controller.tick()
    assert (members[2], "hang during recovery") in group.killed
    group.complete_steps(controller.state.members[0], 5, 5, 2)
    controller.tick()
    (recovery,) = controller.recorder.recoveries
    assert [(f["cause"], f["ranks"]) for f in recovery["failures"]] == [("worker_died", [0]), ("hang", [2])]
    assert recovery["rung"] == "cold"

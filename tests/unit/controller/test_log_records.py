"""ctx.log records at the controller: at their step, counting no step, one per (generation, step,
keys), the lowest rank's; none of a step a restore discarded (fake worker group, no Ray)."""
import pytest
from harness import interrupt, make, start

from elastic._controller.states import RunState
from elastic._protocol import StepRecord, WorkerPhase

pytestmark = pytest.mark.timeout(30)


def make_with_logs(**kwargs):
    controller, group, clock, transitions = make(**kwargs)     # FakeRecorder keeps the log records
    return controller, group, clock


def send_log(group, wid, step, generation=None, **metrics):
    report = group.views[wid].report
    group.views[wid].records.append(StepRecord(
        step=step, loss=None, world_size=3, time=float(step) + 0.5, samples_seen=3 * step, global_batch=3,
        metrics=metrics, generation=report.generation if generation is None else generation, kind="log"))


def logged(controller):
    return [(r.step, r.metrics) for r in controller.recorder.logs]


def test_a_log_record_is_recorded_at_its_step_and_counts_no_step():
    controller, group, clock = make_with_logs()
    members = start(controller, group)
    scored = []
    controller.intake._score_stragglers = lambda state, record: scored.append(record)
    group.complete_steps(members[0], 1, 5, 3)
    send_log(group, members[0], 5, val_loss=0.5)
    controller.tick()
    assert logged(controller) == [(5, {"val_loss": 0.5})]
    assert controller.recorder.steps == [1, 2, 3, 4, 5] and controller.step == 5
    assert [r.step for r in scored] == [1, 2, 3, 4, 5]          # the log record is no step time
    send_log(group, members[0], 5, val_acc=0.9)                 # other keys at the same step: a record of its own
    controller.tick()
    assert logged(controller) == [(5, {"val_loss": 0.5}), (5, {"val_acc": 0.9})]
    assert controller.recorder.steps == [1, 2, 3, 4, 5] and controller.step == 5


def test_every_rank_logs_the_same_values_and_only_the_lowest_ranks_record_is_kept():
    controller, group, clock = make_with_logs()
    members = start(controller, group)
    for wid in members:
        group.complete_steps(wid, 1, 5, 3)
    send_log(group, members[2], 5, val=2.0)
    send_log(group, members[1], 5, val=1.0)
    controller.tick()
    assert logged(controller) == []       # rank 0 may still send its own: it has not reported past step 5
    send_log(group, members[0], 5, val=0.0)
    controller.tick()
    assert logged(controller) == [(5, {"val": 0.0})]
    send_log(group, members[1], 5, val=1.0)                     # a late copy
    controller.tick()
    assert logged(controller) == [(5, {"val": 0.0})]
    for wid in members:                                          # every rank is past step 5 ...
        group.complete_steps(wid, 6, 6, 3)
    controller.tick()
    assert controller.intake._logs._taken == {}                 # ... so its key is forgotten


def test_a_record_only_a_higher_rank_sent_goes_once_the_lower_ranks_are_past_its_step():
    controller, group, clock = make_with_logs()
    members = start(controller, group)
    group.complete_steps(members[2], 1, 3, 3)
    send_log(group, members[2], 3, val=2.0)
    controller.tick()
    assert logged(controller) == []
    group.complete_steps(members[0], 1, 4, 3)
    controller.tick()
    assert logged(controller) == []                  # rank 1 has not reported past step 3 yet
    group.complete_steps(members[1], 1, 4, 3)
    controller.tick()
    assert logged(controller) == [(3, {"val": 2.0})]


def test_a_lower_rank_that_died_or_left_the_loop_holds_nothing_back():
    controller, group, clock = make_with_logs(capacity=3)
    members = start(controller, group)
    group.complete_steps(members[2], 1, 3, 3)
    send_log(group, members[2], 3, val=2.0)
    group.die(members[0])
    interrupt(group, [members[1]], 0, 3)
    controller.tick()
    assert logged(controller) == [(3, {"val": 2.0})]


def test_log_records_of_steps_a_restore_discarded_are_not_taken():
    controller, group, clock = make_with_logs(capacity=3)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 12, 3)
    controller.tick()
    group.die(members[0])
    group.capacity = 2
    controller.tick()
    controller.checkpoints.latest = 10
    for wid in members[1:]:                      # no warm state: back to the checkpoint of step 10
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=0, step=12, has_state=False)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.generation == 1
    send_log(group, members[2], 12, generation=0, val=12.0)      # the lost attempt's, late
    send_log(group, members[2], 10, generation=0, val=10.0)      # of the restored step: kept
    controller.tick()
    assert logged(controller) == [(10, {"val": 10.0})]
    new_rank0 = controller.state.members[0]
    group.complete_steps(new_rank0, 11, 12, 2)
    send_log(group, new_rank0, 12, val=12.5)                     # the redone step's
    controller.tick()
    assert logged(controller) == [(10, {"val": 10.0}), (12, {"val": 12.5})]
    assert controller.recorder.steps == list(range(1, 13))


def test_the_last_steps_log_records_go_when_the_ranks_finish_or_the_run_ends():
    controller, group, clock = make_with_logs()
    members = start(controller, group)
    group.complete_steps(members[1], 1, 100, 3)
    send_log(group, members[1], 100, val=1.0)
    for rank, wid in enumerate(members):
        group.set_report(wid, WorkerPhase.FINISHED, generation=0, rank=rank, step=100)
    controller.tick()
    assert controller.state.state == RunState.FINISHED
    assert logged(controller) == [(100, {"val": 1.0})]
    # A record still held when the run ends (its lower rank never settled) goes at the end.
    controller, group, clock = make_with_logs()
    members = start(controller, group)
    group.complete_steps(members[1], 1, 3, 3)
    send_log(group, members[1], 3, val=3.0)
    controller.tick()
    assert logged(controller) == []
    controller.flush_logs()
    assert logged(controller) == [(3, {"val": 3.0})]

"""The run's time ledger (elastic._controller.time_ledger): every second of the wall time in one
part, on a scripted timeline (pure, fake times) and on a scripted controller run with faults
(fakes, no Ray) written through the real run record."""
import json
from dataclasses import replace

import pytest
from fakes import FakeCheckpoints, FakeGroup

from elastic._controller.controller import Controller
from elastic._controller.run_record import RunRecorder
from elastic._controller.states import RunState
from elastic._controller.time_ledger import RECOVERY_PARTS, LedgerPart, TimeLedger
from elastic._protocol import StepRecord, WorkerPhase
from elastic.config import FailureConfig, ScalingConfig
from run_file_schemas import validate
from support import FakeClock

pytestmark = pytest.mark.timeout(30)

PARTS = {"productive", "redone", "detection", "reform", "restore", "checkpoint_stall", "startup", "waiting"}


def approx(parts):
    return {k: pytest.approx(v, abs=1e-3) for k, v in parts.items()}


def test_the_parts_are_the_summarys_keys():
    assert {p.value for p in LedgerPart} == PARTS
    assert {p.value for p in RECOVERY_PARTS} == {"detection", "reform", "restore", "redone"}


def test_a_run_with_a_checkpoint_stall_a_failure_and_a_rollback_is_split_second_by_second():
    ledger = TimeLedger(100.0)
    ledger.placed(104.0)                          # 4 s waiting for workers
    ledger.generation_started(105.0)
    ledger.step(1, 110.0)                         # start-up: placement to the first step
    ledger.step(2, 111.0)
    ledger.step(3, 112.0)
    ledger.step(4, 114.0, stall_s=1.2)            # blocked 1.2 s saving step 3's checkpoint
    # A rank dies at 114.5, detected at 115; the group re-forms from step 3 (step 4 is lost).
    ledger.rollback_to(3)
    ledger.generation_started(117.0)
    ledger.recovery_closed(115.0, 0.5)
    recovery = ledger.step(4, 120.0, restore_s=1.5)
    # In flight 0.5 s and the lost step 4 (2 s) redone; one ordinary step (0.96 s smoothed) of the
    # first step is productive; the rest from detection on, less the restore, is re-form.
    assert recovery == approx({"detection": 0.5, "reform": 2.54, "restore": 1.5, "redone": 2.5})
    ledger.step(5, 121.0)
    parts = ledger.close(125.0, "finished")      # the tail: the final commit
    assert parts == approx({"waiting": 4.0, "startup": 6.0, "productive": 3.96, "checkpoint_stall": 4.0,
                            "redone": 2.5, "detection": 0.5, "reform": 2.54, "restore": 1.5})
    assert sum(parts.values()) == pytest.approx(25.0, abs=1e-3)


def test_a_resize_has_no_detection_and_loses_no_step_in_flight():
    ledger = TimeLedger(0.0)
    ledger.placed(1.0)
    ledger.step(1, 2.0)
    ledger.step(2, 3.0)
    # The controller asked for a resize at 2.5; the group left at step 2's boundary (3.0). Of the
    # 3 s to the next step, 0.5 s restore and one ordinary step (1 s) are not re-form.
    ledger.generation_started(4.0)
    ledger.recovery_closed(2.5, 0.0)
    assert ledger.step(3, 6.0, restore_s=0.5) == approx(
        {"detection": 0.0, "reform": 1.5, "restore": 0.5, "redone": 0.0})
    assert sum(ledger.close(6.0, "finished").values()) == pytest.approx(6.0)


def test_a_preemption_notice_keeps_its_steps_and_its_leaving_is_reform_not_redone():
    ledger = TimeLedger(0.0)
    ledger.placed(1.0)
    ledger.step(1, 2.0)
    ledger.step(2, 3.0)
    # A notice: the group left at step 2's boundary; the controller heard of it at 3.8 (a commit,
    # if any, and leaving the loop), detect_s 0. No step is lost: 0.8 s of re-form, not redone.
    ledger.generation_started(4.0)
    ledger.recovery_closed(3.8, 0.0, in_flight_kept=True)
    assert ledger.step(3, 5.5, restore_s=0.2) == approx(
        {"detection": 0.0, "reform": 1.3, "restore": 0.2, "redone": 0.0})
    parts = ledger.close(5.5, "finished")
    assert parts["redone"] == 0.0 and sum(parts.values()) == pytest.approx(5.5)


def test_records_out_of_order_or_from_a_clock_ahead_never_count_twice():
    ledger = TimeLedger(0.0)
    ledger.placed(1.0)
    ledger.step(1, 5.0)
    ledger.step(2, 4.0)                 # before the cursor: no seconds
    ledger.recovery_closed(3.0, 10.0)   # "detected" before the last step: nothing before it is moved
    ledger.step(3, 7.0)
    parts = ledger.close(7.0, "finished")
    assert sum(parts.values()) == pytest.approx(7.0) and min(parts.values()) >= 0


def test_a_step_recorded_again_moves_the_lost_attempts_to_redone():
    ledger = TimeLedger(0.0)
    ledger.placed(0.0)
    for n in (1, 2, 3):
        ledger.step(n, float(n))
    ledger.step(2, 10.0)                # redone without an explicit rollback
    parts = ledger.close(10.0, "finished")
    # Step 1 is start-up; steps 2 and 3 (1 s each) were lost; step 2 again took 7 s.
    assert parts == approx({**dict.fromkeys(PARTS, 0.0), "startup": 1.0, "redone": 2.0, "productive": 7.0})


@pytest.mark.parametrize(("placed", "stepped", "status", "tail"), [
    (False, False, "failed", "waiting"), (True, False, "failed", "startup"),
    (True, True, "failed", "reform"), (True, True, "stopped", "checkpoint_stall")])
def test_the_tail_after_the_last_event_goes_where_the_run_stood(placed, stepped, status, tail):
    ledger = TimeLedger(0.0)
    if placed:
        ledger.placed(1.0)
    if stepped:
        ledger.step(1, 2.0)
    parts = ledger.close(10.0, status)
    assert parts[tail] == pytest.approx(10.0 - (2.0 if stepped else 1.0 if placed else 0.0))
    assert sum(parts.values()) == pytest.approx(10.0)


def test_a_recovery_the_run_finished_in_ends_at_the_end():
    ledger = TimeLedger(0.0)
    ledger.placed(0.0)
    ledger.step(1, 1.0)
    ledger.recovery_closed(2.0, 0.5)
    assert ledger.settle(4.0) == approx({"detection": 0.5, "reform": 2.0, "restore": 0.0, "redone": 0.5})
    assert sum(ledger.close(5.0, "finished").values()) == pytest.approx(5.0)


# ---- a scripted controller run, through the real run record ----------------------------

def run_steps(group, clock, wid, first, last, *, step_s=0.5, **fields):
    """Worker `wid` completes steps first..last, one every `step_s` of the fake clock."""
    report = group.views[wid].report
    records = []
    for n in range(first, last + 1):
        clock.advance(step_s)
        records.append(StepRecord(step=n, loss=1.0, world_size=3, time=clock.now, samples_seen=n, global_batch=3,
                                  generation=report.generation, **(fields if n == first else {})))
    group.views[wid].records = records
    group.views[wid].report = replace(report, step=last)


def test_a_controller_run_with_faults_has_a_ledger_that_sums_to_its_wall_time(tmp_path):
    clock, group = FakeClock(), FakeGroup(capacity=3)
    started = clock.now
    recorder = RunRecorder(str(tmp_path), None, total_steps=40, config={}, clock=clock)
    controller = Controller(
        group, recorder, FakeCheckpoints(),
        scaling=ScalingConfig(min_workers=2, max_workers=3, startup_wait_s=10.0),
        failure=FailureConfig(max_failures=5, heartbeat_timeout_s=5.0, collective_timeout_s=30.0,
                              rendezvous_timeout_s=60.0),
        total_steps=40, clock=clock, wall_clock=clock)
    controller.tick()                       # scheduling: places workers
    clock.advance(3.0)                      # ... which take 3 s to be ready
    controller.tick()
    assert controller.state.state == RunState.RUNNING
    members = controller.state.members
    clock.advance(2.0)                      # joining, restoring, the first step's compute
    run_steps(group, clock, members[0], 1, 10, checkpoint_stall_s=0.0)
    controller.tick()
    # A rank dies 0.3 s before the controller sees it; the survivors leave 1 s later.
    clock.advance(1.0)
    group.die(members[1], silent_s=0.3)
    group.capacity = 2
    controller.tick()
    clock.advance(1.0)
    for rank, wid in ((0, members[0]), (2, members[2])):
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=0, rank=rank, step=10,
                         error_type="RuntimeError", error_message="gloo: Connection reset by peer")
    controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.generation == 1
    clock.advance(1.5)                      # the new group's join and restore (1 s of it restore)
    run_steps(group, clock, controller.state.members[0], 11, 30, restore_s=1.0)
    controller.tick()
    for rank, wid in enumerate(controller.state.members):
        group.set_report(wid, WorkerPhase.FINISHED, generation=1, rank=rank, step=30)
    controller.tick()
    assert controller.state.state == RunState.FINISHED
    clock.advance(0.5)                      # the final commit and hash
    summary = recorder.write_summary(status="finished", final_step=30, checkpoints=[], model_sha256=None, error=None)
    validate("summary.json", json.loads((tmp_path / "summary.json").read_text()))
    ledger, wall_s = summary["time_ledger"], summary["wall_s"]
    assert set(ledger) == PARTS and wall_s == pytest.approx(clock.now - started)
    assert sum(ledger.values()) == pytest.approx(wall_s, rel=0.02)
    assert ledger["waiting"] == pytest.approx(3.0) and ledger["startup"] == pytest.approx(2.5)
    assert ledger["productive"] > 0.8 * 29 * 0.5 and ledger["restore"] == pytest.approx(1.0)
    (recovery,) = summary["recoveries"]
    assert recovery["time_ledger"]["detection"] == pytest.approx(0.3)
    # Detection to the first step (1 + 1.5 + 0.5 s), less the restore and one ordinary step.
    assert recovery["time_ledger"]["reform"] == pytest.approx(3.0 - 1.0 - 0.5)
    assert recovery["time_ledger"]["restore"] == pytest.approx(1.0)
    assert recovery["time_ledger"]["redone"] == pytest.approx(0.7)      # the step in flight: 1 s less 0.3


# ---- where the ledger is shown ----------------------------------------------------------

def test_report_prints_the_ledger_and_plots_it_as_a_stacked_bar(tmp_path, capsys):
    from elastic import _report_plot
    from elastic.__main__ import main
    ledger = {"productive": 10.0, "redone": 0.5, "detection": 0.3, "reform": 1.2, "restore": 0.4,
              "checkpoint_stall": 0.6, "startup": 3.0, "waiting": 2.0}
    summary = {"status": "finished", "final_step": 4, "total_steps": 4, "wall_s": 18.0, "goodput": 0.6,
               "resumed_from": None, "loss_first": 2.0, "loss_last": 1.0, "model_sha256": None,
               "world_size_history": [[0, 2]], "checkpoints": [4], "error": None, "time_ledger": ledger,
               "recoveries": [{"cause": "worker_died", "rung": "warm", "detect_s": 0.3, "recover_s": 2.0,
                               "lost_steps": 1, "from_world": 3, "to_world": 2, "step": 2,
                               "time_ledger": {"detection": 0.3, "reform": 1.2, "restore": 0.4, "redone": 0.5}}]}
    rows = [{"step": n, "loss": 2.0 / n, "world_size": 2, "time": 100.0 + n, "lr": 0.1} for n in range(1, 5)]
    png, drawn = _report_plot.render(rows, summary)
    assert png.startswith(b"\x89PNG") and drawn["time_ledger"] == ledger
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["report", str(tmp_path), "--plot", str(tmp_path / "r.png")]) == 0
    out, err = capsys.readouterr()
    assert "time ledger  productive 10.0s" in out and "waiting 2.0s" in out and "time ledger" in err
    assert "reform" in out.splitlines()[-2] and "1.2" in out.splitlines()[-1]

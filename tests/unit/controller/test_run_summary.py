"""RunSummary on its own: summary.json's fields built from the run's events (pure: a fake clock)."""
import pytest

from elastic._controller.run_summary import RunSummary
from elastic._protocol import StepRecord

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def step(n, t, loss=1.0, order=None):
    return StepRecord(step=n, loss=loss, world_size=2, time=t, samples_seen=16 * n, global_batch=16,
                      data_order=order)


def build(summary, **overrides):
    fields = dict(status="finished", final_step=4, checkpoints=[2, 4], model_sha256="abc", error=None,
                  metrics={"loss": 0.5})
    return summary.build(**(fields | overrides))


def test_the_summary_fields_come_from_the_events():
    clock = Clock(100.0)
    summary = RunSummary(total_steps=4, config={"seed": 0}, clock=clock)
    summary.on_generation_start(0, 3)
    for n in (1, 2, 3):
        summary.on_step(step(n, 100.0 + n, loss=2.0 / n, order=f"h{n}"))
    summary.on_straggler({"rank": 1, "step": 3, "score": 1.6})
    clock.now = 110.0
    summary.on_generation_start(3, 2)                   # a recovery: planned from step 3 ...
    summary.correct_generation_start(2)                 # ... but the workers restored step 2
    summary.rollback_to(2)
    summary.on_checkpoint_fallback({"step": 3, "error": "bad shard"})
    summary.on_checkpoint_fallback({"step": 3, "error": "bad shard"})     # told by every rank: once
    summary.on_recovery({"cause": "worker_died", "recover_s": 2.0})
    for n, t in ((3, 112.0), (4, 113.0)):
        summary.on_step(step(n, t, loss=0.5, order=f"r{n}"))
    summary.on_final_data(64, "final")
    summary.resumed_from = None
    clock.now = 120.0
    built = build(summary)
    assert built["world_size_history"] == [[0, 3], [2, 2]]
    # Its time ledger: the clock stood at 100 while steps 1-3 came (their times are held to it), so
    # the 10 s to the recovery are the step in flight (redone) with its lost step 3.
    assert built["recoveries"] == [{"cause": "worker_died", "recover_s": 2.0, "time_ledger": {
        "detection": 0.0, "reform": 0.0, "restore": 0.0, "redone": 10.0}}]
    assert built["stragglers"] == [{"rank": 1, "step": 3, "score": 1.6}]
    assert built["checkpoint_fallbacks"] == [{"step": 3, "error": "bad shard"}]
    assert built["loss_first"] == 2.0 and built["loss_last"] == 0.5 and summary.last_loss == 0.5
    assert built["samples_consumed"] == 64 and built["data_order_sha256"] == "final"
    # The goodput is the ledger's productive share: here the clock stood still while the steps came.
    assert built["wall_s"] == 20.0 and built["goodput"] == built["time_ledger"]["productive"] / 20.0 == 0.0
    assert built["total_steps"] == 4 and built["config"] == {"seed": 0} and built["metrics"] == {"loss": 0.5}
    assert (built["status"], built["final_step"], built["checkpoints"], built["model_sha256"]) == \
        ("finished", 4, [2, 4], "abc")


def three_steps_of_a_second() -> tuple[Clock, RunSummary]:
    """A run whose generation 0 started at 0 and completed steps 1-3 at 1, 2 and 3 s."""
    clock = Clock(0.0)
    summary = RunSummary(total_steps=10, config={}, clock=clock)
    summary.on_generation_start(0, 2)
    for n in (1, 2, 3):
        clock.now = float(n)
        summary.on_step(step(n, float(n)))
    return clock, summary


def test_the_goodput_is_the_time_spent_computing_kept_steps_not_a_re_formed_groups_start():
    clock, summary = three_steps_of_a_second()
    clock.now = 6.0
    summary.on_recovery({"cause": "worker_died", "detected_at": 5.0, "detect_s": 0.5})
    summary.on_generation_start(3, 2)
    clock.now = 10.0
    # The re-formed group's first step ends 4 s after its generation began (joining, the wrappers,
    # the restore, then the step): the kept step's duration from the generation's start was once
    # counted whole; only an ordinary step's second is productive.
    summary.on_step(step(4, 10.0))
    built = build(summary)
    # Steps 2 and 3, and an ordinary step's second of step 4 (step 1 is the run's start-up); the
    # old measure counted 1 + 1 + 1 + 4 s: 0.7.
    assert built["time_ledger"]["productive"] == pytest.approx(3.0)
    assert built["time_ledger"]["reform"] == pytest.approx(4.0) and built["goodput"] == pytest.approx(0.3)


def test_a_step_recorded_again_moves_the_lost_attempts_time_out_of_the_goodput():
    clock, summary = three_steps_of_a_second()
    clock.now = 4.0
    summary.on_step(step(2, 4.0))                      # redone without an explicit rollback
    built = build(summary)
    assert built["time_ledger"]["redone"] == pytest.approx(2.0)      # steps 2 and 3's first attempts
    assert built["goodput"] == pytest.approx(1.0 / 4.0)                # step 2's second attempt


def test_a_resumed_run_reports_its_resume_step_and_the_last_data_of_its_steps():
    summary = RunSummary(total_steps=10, config={}, clock=Clock(0.0))
    summary.resumed_from = 6
    summary.on_generation_start(6, 2)
    summary.on_step(step(7, 1.0, order="h7"))
    built = build(summary, status="failed", error={"type": "X"})
    assert built["resumed_from"] == 6 and built["samples_consumed"] == 112 and built["data_order_sha256"] == "h7"
    assert built["status"] == "failed" and built["error"] == {"type": "X"}


def test_an_empty_run_has_no_losses_no_data_and_no_goodput():
    summary = RunSummary(total_steps=10, config={}, clock=Clock(5.0))
    built = build(summary)
    assert built["loss_first"] is None and built["loss_last"] is None and built["goodput"] is None
    assert built["samples_consumed"] is None and built["world_size_history"] == []

"""A run's whole history across its invocations (issue 34): killed, stopped and resumed on the
same storage, summary.json keeps one entry per invocation (`invocations`), carried on by each
resume from the summary.json it finds, and `elastic report` shows them. Before, a resume's summary
had only its own recoveries, time ledger and first loss."""
from __future__ import annotations

import json

import pytest

from elastic import __main__ as cli
from elastic._controller.run_record import RunRecorder
from elastic._protocol import StepRecord
from run_file_schemas import validate

pytestmark = pytest.mark.timeout(30)


def lost_worker(**more) -> dict:
    return {"cause": "worker_died", "rung": "warm", "detect_s": 0.1, "recover_s": 1.2, "lost_steps": 0,
            "from_world": 2, "to_world": 2, **more}


def invocation(storage, *, steps: range, loss: float, status: str, resumed_from: int | None = None,
               recovery: dict | None = None) -> dict:
    recorder = RunRecorder(storage, None, total_steps=100, config={})
    if resumed_from is not None:
        recorder.resumed(resumed_from)
    recorder.on_generation_start(steps.start - 1, 2)
    for n in steps:
        recorder.on_step(StepRecord(step=n, loss=loss - n / 100, world_size=2, time=float(n), samples_seen=2 * n,
                                    global_batch=2))
        if recovery is not None and n == steps.start + 2:
            recorder.on_recovery(recovery)
    summary = recorder.write_summary(status=status, final_step=steps.stop - 1, checkpoints=[steps.stop - 1],
                                     model_sha256=None, error=None)
    validate("summary.json", summary)
    return summary


def test_a_resume_keeps_every_invocations_recoveries_and_first_loss(tmp_path):
    storage = str(tmp_path)
    first = invocation(storage, steps=range(1, 21), loss=5.0, status="stopped",
                       recovery=lost_worker())
    assert [i["status"] for i in first["invocations"]] == ["stopped"]
    second = invocation(storage, steps=range(21, 41), loss=4.0, status="failed", resumed_from=20)
    third = invocation(storage, steps=range(41, 51), loss=3.0, status="finished", resumed_from=40)
    assert third["recoveries"] == [] and third["loss_first"] == pytest.approx(3.0 - 0.41)   # the last one's own
    history = third["invocations"]
    assert [(i["status"], i["resumed_from"], i["final_step"]) for i in history] == [
        ("stopped", None, 20), ("failed", 20, 40), ("finished", 40, 50)]
    assert [len(i["recoveries"]) for i in history] == [1, 0, 0]
    assert history[0]["recoveries"][0]["cause"] == "worker_died"
    assert history[0]["loss_first"] == pytest.approx(5.0 - 0.01)          # the run's first loss
    assert all(i["time_ledger"] for i in history)
    assert history[:2] == second["invocations"]


def test_a_summary_from_before_invocations_becomes_the_first_entry(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({
        "status": "stopped", "final_step": 30, "resumed_from": None, "wall_s": 12.5, "loss_first": 6.0,
        "loss_last": 4.5, "recoveries": [{"cause": "hang"}], "time_ledger": {"productive": 10.0}, "error": None}))
    summary = invocation(str(tmp_path), steps=range(31, 36), loss=4.0, status="finished", resumed_from=30)
    first, last = summary["invocations"]
    assert first["started_at"] is None and first["recoveries"] == [{"cause": "hang"}] and first["loss_first"] == 6.0
    assert last["resumed_from"] == 30 and last["status"] == "finished"


def test_an_unreadable_previous_summary_starts_the_history_here(tmp_path, caplog):
    (tmp_path / "summary.json").write_text('{"status": "stop')
    summary = invocation(str(tmp_path), steps=range(31, 36), loss=4.0, status="finished", resumed_from=30)
    assert [i["resumed_from"] for i in summary["invocations"]] == [30]
    assert "could not read the previous summary.json" in caplog.text


def test_elastic_report_counts_the_recoveries_of_every_invocation(tmp_path, capsys):
    storage = str(tmp_path)
    invocation(storage, steps=range(1, 21), loss=5.0, status="stopped", recovery=lost_worker())
    invocation(storage, steps=range(21, 31), loss=4.0, status="finished", resumed_from=20)
    assert cli.main(["report", storage]) == 0
    out = capsys.readouterr().out
    assert "2 invocations, 1 recoveries in all" in out
    assert "1: stopped at step 20 (resumed from None), 1 recoveries" in out

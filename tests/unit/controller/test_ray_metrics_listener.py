"""The controller's Ray metrics: a listener of the run record, exporting what it is told."""
import logging

import pytest

from elastic._controller.run_record import RunRecorder
from elastic._protocol import StepRecord
from elastic._ray_metrics import RayMetricsListener

pytestmark = pytest.mark.timeout(30)


class FakeMetric:
    def __init__(self):
        self.calls = []

    def set(self, value, tags):
        self.calls.append(("set", value, tags))

    def inc(self, value, tags):
        self.calls.append(("inc", value, tags))

    def observe(self, value, tags):
        self.calls.append(("observe", value, tags))


def step(n, t, world=2):
    return StepRecord(step=n, loss=1.0, world_size=world, time=t, samples_seen=n, global_batch=world)


def fake_metrics():
    names = ("world_size", "step_rate", "steps", "recoveries", "recovery_s", "checkpoint_s", "checkpoint_bytes",
             "time_ledger")
    return {name: FakeMetric() for name in names}


def test_steps_and_recoveries_reach_the_record_and_are_exported(tmp_path):
    metrics = fake_metrics()
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={},
                           listeners=[RayMetricsListener(run="s3://b/run", metrics=metrics)])
    recorder.on_generation_start(0, 2)
    for n, t in ((1, 10.0), (2, 10.5), (3, 11.0)):
        recorder.on_step(step(n, t))
    recorder.on_recovery({"cause": "hang", "recover_s": 4.2})
    recorder.resumed(7)                             # the controller tells the record of the resume
    summary = recorder.write_summary(status="finished", final_step=3, checkpoints=[], model_sha256=None,
                                     error=None)
    assert [s for s, _ in recorder.user_metrics()["history"]["loss"]] == [1, 2, 3]
    assert [{k: v for k, v in r.items() if k != "time_ledger"} for r in summary["recoveries"]] == \
        [{"cause": "hang", "recover_s": 4.2}]
    assert set(summary["recoveries"][0]["time_ledger"]) == {"detection", "reform", "restore", "redone"}
    assert summary["resumed_from"] == 7 and summary["status"] == "finished"
    run = {"run": "s3://b/run"}
    assert metrics["steps"].calls == [("inc", 1, run)] * 3
    assert metrics["world_size"].calls[-1] == ("set", 2, run)
    assert metrics["step_rate"].calls == [("set", 2.0, run), ("set", 2.0, run)]
    assert metrics["recoveries"].calls == [("inc", 1, {**run, "cause": "hang"})]
    assert metrics["recovery_s"].calls == [("observe", 4.2, {**run, "cause": "hang"})]
    # The run's time ledger: one gauge per part, last set to summary.json's seconds.
    last = {tags["part"]: value for _, value, tags in metrics["time_ledger"].calls}
    assert last == summary["time_ledger"] and len(last) == 8


def test_the_listener_is_no_proxy():
    assert "__getattr__" not in vars(RayMetricsListener) and "__setattr__" not in vars(RayMetricsListener)


class Broken:
    def on_step(self, record):
        raise RuntimeError("export failed")

    def on_recovery(self, recovery):
        raise RuntimeError("export failed")


def test_a_listener_that_raises_is_logged_and_the_record_and_other_listeners_go_on(tmp_path, caplog):
    metrics = fake_metrics()
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={},
                           listeners=[Broken(), RayMetricsListener(run="r", metrics=metrics)])
    recorder.on_generation_start(0, 2)
    with caplog.at_level(logging.ERROR, logger="elastic.record"):
        recorder.on_step(step(1, 1.0))
        recorder.on_recovery({"cause": "hang", "recover_s": 1.0})
    recorder.flush_metrics()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    assert metrics["steps"].calls == [("inc", 1, {"run": "r"})] and len(metrics["recoveries"].calls) == 1
    failed = [r.getMessage() for r in caplog.records if "run listener Broken failed" in r.getMessage()]
    assert len(failed) == 2

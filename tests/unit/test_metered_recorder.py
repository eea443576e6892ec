"""The controller's Ray metrics wrapper: forwards to the run record, exports what it is told."""
import pytest

from elastic._protocol import StepRecord
from elastic._ray_metrics import MeteredRecorder

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


class Record:
    resumed_from = None

    def __init__(self):
        self.steps, self.recoveries = [], []

    def on_step(self, record, lr=None):
        self.steps.append(record.step)

    def on_recovery(self, recovery):
        self.recoveries.append(recovery)

    def write_summary(self, **kwargs):
        return {"status": kwargs["status"]}


def step(n, t, world=2):
    return StepRecord(step=n, loss=1.0, world_size=world, time=t, samples_seen=n, global_batch=world)


def test_steps_and_recoveries_are_forwarded_and_exported():
    names = ("world_size", "step_rate", "steps", "recoveries", "recovery_s", "checkpoint_s", "checkpoint_bytes")
    metrics = {name: FakeMetric() for name in names}
    inner = Record()
    recorder = MeteredRecorder(inner, run="s3://b/run", metrics=metrics)
    for n, t in ((1, 10.0), (2, 10.5), (3, 11.0)):
        recorder.on_step(step(n, t))
    recorder.on_recovery({"cause": "hang", "recover_s": 4.2})
    recorder.resumed_from = 7                       # the controller writes record fields through it
    assert inner.steps == [1, 2, 3] and inner.recoveries == [{"cause": "hang", "recover_s": 4.2}]
    assert inner.resumed_from == 7 and recorder.write_summary(status="finished") == {"status": "finished"}
    run = {"run": "s3://b/run"}
    assert metrics["steps"].calls == [("inc", 1, run)] * 3
    assert metrics["world_size"].calls[-1] == ("set", 2, run)
    assert metrics["step_rate"].calls == [("set", 2.0, run), ("set", 2.0, run)]
    assert metrics["recoveries"].calls == [("inc", 1, {**run, "cause": "hang"})]
    assert metrics["recovery_s"].calls == [("observe", 4.2, {**run, "cause": "hang"})]

"""Driver-side callbacks: every metrics line, recovery and commit reaches them once, in order, from
the controller's feed; a raising callback does not stop the run; TensorBoard event files (no Ray)."""
import sys

import pytest
from fakes import FakeCheckpoints, FakeGroup
from harness import interrupt

from elastic import Callback, CheckpointConfig, ElasticTrainer, ScalingConfig, TensorBoardCallback
from elastic._controller.controller import Controller
from elastic._controller.feed import FeedKind, RunFeed
from elastic._controller.run_record import RunRecorder
from elastic._controller.states import RunState
from elastic._protocol import StepRecord
from elastic.callbacks import CallbackRunner
from elastic.config import FailureConfig
from elastic.errors import ConfigError
from support import FakeClock

pytestmark = pytest.mark.timeout(60)


class Seen(Callback):
    def __init__(self):
        self.events = []

    def on_start(self, start_info):
        self.events.append(("start", start_info))

    def on_step(self, step_info):
        self.events.append(("step", step_info["step"]))

    def on_log(self, log_info):
        self.events.append(("log", log_info["step"], log_info["val"]))

    def on_recovery(self, recovery):
        self.events.append(("recovery", recovery["cause"], recovery["step"], recovery["lost_steps"]))

    def on_checkpoint(self, commit):
        self.events.append(("checkpoint", commit["step"], commit["url"]))

    def on_end(self, result):
        self.events.append(("end", result))


class Raises(Callback):
    def __init__(self):
        self.calls = 0

    def on_step(self, step_info):
        self.calls += 1
        raise RuntimeError("a broken callback")


def controller_with_feed(tmp_path, feed):
    clock, group = FakeClock(), FakeGroup(3)
    recorder = RunRecorder(str(tmp_path), None, total_steps=100, config={}, feed=feed)
    controller = Controller(
        group, recorder, FakeCheckpoints(),
        scaling=ScalingConfig(min_workers=2, max_workers=3, startup_wait_s=10.0),
        failure=FailureConfig(max_failures=3, heartbeat_timeout_s=5.0, collective_timeout_s=30.0,
                              rendezvous_timeout_s=60.0),
        total_steps=100, clock=clock)
    return controller, group


def test_callbacks_see_every_step_log_recovery_and_commit_once_in_order(tmp_path, caplog):
    feed = RunFeed()
    controller, group = controller_with_feed(tmp_path, feed)
    seen, broken = Seen(), Raises()
    runner = CallbackRunner([seen, broken])
    controller.tick()
    controller.tick()
    members = controller.state.members
    group.complete_steps(members[0], 1, 4, 3)
    group.views[members[0]].records.append(StepRecord(
        step=4, loss=None, world_size=3, time=4.5, samples_seen=12, global_batch=3, metrics={"val": 0.5},
        generation=0, kind="log"))
    controller.tick()
    runner.poll(feed.after)
    runner.poll(feed.after)                      # a second poll delivers nothing twice
    group.complete_steps(members[0], 5, 6, 3)    # step 6 is lost with the failure below
    controller.tick()
    controller.checkpoints.latest = 5            # committed meanwhile
    group.die(members[1])
    group.capacity = 2
    controller.tick()
    assert controller.state.state == RunState.RECOVERING
    interrupt(group, [members[0], members[2]], 0, 5)     # the survivors hold step 5 (6 never finished)
    controller.tick()
    runner.poll(feed.after)
    new = controller.state.members
    group.complete_steps(new[0], 6, 7, 2)
    controller.tick()
    runner.drain(feed.after)
    runner.end("the result")
    steps = [e[1] for e in seen.events if e[0] == "step"]
    assert steps == [1, 2, 3, 4, 5, 6, 6, 7]     # step 6 again: redone after the recovery that lost it
    # on_start first, once, with what a tracker needs to go on with the same run.
    assert [e[0] for e in seen.events].count("start") == 1 and seen.events[0][0] == "start"
    assert seen.events[0][1] == {"run_id": None, "storage": str(tmp_path), "config": {}, "resumed_from": None,
                                 "total_steps": 100, "step": 1, "world_size": 3}
    recovery = seen.events.index(("recovery", "worker_died", 5, 1))
    assert [e[1] for e in seen.events[:recovery] if e[0] == "step"] == [1, 2, 3, 4, 5, 6]
    assert seen.events[recovery + 1:recovery + 3] == [("step", 6), ("step", 7)]
    assert ("log", 4, 0.5) in seen.events
    assert seen.events.index(("log", 4, 0.5)) == seen.events.index(("step", 4)) + 1
    assert ("checkpoint", 5, f"{tmp_path}/checkpoints/step_00000005") in seen.events
    assert seen.events[-1] == ("end", "the result")
    assert broken.calls == 8
    raised = [r for r in caplog.records if "raised in on_step" in r.getMessage()]
    assert len(raised) == 1 and raised[0].exc_info is not None
    assert any("raised 8 times" in r.getMessage() for r in caplog.records)


def test_an_event_asked_for_again_after_a_lost_answer_is_delivered_once():
    feed = RunFeed()
    for step in (1, 2, 3):
        feed.put(FeedKind.STEP, {"step": step})
    seen = Seen()
    runner = CallbackRunner([seen])
    calls = []

    def lossy(after):
        calls.append(after)
        events = feed.after(after)
        if len(calls) == 1:
            raise TimeoutError("the answer was lost on the way")
        return events

    with pytest.raises(TimeoutError):
        runner.poll(lossy)
    runner.poll(lossy)                                            # asks again from the same point
    runner.poll(lambda after: [(2, FeedKind.STEP, {"step": 2})])  # a stale answer: skipped
    runner.poll(lossy)
    assert calls == [0, 0, 3] and [e[1] for e in seen.events] == [1, 2, 3]
    assert feed.after(runner.delivered) == []


def test_callbacks_must_be_objects_with_hooks():
    common = dict(scaling=ScalingConfig(min_workers=1, max_workers=1),
                  checkpoint=CheckpointConfig(storage="/tmp/x"), total_steps=1)
    with pytest.raises(ConfigError, match="callbacks"):
        ElasticTrainer(lambda ctx: None, callbacks=Callback(), **common)
    with pytest.raises(ConfigError, match=r"callbacks\[1\]"):
        ElasticTrainer(lambda ctx: None, callbacks=[Seen(), object()], **common)
    with pytest.raises(ConfigError, match=r"callbacks\[0\]"):
        ElasticTrainer(lambda ctx: None, callbacks=[Seen], **common)
    ElasticTrainer(lambda ctx: None, callbacks=[Seen()], **common)


def test_tensorboard_callback_writes_scalars_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = TensorBoardCallback(str(tmp_path / "tb"))
    for step in (1, 2, 3):
        tb.on_step({"step": step, "loss": 1.0 / step, "world_size": 3, "time": 1e9 + step, "lr": 0.1,
                    "global_batch": 24, "accum_steps": 1, "samples_seen": 24 * step, "compute_s": [0.1, 0.1],
                    "grad_norm": float(step)})
    tb.on_recovery({"cause": "worker_died", "rung": "warm", "step": 2, "lost_steps": 1, "recover_s": 1.5,
                    "from_world": 3, "to_world": 2})
    tb.on_step({"step": 3, "loss": 0.25, "world_size": 2, "time": 1e9 + 9, "lr": 0.1, "global_batch": 16,
                "accum_steps": 1, "samples_seen": 64, "compute_s": [0.1], "grad_norm": 30.0})   # step 3 redone
    tb.on_log({"step": 3, "kind": "log", "time": 1e9 + 10, "val_loss": 0.5})
    tb.on_end(None)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"loss", "lr", "grad_norm", "val_loss", "elastic/world_size", "elastic/global_batch",
            "elastic/samples_seen", "elastic/recovery_s", "elastic/lost_steps"} <= set(scalars)
    assert "step" not in scalars and "time" not in scalars and "compute_s" not in scalars
    # The lost attempt of step 3 is purged by TensorBoard: the redone value is the one left.
    assert [(e.step, e.value) for e in events.Scalars("grad_norm")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [(e.step, e.value) for e in events.Scalars("elastic/world_size")] == [(1, 3), (2, 3), (3, 2)]
    assert [(e.step, e.value) for e in events.Scalars("val_loss")] == [(3, 0.5)]
    assert events.Scalars("loss")[0].wall_time == 1e9 + 1


def test_tensorboard_callback_without_tensorboard_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install elastic-train\[tensorboard\]"):
        TensorBoardCallback(str(tmp_path))


def test_on_start_tells_a_resume_and_is_delivered_once_per_fit(tmp_path):
    """A resumed run's start says the step it resumed from (a tracker goes on with the same run);
    a start told again (a run rolled back to its first step, a replacing controller) is not."""
    feed = RunFeed()
    recorder = RunRecorder(str(tmp_path), None, total_steps=50, config={"seed": 0}, feed=feed, run_id="r1")
    recorder.resumed(20)
    recorder.on_generation_start(20, 2)
    for n in (21, 22):
        recorder.on_step(StepRecord(step=n, loss=1.0, world_size=2, time=float(n), samples_seen=n, global_batch=2))
    seen = Seen()
    runner = CallbackRunner([seen])
    runner.poll(feed.after)
    feed.put(FeedKind.START, {"step": 21})           # told again
    runner.poll(feed.after)
    assert [e[0] for e in seen.events] == ["start", "step", "step"]
    assert seen.events[0][1] | {"storage": None} == {"run_id": "r1", "storage": None, "config": {"seed": 0},
                                                      "resumed_from": 20, "total_steps": 50, "step": 21,
                                                      "world_size": 2}

"""The commit watch (structure review 3, point 2): "the newest committed step" is found on a thread
of its own and announced on the controller's; status.json gets it as a plain value, so a stalled
listing stalls neither the controller's tick nor the status writer."""
from __future__ import annotations

import json
import threading

import pytest
from fakes import FakeCheckpoints, FakeGroup

from chaos.services import wait_until
from elastic._controller.commit_watch import LATEST_EVERY_S, CommitWatch
from elastic._controller.controller import Controller
from elastic._controller.feed import FeedKind, RunFeed
from elastic._controller.run_record import RunRecorder
from elastic._controller.states import RunState
from elastic.config import FailureConfig, ScalingConfig
from support import FakeClock

pytestmark = pytest.mark.timeout(30)


class Counted(FakeCheckpoints):
    """Checkpoints whose reads are counted; the commit watch's may stall until released (the
    controller's own read of the checkpoint to resume from is another matter)."""

    def __init__(self, latest=None):
        super().__init__(latest)
        self.committed: list[int] = [] if latest is None else [latest]
        self.reads: list[str] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()

    def latest_step(self):
        self.reads.append("latest")
        if threading.current_thread().name == "commit-watch":
            self.entered.set()
            assert self.release.wait(20), "never released"
        return self.committed[-1] if self.committed else None

    def committed_since(self, step):
        self.reads.append("since")
        return [s for s in self.committed if step is None or s > step]


def test_the_watch_reads_the_newest_first_then_only_what_is_new_and_in_full_every_30s():
    checkpoints, clock = Counted(), FakeClock()
    watch = CommitWatch(checkpoints, clock)         # not started: the test makes each look itself
    watch.look()
    assert watch.take() == (None, []) and checkpoints.reads == ["latest"]
    checkpoints.committed.append(3)
    watch.look()                                   # none seen yet: newest first again
    assert watch.take() == (3, [3]) and checkpoints.reads[-1] == "latest"
    watch.look()
    assert watch.take() == (3, []) and checkpoints.reads[-1] == "since"
    checkpoints.committed += [4, 5]
    watch.look()
    assert watch.take() == (5, [4, 5])
    checkpoints.committed = [4]                    # 5 deleted (found corrupt, say)
    clock.advance(LATEST_EVERY_S + 1)
    watch.look()                                   # the full look every 30 s sees it
    assert watch.take() == (4, []) and checkpoints.reads[-2:] == ["latest", "since"]


def test_a_stalled_listing_stalls_neither_the_tick_nor_status_json_and_commits_are_told_on_the_controllers_thread(
        tmp_path):
    checkpoints = Counted(latest=None)
    checkpoints.release.clear()                    # the newest-commit listing hangs
    feed = RunFeed()
    recorder = RunRecorder(str(tmp_path), None, total_steps=100, config={}, feed=feed, background=True)
    told = []
    on_commits = recorder.on_commits

    def on_commits_seen(steps):
        told.append((list(steps), threading.current_thread().name))
        on_commits(steps)
    recorder.on_commits = on_commits_seen          # type: ignore[method-assign]
    watch = CommitWatch(checkpoints)
    watch.start()
    group = FakeGroup(2)
    controller = Controller(group, recorder, checkpoints, scaling=ScalingConfig(min_workers=2, max_workers=2),
                            failure=FailureConfig(heartbeat_timeout_s=5.0), total_steps=100, clock=FakeClock(),
                            commits=watch)
    try:
        assert checkpoints.entered.wait(10)        # the watch's thread is stuck in the listing ...
        controller.tick()
        controller.tick()                          # ... and the controller starts the run
        assert controller.state.state == RunState.RUNNING

        def status():
            path = tmp_path / "status.json"
            return json.loads(path.read_text()) if path.exists() else {}
        wait_until(lambda: status().get("state") == "running", 10, "status.json written during the stall",
                   interval_s=0.01)
        assert status()["last_committed_step"] is None
        checkpoints.committed.append(7)
        checkpoints.release.set()
        wait_until(lambda: watch._newest == 7, 10, "the watch finding the commit", interval_s=0.01)
        controller.tick()
        assert told == [([7], threading.current_thread().name)] and controller.status.last_committed == 7
        assert [payload["step"] for _, kind, payload in feed.after(0) if kind == FeedKind.CHECKPOINT] == [7]
    finally:
        checkpoints.release.set()
        watch.close()
        recorder.close()

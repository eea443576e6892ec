"""StatusWriter on its own: the throttle (a fake clock), the writer's thread, a stalled storage."""
import threading
import time

import pytest

from chaos.services import wait_until
from elastic._controller.status_writer import StatusWriter
from support import FakeClock

pytestmark = pytest.mark.timeout(30)



class Sink:
    """status.json writes and metrics flushes, in order; a write may stall until released."""

    def __init__(self, stall=False):
        self.events, self.statuses = [], []
        self.entered, self.release = threading.Event(), threading.Event()
        if not stall:
            self.release.set()

    def write(self, status):
        self.entered.set()
        assert self.release.wait(20), "never released"
        self.statuses.append(status)
        self.events.append("status")

    def flush(self):
        self.events.append("flush")


def test_writes_are_throttled_to_min_interval_except_forced_ones():
    clock, sink = FakeClock(0.0), Sink()
    writer = StatusWriter(sink.write, sink.flush, min_interval_s=1.0, clock=clock, wall_clock=lambda: 1234.0)
    writer.update(state="running", step=1)              # the first write goes
    clock.now = 0.5
    writer.update(step=2)                               # throttled: kept for the next write
    assert [s["step"] for s in sink.statuses] == [1]
    writer.update(force=True, state="recovering")       # a transition goes now
    clock.now = 1.2
    writer.update(step=3)                               # 0.7 s after the forced write: throttled
    clock.now = 1.6
    writer.update(step=4)
    assert [(s["state"], s["step"]) for s in sink.statuses] == [("running", 1), ("recovering", 2),
                                                                ("recovering", 4)]
    assert all(s["updated_at"] == 1234.0 for s in sink.statuses)
    assert sink.events == ["status", "flush"] * 3       # the metrics lines follow each status


def test_a_callable_field_is_called_by_the_writers_thread_when_it_writes():
    sink, seen = Sink(), []

    def newest_commit():
        seen.append(threading.current_thread().name)
        return 4
    writer = StatusWriter(sink.write, sink.flush, background=True)
    writer.update(force=True, state="running", last_committed_step=newest_commit)
    wait_until(lambda: sink.statuses, 10, "the first status write", interval_s=0.01)
    writer.close()
    assert sink.statuses[0]["last_committed_step"] == 4
    assert seen[0] == "run-record-writer"


def test_a_stalled_storage_does_not_stall_the_caller_and_the_newest_status_is_written():
    sink = Sink(stall=True)
    writer = StatusWriter(sink.write, sink.flush, background=True)
    writer.update(force=True, state="running", step=1)
    assert sink.entered.wait(10)                        # the writer's thread is stuck in storage ...
    started = time.monotonic()
    for n in range(2, 50):
        writer.update(force=True, step=n)               # ... and the controller goes on
    assert time.monotonic() - started < 5.0
    sink.release.set()
    writer.close()                                      # the newest fields, written before close returns
    assert sink.statuses[0]["step"] == 1 and sink.statuses[-1]["step"] == 49
    writer.update(force=True, state="finished")         # after close: written inline
    assert sink.statuses[-1]["state"] == "finished" and sink.events[-2:] == ["status", "flush"]


def test_a_failed_flush_in_the_background_is_logged_and_the_next_write_retries(caplog):
    sink, failures = Sink(), [OSError("no space")]

    def flush():
        if failures:
            raise failures.pop()
        sink.flush()
    writer = StatusWriter(sink.write, flush, background=True, name="s3://b/run")
    writer.update(force=True, step=1)
    wait_until(lambda: any("could not write the run record under s3://b/run" in r.getMessage()
                           for r in caplog.records), 10, "the warning about the stalled write", interval_s=0.01)
    writer.update(force=True, step=2)
    wait_until(lambda: "flush" in sink.events, 10, "the metrics flush", interval_s=0.01)
    writer.close()
    assert sink.statuses[-1]["step"] == 2


def test_inline_a_failed_flush_raises_to_the_caller_after_the_status_is_written():
    sink = Sink()

    def flush():
        raise OSError("no space")
    writer = StatusWriter(sink.write, flush)
    with pytest.raises(OSError):
        writer.update(force=True, state="failed")
    assert sink.statuses[-1]["state"] == "failed"

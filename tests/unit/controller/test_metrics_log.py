"""MetricsLog on its own: the append/rollback/flush protocol of metrics.jsonl (no Ray, no thread)."""
import dataclasses
import json

import pytest

from checkpointing.storage import Storage
from elastic._controller.metrics_log import MetricsLog
from elastic._protocol import StepRecord

pytestmark = pytest.mark.timeout(30)


def step(n, t=None, **metrics):
    return StepRecord(step=n, loss=1.0, world_size=2, time=float(n if t is None else t), samples_seen=16 * n,
                      global_batch=16, metrics=metrics)


def log(n, **metrics):
    return StepRecord(step=n, loss=None, world_size=2, time=n + 0.5, samples_seen=16 * n, global_batch=16,
                      metrics=metrics, kind="log")


class Recording:
    """A storage that counts its calls and runs `during_append` inside the next append (what
    the controller does while the writer's thread is in a flush) or fails it after half the data."""

    def __init__(self, storage):
        self._storage, self.calls, self.during_append, self.tear_next = storage, [], None, False

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def append(self, path, data):
        self.calls.append("append")
        if self.during_append is not None:
            hook, self.during_append = self.during_append, None
            hook()
        if self.tear_next:
            self.tear_next = False
            self._storage.append(path, data[: len(data) // 2])
            raise OSError("connection reset")
        return self._storage.append(path, data)

    def write_atomic(self, path, data):
        self.calls.append("write_atomic")
        return self._storage.write_atomic(path, data)


def rows(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def make(tmp_path):
    storage = Recording(Storage(str(tmp_path)))
    return MetricsLog(storage), storage


def test_a_rollback_past_flushed_lines_rewrites_the_file_once_then_appends_again(tmp_path):
    metrics, storage = make(tmp_path)
    for n in range(1, 6):
        metrics.append_step(step(n))
    metrics.flush()
    metrics.rollback_to(3)
    for n in (4, 5):
        metrics.append_step(step(n, t=10 + n))
    metrics.flush()
    metrics.append_step(step(6, t=16))
    metrics.flush()
    assert [(r["step"], r["time"]) for r in rows(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0),
                                                                (5, 15.0), (6, 16.0)]
    assert storage.calls == ["append", "write_atomic", "append"]
    assert metrics.user_metrics()["history"]["loss"] == [[n, 1.0] for n in range(1, 7)]


def test_a_step_recorded_again_rolls_back_the_attempts_from_it(tmp_path):
    metrics, _ = make(tmp_path)
    for n in range(1, 5):
        metrics.append_step(step(n, acc=float(n)))
    metrics.append_step(step(2, t=20, acc=0.5))          # redone from step 1: 2, 3 and 4 were lost
    assert metrics.newest_step == 2
    metrics.flush()
    assert [(r["step"], r["time"]) for r in rows(tmp_path)] == [(1, 1.0), (2, 20.0)]
    assert metrics.user_metrics()["history"]["acc"] == [[1, 1.0], [2, 0.5]]


def test_a_batch_is_flushed_in_step_order_with_a_steps_log_lines_after_it(tmp_path):
    metrics, _ = make(tmp_path)
    metrics.append_step(step(1))
    metrics.append_step(step(2))
    metrics.append_log(log(1, val=0.5))                 # released by the controller after step 2's line
    metrics.flush()
    assert [(r["step"], r.get("kind")) for r in rows(tmp_path)] == [(1, None), (1, "log"), (2, None)]


def test_a_lines_compute_times_are_rounded_where_the_line_is_written(tmp_path):
    # Workers send them unrounded (rounding each rank's value cost rank 0 ms per step at 10,000 ranks).
    metrics, _ = make(tmp_path)
    metrics.append_step(dataclasses.replace(step(1), compute_s=(0.123456789, 2.0000004)))
    metrics.flush()
    assert rows(tmp_path)[0]["compute_s"] == [0.123457, 2.0]


def test_a_rollback_made_while_a_flush_writes_is_honoured_by_the_next_flush(tmp_path):
    metrics, storage = make(tmp_path)
    for n in range(1, 6):
        metrics.append_step(step(n))
    storage.during_append = lambda: metrics.rollback_to(3)   # the controller, while the writer appends 1-5
    metrics.flush()
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4, 5]     # the snapshot went as it was
    metrics.append_step(step(4, t=14))
    metrics.flush()
    assert [(r["step"], r["time"]) for r in rows(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0)]
    assert storage.calls == ["append", "write_atomic"]


def test_a_torn_append_is_repaired_by_rewriting_the_file_at_the_next_flush(tmp_path):
    metrics, storage = make(tmp_path)
    metrics.append_step(step(1))
    metrics.flush()
    metrics.append_step(step(2))
    metrics.append_step(step(3))
    storage.tear_next = True
    with pytest.raises(OSError):
        metrics.flush()
    metrics.flush()                                      # the lines of 2 and 3 were kept for it
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3]
    assert storage.calls == ["append", "append", "write_atomic"]


def test_nothing_to_write_is_no_storage_call(tmp_path):
    metrics, storage = make(tmp_path)
    metrics.flush()
    assert storage.calls == []


def test_load_previous_keeps_the_lines_and_metrics_up_to_the_resume_step(tmp_path):
    first, _ = make(tmp_path)
    for n in range(1, 6):
        first.append_step(step(n, acc=float(n)))
    first.flush()
    second, storage = make(tmp_path)
    second.load_previous(3)
    assert second.newest_step == 3
    assert second.user_metrics()["history"]["acc"] == [[1, 1.0], [2, 2.0], [3, 3.0]]
    second.append_step(step(4, t=40))
    second.flush()                                       # the previous run's 4 and 5 go
    assert [(r["step"], r["time"]) for r in rows(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert storage.calls == ["write_atomic"]

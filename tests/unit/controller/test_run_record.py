"""The run record keeps the kept attempt of each step: redone steps replace the lost ones."""
import json
import threading

import pytest

from elastic._controller.run_record import RunRecorder
from elastic._protocol import StepRecord

pytestmark = pytest.mark.timeout(30)


def record(step, t):
    return StepRecord(step=step, loss=1.0, world_size=2, time=float(t), samples_seen=16 * step, global_batch=16)


def steps_on_disk(path):
    return [json.loads(line)["step"] for line in open(path / "metrics.jsonl")]


def test_a_rollback_drops_the_lost_attempts(tmp_path):
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={})
    recorder.on_generation_start(0, 2)
    for step in range(1, 6):
        recorder.on_step(record(step, step))
    for step in range(4, 7):             # restored at step 3: 4 and 5 are redone
        recorder.on_step(record(step, 10 + step))
    recorder.flush_metrics()
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert [json.loads(line)["time"] for line in open(tmp_path / "metrics.jsonl")][3:] == [14.0, 15.0, 16.0]


def test_a_resume_that_fell_back_drops_the_loaded_lines_past_it(tmp_path):
    first = RunRecorder(str(tmp_path), None, total_steps=10, config={})
    first.on_generation_start(0, 2)
    for step in range(1, 9):
        first.on_step(record(step, step))
    first.flush_metrics()
    second = RunRecorder(str(tmp_path), None, total_steps=12, config={})
    second.load_previous_metrics(8)      # planned from the newest manifest ...
    second.on_generation_start(8, 2)
    second.on_step(record(5, 100))       # ... but the workers restored step 4
    second.flush_metrics()
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4, 5]


def test_new_lines_are_appended_and_written_lines_are_left_alone(tmp_path):
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={})
    recorder.on_generation_start(0, 2)
    for step in range(1, 4):
        recorder.on_step(record(step, step))
    recorder.flush_metrics()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text('{"step": 1, "mark": "written before"}\n' + "".join(lines[1:]))
    for step in range(4, 6):
        recorder.on_step(record(step, step))
    recorder.flush_metrics()
    rows = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[0].get("mark") == "written before"
    assert set(rows[4]) >= {"step", "loss", "lr", "world_size", "global_batch", "accum_steps", "samples_seen",
                            "time"} and rows[4]["accum_steps"] == 1


def test_a_rollback_past_written_lines_rewrites_the_file_once(tmp_path):
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={})
    recorder.on_generation_start(0, 2)
    for step in range(1, 6):
        recorder.on_step(record(step, step))
    recorder.flush_metrics()
    recorder.rollback_to(3)              # a checkpoint restore: 4 and 5 were lost
    recorder.flush_metrics()
    assert steps_on_disk(tmp_path) == [1, 2, 3]
    for step in range(4, 7):
        recorder.on_step(record(step, 10 + step))
    recorder.flush_metrics()
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_a_resume_drops_lines_past_its_step_and_a_torn_line(tmp_path):
    previous = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)) + '{"step": 9, "lo'
    (tmp_path / "metrics.jsonl").write_text(previous)     # the previous run died while appending
    recorder = RunRecorder(str(tmp_path), None, total_steps=12, config={})
    recorder.load_previous_metrics(6)
    recorder.on_generation_start(6, 2)
    for step in range(7, 9):
        recorder.on_step(record(step, step))
    recorder.flush_metrics()
    assert steps_on_disk(tmp_path) == list(range(1, 9))
    recorder.on_step(record(9, 9))
    recorder.flush_metrics()
    assert steps_on_disk(tmp_path) == list(range(1, 10))


def test_an_object_store_gets_the_appended_lines_too():
    from checkpointing.storage import Storage
    url = "memory://record-append-test"
    recorder = RunRecorder(url, None, total_steps=10, config={})
    recorder.on_generation_start(0, 2)
    for first, last in ((1, 3), (4, 5)):
        for step in range(first, last + 1):
            recorder.on_step(record(step, step))
        recorder.flush_metrics()
    storage = Storage(url)
    text = storage.read_bytes(storage.path("metrics.jsonl")).decode()
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3, 4, 5]


class StalledStorage:
    """Wraps the recorder's storage: appends wait until `release` is set (a stalled S3)."""

    def __init__(self, storage):
        self._storage, self.release, self.entered = storage, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def _stall(self):
        self.entered.set()
        assert self.release.wait(20), "never released"

    def append(self, path, data):
        self._stall()
        return self._storage.append(path, data)


def test_a_stalled_storage_does_not_stall_the_caller_in_background_mode(tmp_path):
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={}, background=True)
    stalled = recorder.metrics_log._log.storage = StalledStorage(recorder.metrics_log._log.storage)
    recorder.on_generation_start(0, 2)
    for step in range(1, 6):
        recorder.on_step(record(step, step))
    recorder.write_status(force=True, state="running", step=5, last_committed_step=lambda: 4)
    assert stalled.entered.wait(10)                  # the writer is appending steps 1-5 ...
    recorder.rollback_to(3)                          # ... while the controller goes on: 4 and 5 lost
    for step in range(4, 7):
        recorder.on_step(record(step, 10 + step))
    recorder.write_status(force=True, state="running", step=6, last_committed_step=lambda: 4)
    stalled.release.set()
    recorder.write_summary(status="finished", final_step=6, checkpoints=[], model_sha256=None, error=None)
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert [json.loads(line)["time"] for line in open(tmp_path / "metrics.jsonl")][3:] == [14.0, 15.0, 16.0]
    status = json.load(open(tmp_path / "status.json"))
    assert status["step"] == 6 and status["last_committed_step"] == 4      # a function, evaluated by the writer

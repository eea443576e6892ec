"""Trackers get each kept step once: the kept step follows the recovery ladder (RunSpec.kept_through),
the recorder announces it, the driver holds the lines of kept-steps-only callbacks until then and
drops the ones a recovery takes back; MLflow (its local file store) and W&B (offline) read back
each step once, with the redone attempt's values, and a resume goes on with the same tracker run."""
from __future__ import annotations

import glob
import json
import logging
import struct
import time
import traceback
from types import SimpleNamespace

import pytest

from elastic import Callback, CheckpointConfig, FailureConfig, MLflowCallback, ScalingConfig, WandbCallback
from elastic._controller.feed import FeedKind, RunFeed
from elastic._controller.run_record import RunRecorder
from elastic._protocol import RunSpec, StepRecord
from elastic.callbacks import CallbackRunner
from elastic.errors import ConfigError
from elastic.trackers import run_key

pytestmark = pytest.mark.timeout(120)


def spec(strategy="ddp", *, copies=10, sdc=True, spot=100) -> RunSpec:
    shards = {"hsdp_shard_size": 2} if strategy == "hsdp" else {}
    return RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy=strategy, min_workers=4, max_workers=4, **shards),
                   checkpoint=CheckpointConfig(storage="memory://unused", in_memory_every_n_steps=copies),
                   failure=FailureConfig(sdc_check=sdc, spot_check_every_n_steps=spot))


def test_kept_through_follows_the_recovery_ladder():
    # DDP without the corruption check: a survivor holds the newest step (one step of margin).
    assert [spec(sdc=False).kept_through(n) for n in (1, 2, 37)] == [0, 1, 36]
    # FSDP with copies every 10: the newest copy before the newest step.
    fsdp = spec("fsdp")
    assert [fsdp.kept_through(n) for n in (10, 11, 20, 21, 37)] == [0, 10, 10, 20, 30]
    # FSDP without copies: only commits keep steps.
    assert spec("fsdp", copies=None).kept_through(95) == 0
    # DDP's spot check every 20 with copies every 10: back to a copy from before the last passed check.
    spot = spec(spot=20)
    assert [spot.kept_through(n) for n in (20, 21, 37, 41)] == [0, 20, 20, 40]
    assert spec(spot=None).kept_through(37) == 30
    # HSDP takes no copies: its replicas are the survivors.
    assert spec("hsdp").kept_through(37) == 36


def test_the_recorder_announces_the_kept_step_from_steps_and_commits(tmp_path):
    feed = RunFeed()
    recorder = RunRecorder(str(tmp_path), None, total_steps=50, config={}, feed=feed,
                           kept_through=spec("fsdp", copies=5).kept_through)
    for n in range(1, 13):
        recorder.on_step(StepRecord(step=n, loss=1.0, world_size=2, time=float(n), samples_seen=n, global_batch=1))
    recorder.on_commits([12])
    kept = [payload["step"] for _, kind, payload in feed.after(0) if kind == FeedKind.KEPT]
    assert kept == [5, 10, 12]


class Lines(Callback):
    def __init__(self, kept: bool):
        self.kept_steps_only = kept
        self.steps: list[tuple[int, float]] = []
        self.logs: list[int] = []
        self.recoveries = 0

    def on_step(self, step_info):
        self.steps.append((step_info["step"], step_info["loss"]))

    def on_log(self, log_info):
        self.logs.append(log_info["step"])

    def on_recovery(self, recovery):
        self.recoveries += 1


def line(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "world_size": 2, "time": 1e9 + step, "lr": 0.1, "global_batch": 4,
            "accum_steps": 1, "samples_seen": 4 * step, "compute_s": [0.1, 0.1]}


def rolled_back_run(feed: RunFeed, *, storage: str, start: int = 1, resumed_from: int | None = None) -> None:
    """FSDP with copies every 5: steps to 8, a rank lost, back to the copy of 5 (3 steps lost), the
    steps redone (their loss + 0.5) to 12, a validation line at 10, a commit at 12. What the
    recorder sends, by hand (the recorder's part is the test above)."""
    kept_through = spec("fsdp", copies=5).kept_through
    kept = 0
    feed.put(FeedKind.START, {"run_id": "r1", "storage": storage, "config": {"checkpoint": {"every_n_steps": 12}},
                              "resumed_from": resumed_from, "step": start})

    def step(n: int, loss: float) -> None:
        nonlocal kept
        feed.put(FeedKind.STEP, line(n, loss))
        if kept_through(n) > kept:
            kept = kept_through(n)
            feed.put(FeedKind.KEPT, {"step": kept})

    for n in range(start, 9):
        step(n, float(n))
    feed.put(FeedKind.RECOVERY, {"cause": "worker_died", "rung": "memory", "step": 5, "lost_steps": 3,
                                 "recover_s": 0.8, "detected_at": 123.0})
    for n in range(6, 13):
        step(n, n + 0.5)
        if n == 10:
            feed.put(FeedKind.LOG, {"step": 10, "kind": "log", "time": 1e9 + 10.5, "val_loss": 2.5})
    feed.put(FeedKind.CHECKPOINT, {"step": 12, "url": f"{storage}/checkpoints/step_00000012"})
    feed.put(FeedKind.KEPT, {"step": 12})


def deliver(callbacks, feed: RunFeed, status: str = "finished") -> None:
    """Through the driver's runner, which logs a raising callback and goes on: a test fails with it."""
    errors = []

    class Raised(logging.Handler):
        def emit(self, record):
            if record.exc_info:
                errors.append("".join(traceback.format_exception(*record.exc_info)))

    handler = Raised()
    logging.getLogger("elastic.callbacks").addHandler(handler)
    try:
        runner = CallbackRunner(callbacks)
        runner.drain(feed.after)
        runner.end(SimpleNamespace(status=status, ok=status in ("finished", "stopped")))
    finally:
        logging.getLogger("elastic.callbacks").removeHandler(handler)
    assert not errors, errors[0]


def test_kept_steps_only_callbacks_get_each_kept_step_once_with_the_redone_values(tmp_path):
    live, kept = Lines(kept=False), Lines(kept=True)
    feed = RunFeed()
    rolled_back_run(feed, storage=str(tmp_path))
    deliver([live, kept], feed)
    # Live: every attempt, the recovery taking 6-8 back.
    assert [s for s, _ in live.steps] == [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9, 10, 11, 12]
    # Kept: each step once, the lost attempts of 6-8 never delivered.
    assert kept.steps == [(n, float(n)) for n in range(1, 6)] + [(n, n + 0.5) for n in range(6, 13)]
    assert kept.logs == [10] and kept.recoveries == 1


def test_a_failed_run_leaves_its_steps_after_the_kept_one_to_the_resume():
    kept = Lines(kept=True)
    feed = RunFeed()
    for n in range(1, 8):
        feed.put(FeedKind.STEP, line(n, float(n)))
    feed.put(FeedKind.KEPT, {"step": 5})
    deliver([kept], feed, status="failed")
    assert [s for s, _ in kept.steps] == [1, 2, 3, 4, 5]
    stopped = Lines(kept=True)
    feed = RunFeed()
    for n in range(1, 8):
        feed.put(FeedKind.STEP, line(n, float(n)))
    deliver([stopped], feed, status="stopped")     # a stop commits its step: nothing is taken back
    assert [s for s, _ in stopped.steps] == list(range(1, 8))


def test_mlflow_holds_each_step_once_and_a_resume_goes_on_with_the_same_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")     # MLflow 3's local file store, kept for clients
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    storage = str(tmp_path / "run")
    first = MLflowCallback()
    feed = RunFeed()
    rolled_back_run(feed, storage=storage)
    deliver([first], feed, status="stopped")
    client = MlflowClient()
    history = client.get_metric_history(first.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == \
        [(n, float(n)) for n in range(1, 6)] + [(n, n + 0.5) for n in range(6, 13)]
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "val_loss")] == [(10, 2.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "elastic/lost_steps")] == [(5, 3.0)]
    assert {m.step for m in client.get_metric_history(first.run_id, "elastic/world_size")} == set(range(1, 13))
    run = client.get_run(first.run_id)
    assert run.info.status == "KILLED" and run.data.params["checkpoint.every_n_steps"] == "12"
    assert run.data.tags["elastic.storage"] == storage

    # The resume from step 10 (a new fit on the same storage): the same MLflow run; its steps
    # 11-12 are redone and not logged twice; 13-14 are new.
    resumed = MLflowCallback()
    feed = RunFeed()
    feed.put(FeedKind.START, {"run_id": "r2", "storage": storage, "config": {}, "resumed_from": 10, "step": 11})
    for n in range(11, 15):
        feed.put(FeedKind.STEP, line(n, n + 0.75))
    deliver([resumed], feed)
    assert resumed.run_id == first.run_id
    steps = sorted(m.step for m in client.get_metric_history(first.run_id, "loss"))
    assert steps == list(range(1, 15))
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["elastic.run_id"] == "r2"


def wandb_history(run_dir: str, timeout_s: float = 60.0) -> list[dict]:
    """The history rows of an offline W&B run, read from its .wandb file once its exit record is
    there (wandb's own service process writes the file; under load it can still be flushing
    when finish() returns). W&B's record log is LevelDB's log format (32 KiB blocks of records
    with a 7-byte header each) after a 7-byte file header, holding protobuf Records; wandb 0.2x
    dropped its Python reader."""
    (path,) = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        kinds, rows = _wandb_records(path)
        if "exit" in kinds:
            return rows
        assert time.monotonic() < deadline, f"no exit record in {path} after {timeout_s} s: {kinds}"
        time.sleep(0.1)     # the poll of a file another process writes


def _wandb_records(path: str) -> tuple[list[str], list[dict]]:
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, chunk, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:
            offset += block - offset % block      # a block's tail too short for a header: padding
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if offset + 7 + length > len(data):
            break                                  # a record still being written
        chunk += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):                         # FULL, LAST
            records.append(chunk)
            chunk = b""
    kinds, rows = [], []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kinds.append(record.WhichOneof("record_type"))
        if kinds[-1] == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return kinds, rows


def test_wandb_offline_holds_each_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    storage = str(tmp_path / "run")
    callback = WandbCallback(project="elastic-test", dir=str(tmp_path))
    feed = RunFeed()
    rolled_back_run(feed, storage=storage)
    deliver([callback], feed)
    rows = wandb_history(str(tmp_path))
    losses = [(row["step"], row["loss"]) for row in rows if "loss" in row]
    assert losses == [(n, float(n)) for n in range(1, 6)] + [(n, n + 0.5) for n in range(6, 13)]
    assert [(row["step"], row["val_loss"]) for row in rows if "val_loss" in row] == [(10, 2.5)]
    assert [row["elastic/lost_steps"] for row in rows if "elastic/lost_steps" in row] == [3]
    assert callback.run.id == run_key(storage)


def test_trackers_without_their_library_say_what_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"pip install elastic-train\[mlflow\]"):
        MLflowCallback()
    with pytest.raises(ConfigError, match=r"pip install elastic-train\[wandb\]"):
        WandbCallback()

"""The run's record on storage: status.json (live), metrics.jsonl (per step), summary.json (end).

Owned by the controller. status.json and summary.json are rewritten whole and atomically (one
PUT on S3), so a reader never sees a torn file; rewrites are throttled to `min_interval_s` except
on transitions. metrics.jsonl grows by appending the new lines at the same pace; it is rewritten
only when lines already written must go (steps discarded by a rollback, a resume from an earlier
step than the file reaches, a torn line left by a crash).

With `background=True` status.json and metrics.jsonl are written by a thread of their own: a
storage call that stalls (seen for ~55 s on S3 when a node died) must not stall the
controller's failure detection.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from checkpointing.storage import Storage
from elastic._protocol import StepRecord

log = logging.getLogger("elastic.record")


class RunRecorder:
    def __init__(self, url: str, storage_options: dict | None, *, total_steps: int,
                 config: dict[str, Any], min_interval_s: float = 1.0, background: bool = False):
        self._storage = Storage(url, storage_options)
        self._url = url
        self._total_steps = total_steps
        self._config = config
        self._min_interval_s = min_interval_s
        self._started_at = time.time()
        self._unwritten: list[dict[str, Any]] = []    # metrics lines not on storage yet, by step
        self._written_through = 0                     # newest step of the lines on storage
        self._keep_through: int | None = None         # lines on storage past this step must go
        self._newest_step = 0                         # highest step recorded (or loaded on resume)
        self._step_seconds: dict[int, float] = {}   # duration of the kept attempt of each step
        self._last_step_time: float | None = None
        self._world_size_history: list[list[int]] = []
        self._recoveries: list[dict[str, Any]] = []
        self._stragglers: list[dict[str, Any]] = []
        self._fallbacks: list[dict[str, Any]] = []
        self._losses: list[float] = []
        self._status: dict[str, Any] = {}
        self._last_write = 0.0
        self.resumed_from: int | None = None
        self._data: tuple[int, str | None] | None = None   # (samples_seen, data_order) after the newest step
        # The writer thread writes snapshots; this lock guards what it shares with the controller.
        self._lock = threading.Lock()
        self._rollbacks: list[int] = []               # steps rolled back to, for a flush in flight
        self._wake = threading.Event()
        self._closing = False
        self._writer: threading.Thread | None = None
        if background:
            self._writer = threading.Thread(target=self._write_loop, name="run-record-writer", daemon=True)
            self._writer.start()

    @property
    def url(self) -> str:
        return self._url

    @property
    def last_loss(self) -> float | None:
        return self._losses[-1] if self._losses else None

    def load_previous_metrics(self, up_to_step: int) -> None:
        """On resume, keep the lines of the previous run up to the step we resume from."""
        steps, clean = self._steps_on_storage()
        self._written_through = max(steps, default=0)
        self._newest_step = max((step for step in steps if step <= up_to_step), default=0)
        if self._written_through > up_to_step or not clean:
            self._keep_through = up_to_step

    def _steps_on_storage(self) -> tuple[list[int], bool]:
        """Steps of the metrics lines on storage, and whether every line is whole."""
        text = self._read_metrics()
        steps, clean = [], not text or text.endswith("\n")
        for line in text.splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                clean = False
        return steps, clean

    def _read_metrics(self) -> str:
        try:
            return self._storage.read_bytes(self._storage.path("metrics.jsonl")).decode()
        except FileNotFoundError:
            return ""

    # ---- events ------------------------------------------------------------------------
    def on_generation_start(self, step: int, world_size: int) -> None:
        self._world_size_history.append([step, world_size])
        self._last_step_time = time.time()

    def correct_generation_start(self, step: int) -> None:
        if self._world_size_history:
            self._world_size_history[-1][0] = step

    def on_step(self, record: StepRecord, lr: float | None = None) -> None:
        with self._lock:
            self._on_step(record, lr)

    def _on_step(self, record: StepRecord, lr: float | None) -> None:
        if record.step <= self._newest_step:
            self._rollback_to(record.step - 1)
        self._newest_step = record.step
        self._data = (record.samples_seen, record.data_order)
        previous = self._last_step_time or record.time
        self._step_seconds[record.step] = max(0.0, record.time - previous)
        self._last_step_time = record.time
        if record.loss is not None:
            self._losses.append(record.loss)
        self._unwritten.append({
            "step": record.step, "loss": record.loss, "world_size": record.world_size,
            "time": record.time, "lr": record.metrics.get("lr", lr),
            "global_batch": record.global_batch, "accum_steps": record.accum_steps,
            "samples_seen": record.samples_seen, "compute_s": list(record.compute_s)})

    def rollback_to(self, step: int) -> None:
        """The steps after `step` were lost: their attempts leave the record (rare: only then is
        the scan paid, and the file rewritten if it already has them)."""
        with self._lock:
            self._rollback_to(step)

    def _rollback_to(self, step: int) -> None:
        self._rollbacks.append(step)
        for lost in [s for s in self._step_seconds if s > step]:
            del self._step_seconds[lost]
        self._unwritten = [line for line in self._unwritten if line["step"] <= step]
        if self._written_through > step:
            self._keep_through = min(step, self._keep_through if self._keep_through is not None else step)
        self._newest_step = min(self._newest_step, step)

    def on_final_data(self, samples_consumed: int, data_order: str | None) -> None:
        """The finished run's data as rank 0 holds it (authoritative over step records)."""
        self._data = (samples_consumed, data_order)

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        self._recoveries.append(recovery)

    def on_straggler(self, flag: dict[str, Any]) -> None:
        self._stragglers.append(flag)

    def on_checkpoint_fallback(self, fallback: dict[str, Any]) -> None:
        """A committed checkpoint failed verification on load and an older one was used."""
        if fallback not in self._fallbacks:
            log.warning("checkpoint fallback: %s", fallback)
            self._fallbacks.append(fallback)

    # ---- files -------------------------------------------------------------------------
    def write_status(self, *, force: bool = False, **status: Any) -> None:
        with self._lock:
            self._status.update(status)
        now = time.monotonic()
        if not force and now - self._last_write < self._min_interval_s:
            return
        self._last_write = now
        if self._writer is not None:
            self._wake.set()           # the writer takes the newest status when it gets to it
        else:
            self._write_files()

    def close(self) -> None:
        """Stop the writer thread (after its current write) and write the newest status and
        lines; later writes are made inline."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._closing = True
            self._wake.set()
            writer.join(timeout=120)
            self._write_files()

    def _write_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing:
                return
            try:
                self._write_files()
            except Exception:   # noqa: BLE001 - the next write retries; the run goes on
                log.exception("could not write the run record under %s", self._url)

    def _write_files(self) -> None:
        with self._lock:
            status = dict(self._status)
            pending = bool(self._unwritten) or self._keep_through is not None
        # A field may be given as a function: evaluated here, so that what it reads (e.g. a
        # checkpoint listing) is read by the writer, not the controller's loop.
        status = {k: v() if callable(v) else v for k, v in status.items()} | {"updated_at": time.time()}
        self._write_json("status.json", status)
        if pending:
            self.flush_metrics()

    def flush_metrics(self) -> None:
        """Append the new lines; rewrite the file only when lines on it must go. It writes a
        snapshot: steps recorded meanwhile wait for the next flush, and lines it wrote past a
        rollback made meanwhile are marked to go."""
        with self._lock:
            lines, keep, rollbacks_seen = list(self._unwritten), self._keep_through, len(self._rollbacks)
        path = self._storage.path("metrics.jsonl")
        new = "".join(json.dumps(line) + "\n" for line in lines)
        through = None
        try:
            if keep is not None:
                kept, through = [], 0
                for line in self._read_metrics().splitlines():
                    try:
                        step = int(json.loads(line)["step"])
                    except (ValueError, KeyError, TypeError):
                        continue       # torn by a crash
                    if step <= keep:
                        kept.append(line + "\n")
                        through = max(through, step)
                self._storage.write_atomic(path, ("".join(kept) + new).encode())
            elif new:
                self._storage.append(path, new.encode())
        except BaseException:
            # A failed append may have written part of the lines: rewrite the file next time.
            with self._lock:
                self._keep_through = self._written_through if self._keep_through is None else self._keep_through
            raise
        with self._lock:
            if keep is not None:
                self._written_through = through
                if self._keep_through == keep:
                    self._keep_through = None
            if lines:
                self._written_through = lines[-1]["step"]
                flushed = {id(line) for line in lines}
                self._unwritten = [line for line in self._unwritten if id(line) not in flushed]
            newer = self._rollbacks[rollbacks_seen:]
            if newer and self._written_through > min(newer):
                point = min(newer)
                self._keep_through = point if self._keep_through is None else min(self._keep_through, point)

    def _write_json(self, name: str, payload: dict[str, Any]) -> None:
        try:
            self._storage.write_atomic(self._storage.path(name), json.dumps(payload, indent=1).encode())
        except Exception:   # noqa: BLE001 - a status write must not kill the run; the next one retries
            log.exception("could not write %s under %s", name, self._url)

    def write_summary(self, *, status: str, final_step: int, checkpoints: list[int],
                      model_sha256: str | None, error: dict[str, Any] | None) -> dict[str, Any]:
        wall_s = time.time() - self._started_at
        kept = sum(self._step_seconds.values())
        summary = {
            "status": status, "final_step": final_step, "total_steps": self._total_steps,
            "world_size_history": self._world_size_history, "recoveries": self._recoveries,
            "checkpoints": checkpoints,
            "loss_first": self._losses[0] if self._losses else None,
            "loss_last": self._losses[-1] if self._losses else None,
            "model_sha256": model_sha256, "wall_s": round(wall_s, 3),
            "goodput": round(min(1.0, kept / wall_s), 4) if wall_s > 0 else None,
            "resumed_from": self.resumed_from, "stragglers": self._stragglers,
            "checkpoint_fallbacks": self._fallbacks,
            "samples_consumed": self._data[0] if self._data else None,
            "data_order_sha256": self._data[1] if self._data else None,
            "config": self._config, "error": error,
        }
        self.close()
        self.flush_metrics()
        self._write_json("summary.json", summary)
        return summary

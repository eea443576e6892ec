"""The run's record on storage: status.json (live), metrics.jsonl (per step), summary.json (end).

Owned by the controller. status.json and summary.json are rewritten whole and atomically (one
PUT on S3), so a reader never sees a torn file; rewrites are throttled to `min_interval_s` except
on transitions. metrics.jsonl grows by appending the new lines at the same pace; it is rewritten
only when lines already written must go (steps discarded by a rollback, a resume from an earlier
step than the file reaches, a torn line left by a crash).

With `background=True` status.json and metrics.jsonl are written by a thread of their own: a
storage call that stalls (seen for ~55 s on S3 when a node died) must not stall the
controller's failure detection.

metrics.jsonl has two kinds of lines. A step's line: the framework's keys (STEP_KEYS) and, after
them, every metric the loop reported (rank mean). A `ctx.log(...)` line: `{"step": N, "kind":
"log", "time": ..., <its metrics>}`, a line of its own at the step it was logged at (the step's
line may be on storage already), counting no step; readers that count steps skip lines with a
`kind`. A user metric named like a framework key of its line never overwrites it: it is left out
of the line (and of the run's metrics) with a warning, once per name. Both kinds go with the
steps a rollback discards. Every file here is strict JSON: a non-finite value is written `null`.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from array import array
from typing import Any

from checkpointing.storage import Storage
from elastic._feed import FeedKind, RunFeed
from elastic._protocol import StepRecord

log = logging.getLogger("elastic.record")

# The framework's keys of a step's line and of a log line: a user metric never replaces them.
STEP_KEYS = ("step", "loss", "world_size", "time", "lr", "global_batch", "accum_steps", "samples_seen",
             "compute_s", "kind")
LOG_KEYS = ("step", "kind", "time")
LOG_KIND = "log"


def strict(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN nor Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(payload: Any, **kwargs: Any) -> str:
    """Strict JSON of `payload` (non-finite floats as null): what every reader's parser accepts."""
    return json.dumps(strict(payload), allow_nan=False, **kwargs)


class MetricHistory:
    """Each user metric's kept values, as (step, value), compact (a long run has millions)."""

    def __init__(self) -> None:
        self._series: dict[str, tuple[array, array]] = {}

    def add(self, step: int, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue        # only numbers are metrics
            steps, vals = self._series.setdefault(name, (array("q"), array("d")))
            steps.append(step)
            vals.append(value)

    def drop_after(self, step: int) -> None:
        for name, (steps, vals) in list(self._series.items()):
            keep = [i for i, s in enumerate(steps) if s <= step]
            if len(keep) == len(steps):
                continue
            if keep:
                self._series[name] = (array("q", (steps[i] for i in keep)), array("d", (vals[i] for i in keep)))
            else:
                del self._series[name]

    def history(self) -> dict[str, list[list]]:
        """name -> [[step, value], ...] in step order (a log line may arrive after a later step)."""
        return {name: sorted(([s, v] for s, v in zip(steps, vals)), key=lambda sv: sv[0])
                for name, (steps, vals) in self._series.items()}

    def last(self) -> dict[str, float]:
        """name -> its value at the newest step that has one."""
        out = {}
        for name, (steps, vals) in self._series.items():
            newest = max(range(len(steps)), key=lambda i: (steps[i], i))
            out[name] = vals[newest]
        return out


class RunRecorder:
    def __init__(self, url: str, storage_options: dict | None, *, total_steps: int,
                 config: dict[str, Any], min_interval_s: float = 1.0, background: bool = False,
                 feed: RunFeed | None = None):
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
        self._metrics = MetricHistory()               # loss, lr and the loop's metrics of the kept steps
        self._refused: set[str] = set()               # user metric names that collide with a framework key
        self._feed = feed                             # the driver's callbacks' events (None: no callbacks)
        self._newest_commit = 0                       # newest committed step the feed announced (or resumed)
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
        """On resume, keep the lines of the previous run up to the step we resume from (their
        metrics start the run's history: Result.metrics covers the steps before the resume too)."""
        rows, clean = self._lines_on_storage()
        steps = [row["step"] for row in rows]
        self._newest_commit = max(self._newest_commit, up_to_step)     # the previous run's commit
        self._written_through = max(steps, default=0)
        self._newest_step = max((step for step in steps if step <= up_to_step), default=0)
        if self._written_through > up_to_step or not clean:
            self._keep_through = up_to_step
        for row in rows:
            if row["step"] <= up_to_step:
                self._metrics.add(row["step"], _metrics_of_line(row))

    def _lines_on_storage(self) -> tuple[list[dict[str, Any]], bool]:
        """The metrics lines on storage (each with an int `step`), and whether every line is whole."""
        text = self._read_metrics()
        rows, clean = [], not text or text.endswith("\n")
        for line in text.splitlines():
            try:
                row = json.loads(line)
                row["step"] = int(row["step"])
                rows.append(row)
            except (ValueError, KeyError, TypeError):
                clean = False
        return rows, clean

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
        line = {
            "step": record.step, "loss": record.loss, "world_size": record.world_size,
            "time": record.time, "lr": record.metrics.get("lr", lr),
            "global_batch": record.global_batch, "accum_steps": record.accum_steps,
            "samples_seen": record.samples_seen, "compute_s": list(record.compute_s)}
        user = self._user_metrics(record, STEP_KEYS)
        line.update(user)
        kept = {"loss": record.loss} if record.loss is not None else {}
        if "lr" in record.metrics:
            kept["lr"] = record.metrics["lr"]
        self._metrics.add(record.step, kept | user)
        self._unwritten.append(line)
        if self._feed is not None:
            self._feed.put(FeedKind.STEP, dict(line))

    def on_log(self, record: StepRecord) -> None:
        """`ctx.log(...)` values at `record.step`: a line of their own, counting no step."""
        with self._lock:
            user = self._user_metrics(record, LOG_KEYS)
            line = {"step": record.step, "kind": LOG_KIND, "time": record.time} | user
            self._metrics.add(record.step, user)
            self._unwritten.append(line)
            if self._feed is not None:
                self._feed.put(FeedKind.LOG, dict(line))

    def _user_metrics(self, record: StepRecord, framework: tuple[str, ...]) -> dict[str, float]:
        """The record's numeric metrics that are not the line's framework keys (a refused name is
        warned of once). A step's "lr" is no user metric: it is the line's own lr."""
        refused = [k for k in record.metrics if k in framework and k != "lr"]
        for name in refused:
            if name not in self._refused:
                self._refused.add(name)
                log.warning("metric %r (%s line of step %d) has the name of a framework key of metrics.jsonl: "
                            "it is left out; rename it", name, record.kind, record.step)
        return {k: float(v) for k, v in record.metrics.items()
                if k not in framework and isinstance(v, (int, float))}

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
        self._metrics.drop_after(step)
        if self._written_through > step:
            self._keep_through = min(step, self._keep_through if self._keep_through is not None else step)
        self._newest_step = min(self._newest_step, step)

    def on_final_data(self, samples_consumed: int, data_order: str | None) -> None:
        """The finished run's data as rank 0 holds it (authoritative over step records)."""
        self._data = (samples_consumed, data_order)

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        self._recoveries.append(recovery)
        if self._feed is not None:
            self._feed.put(FeedKind.RECOVERY, dict(recovery))

    def on_commits(self, steps: list[int]) -> None:
        """The committed steps as listed now: the feed announces those newer than any before.
        (Listed every few seconds: a commit that `keep` already removed again is not announced.)"""
        with self._lock:
            new = sorted(step for step in steps if step > self._newest_commit)
            if new:
                self._newest_commit = new[-1]
        if self._feed is not None:
            for step in new:
                self._feed.put(FeedKind.CHECKPOINT, {"step": step, "url": checkpoint_url(self._url, step)})

    def user_metrics(self) -> dict[str, Any]:
        """Result.metrics: {"last": {name: value}, "history": {name: [[step, value], ...]}} of the
        kept steps; names are loss, lr and every metric the loop reported or logged."""
        with self._lock:
            return {"last": self._metrics.last(), "history": self._metrics.history()}

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
        # In step order within the batch (stable: a step's line stays before its log lines), since
        # the controller records a tick's log lines after its step lines.
        new = "".join(dumps(line) + "\n" for line in sorted(lines, key=lambda line: line["step"]))
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
                # Lines are in the order they came: a log line may be of an older step than the last.
                self._written_through = max(self._written_through, max(line["step"] for line in lines))
                flushed = {id(line) for line in lines}
                self._unwritten = [line for line in self._unwritten if id(line) not in flushed]
            newer = self._rollbacks[rollbacks_seen:]
            if newer and self._written_through > min(newer):
                point = min(newer)
                self._keep_through = point if self._keep_through is None else min(self._keep_through, point)

    def _write_json(self, name: str, payload: dict[str, Any]) -> None:
        try:
            self._storage.write_atomic(self._storage.path(name), dumps(payload, indent=1).encode())
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
            "metrics": self.user_metrics()["last"],
            "goodput": round(min(1.0, kept / wall_s), 4) if wall_s > 0 else None,
            "resumed_from": self.resumed_from, "stragglers": self._stragglers,
            "checkpoint_fallbacks": self._fallbacks,
            "samples_consumed": self._data[0] if self._data else None,
            "data_order_sha256": self._data[1] if self._data else None,
            "config": self._config, "error": error,
        }
        # The last metrics lines go first (a reader that sees summary.json finds them all), but
        # only best effort: a storage that fails them (full disk, lost credentials) must not
        # cost the run its summary, nor make the controller raise instead of returning it.
        try:
            self.close()
            self.flush_metrics()
        except Exception:   # noqa: BLE001
            log.exception("could not write the last metrics.jsonl lines under %s; summary.json is written anyway",
                          self._url)
        self._write_json("summary.json", summary)
        return strict(summary)      # as on storage


def _metrics_of_line(row: dict[str, Any]) -> dict[str, float]:
    """The run's metrics in a metrics.jsonl line read back (what on_step/on_log kept of it)."""
    if row.get("kind") == LOG_KIND:
        framework: tuple[str, ...] = LOG_KEYS
    else:
        framework = tuple(k for k in STEP_KEYS if k not in ("loss", "lr"))
    out = {}
    for name, value in row.items():
        if name in framework:
            continue
        if value is None and name not in ("loss", "lr"):
            out[name] = math.nan     # a user metric's null was a non-finite value (a loss's may be none)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def checkpoint_url(storage_url: str, step: int) -> str:
    """The URL of the checkpoint of `step` under the run's storage (see checkpointing's layout)."""
    return f"{storage_url.rstrip('/')}/checkpoints/step_{step:08d}"

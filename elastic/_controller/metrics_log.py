"""The run's metrics log: metrics.jsonl on storage, and the run's metrics (Result.metrics) in memory.

One role: keep the kept attempt of each step's metrics. Lines are appended as steps come
(`append_step`, `append_log`), leave again when their steps are lost (`rollback_to`, or a step
recorded again), and reach storage by `flush`: new lines are appended; the file is rewritten only
when lines already on it must go (steps discarded by a rollback, a resume from an earlier step than
the file reaches, a torn line left by a crash). On resume `load_previous` reads the previous run's
lines back, so that the run's metrics cover the steps before the resume too.

Threads: the controller's thread appends and rolls back; `flush` runs on the status writer's
thread (elastic._controller.status_writer) or, inline, on the controller's. `flush` writes a snapshot taken
under the lock, so a rollback made while it writes is honoured by the next flush.

metrics.jsonl has two kinds of lines, each with its `format` (elastic.schemas: the JSON Schema of a
line ships there). A step's line: the framework's keys (STEP_KEYS) and, after them, every metric
the loop reported (rank mean). A `ctx.log(...)` line: `{"format": 1, "step": N, "kind": "log",
"time": ..., <its metrics>}`, a line of its own at the step it was logged at (the step's
line may be on storage already), counting no step; readers that count steps skip lines with a
`kind`. A user metric named like a framework key of its line never overwrites it: it is left out
of the line (and of the run's metrics) with a warning, once per name. Both kinds go with the
steps a rollback discards. Every file of the run record is strict JSON (`dumps`): a non-finite
value is written `null`.
"""
from __future__ import annotations

import json
import logging
import math
import threading
from array import array
from typing import Any

from checkpointing.appendlog import AppendLog
from checkpointing.storage import Storage
from elastic._protocol import StepRecord
from elastic.schemas import METRICS_FORMAT, dumps

log = logging.getLogger("elastic.record")

METRICS_FILE = "metrics.jsonl"

# The framework's keys of a step's line and of a log line: a user metric never replaces them.
STEP_KEYS = ("format", "step", "loss", "world_size", "time", "lr", "global_batch", "accum_steps", "samples_seen",
             "compute_s", "kind")
LOG_KEYS = ("format", "step", "kind", "time")
LOG_KIND = "log"


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
        return {name: sorted(([s, v] for s, v in zip(steps, vals, strict=True)), key=lambda sv: sv[0])
                for name, (steps, vals) in self._series.items()}

    def last(self) -> dict[str, float]:
        """name -> its value at the newest step that has one."""
        out = {}
        for name, (steps, vals) in self._series.items():
            newest = max(range(len(steps)), key=lambda i: (steps[i], i))
            out[name] = vals[newest]
        return out


class MetricsLog:
    def __init__(self, storage: Storage):
        self._storage = storage
        # On object storage an "append" rewrites the whole object: the append log keeps it to small
        # segment objects folded in now and then (checkpointing.appendlog); local files append in place.
        self._log = AppendLog(storage, storage.path(METRICS_FILE))
        # The lock guards what a flush (on the writer's thread) shares with the controller's thread.
        self._lock = threading.Lock()
        self._unwritten: list[dict[str, Any]] = []    # lines not on storage yet, in the order they came
        self._written_through = 0                     # newest step of the lines on storage
        self._keep_through: int | None = None         # lines on storage past this step must go
        self._newest_step = 0                         # highest step recorded (or loaded on resume)
        self._rollbacks: list[int] = []               # steps rolled back to, for a flush in flight
        self._metrics = MetricHistory()               # loss, lr and the loop's metrics of the kept steps
        self._refused: set[str] = set()               # user metric names that collide with a framework key

    @property
    def newest_step(self) -> int:
        return self._newest_step

    # ---- resume ------------------------------------------------------------------------
    def pending(self) -> list[dict[str, Any]]:
        """The lines not on storage yet (the controller's journal keeps them)."""
        with self._lock:
            return [dict(line) for line in self._unwritten]

    def continue_from(self, up_to_step: int, pending: list[dict[str, Any]]) -> None:
        """A replacing controller's: the lines on storage up to `up_to_step` (the lost controller's
        journal's newest step; those after it go, their steps are replayed), and the lines of
        `pending` (those its journal held unwritten) that did not reach storage after all."""
        rows = self.load_previous(up_to_step)
        on_storage = {_line_key(row) for row in rows if row["step"] <= up_to_step}
        missing = [line for line in pending if line["step"] <= up_to_step and _line_key(line) not in on_storage]
        with self._lock:
            self._unwritten = missing + self._unwritten
            for line in missing:
                self._newest_step = max(self._newest_step, line["step"])
                self._metrics.add(line["step"], _metrics_of_line(line))

    def load_previous(self, up_to_step: int) -> list[dict[str, Any]]:
        """On resume, keep the lines of the previous run up to the step we resume from (their
        metrics start the run's history). Returns the lines on storage, all of them."""
        rows, clean = self._lines_on_storage()
        steps = [row["step"] for row in rows]
        with self._lock:
            self._written_through = max(steps, default=0)
            self._newest_step = max((step for step in steps if step <= up_to_step), default=0)
            if self._written_through > up_to_step or not clean:
                self._keep_through = up_to_step
            for row in rows:
                if row["step"] <= up_to_step:
                    self._metrics.add(row["step"], _metrics_of_line(row))
        return rows

    def _lines_on_storage(self) -> tuple[list[dict[str, Any]], bool]:
        """The lines on storage (each with an int `step`), and whether every line is whole."""
        text = self._read()
        rows, clean = [], not text or text.endswith("\n")
        for line in text.splitlines():
            try:
                row = json.loads(line)
                row["step"] = int(row["step"])
                rows.append(row)
            except (ValueError, KeyError, TypeError):
                clean = False
        return rows, clean

    def compact(self) -> None:
        """At the run's end: leave metrics.jsonl as the one complete file the contract names."""
        self._log.compact()

    def _read(self) -> str:
        try:
            return self._log.read().decode()
        except FileNotFoundError:
            return ""

    # ---- lines -------------------------------------------------------------------------
    def append_step(self, record: StepRecord) -> dict[str, Any]:
        """The step's line (a step recorded again replaces the attempts from it on)."""
        with self._lock:
            if record.step <= self._newest_step:
                self._rollback_to(record.step - 1)
            self._newest_step = record.step
            line = {
                "format": METRICS_FORMAT, "step": record.step, "loss": record.loss, "world_size": record.world_size,
                "time": record.time, "lr": record.metrics.get("lr"),
                "global_batch": record.global_batch, "accum_steps": record.accum_steps,
                "samples_seen": record.samples_seen, "compute_s": [round(c, 6) for c in record.compute_s]}
            user = self._user_metrics(record, STEP_KEYS)
            line.update(user)
            kept = {"loss": record.loss} if record.loss is not None else {}
            if "lr" in record.metrics:
                kept["lr"] = record.metrics["lr"]
            self._metrics.add(record.step, kept | user)
            self._unwritten.append(line)
            return line

    def append_log(self, record: StepRecord) -> dict[str, Any]:
        """`ctx.log(...)` values at `record.step`: a line of their own, counting no step."""
        with self._lock:
            user = self._user_metrics(record, LOG_KEYS)
            line = {"format": METRICS_FORMAT, "step": record.step, "kind": LOG_KIND, "time": record.time} | user
            self._metrics.add(record.step, user)
            self._unwritten.append(line)
            return line

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
        """The steps after `step` were lost: their lines and metrics go (the file is rewritten at
        the next flush if it already has them)."""
        with self._lock:
            self._rollback_to(step)

    def _rollback_to(self, step: int) -> None:
        self._rollbacks.append(step)
        self._unwritten = [line for line in self._unwritten if line["step"] <= step]
        self._metrics.drop_after(step)
        if self._written_through > step:
            self._keep_through = min(step, self._keep_through if self._keep_through is not None else step)
        self._newest_step = min(self._newest_step, step)

    def user_metrics(self) -> dict[str, Any]:
        """Result.metrics: {"last": {name: value}, "history": {name: [[step, value], ...]}} of the
        kept steps; names are loss, lr and every metric the loop reported or logged."""
        with self._lock:
            return {"last": self._metrics.last(), "history": self._metrics.history()}

    # ---- storage -----------------------------------------------------------------------
    def flush(self) -> None:
        """Append the new lines; rewrite the file only when lines on it must go. It writes a
        snapshot: steps recorded meanwhile wait for the next flush, and lines it wrote past a
        rollback made meanwhile are marked to go."""
        with self._lock:
            lines, keep, rollbacks_seen = list(self._unwritten), self._keep_through, len(self._rollbacks)
        if not lines and keep is None:
            return
        # In step order within the batch (stable: a step's line stays before its log lines), since
        # the controller records a tick's log lines after its step lines.
        new = "".join(dumps(line) + "\n" for line in sorted(lines, key=lambda line: line["step"]))
        through = 0          # with lines to drop (keep): the newest step the rewritten file keeps
        try:
            if keep is not None:
                kept: list[str] = []
                for line in self._read().splitlines():
                    try:
                        step = int(json.loads(line)["step"])
                    except (ValueError, KeyError, TypeError):
                        continue       # torn by a crash
                    if step <= keep:
                        kept.append(line + "\n")
                        through = max(through, step)
                self._log.rewrite(("".join(kept) + new).encode())
            else:
                self._log.append(new.encode())
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


def _line_key(line: dict[str, Any]) -> tuple:
    """What tells two metrics lines apart (a line read back from storage and one in memory)."""
    return line["step"], line.get("kind"), line.get("time")


def _metrics_of_line(row: dict[str, Any]) -> dict[str, float]:
    """The run's metrics in a metrics.jsonl line read back (what append_step/append_log kept of it)."""
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

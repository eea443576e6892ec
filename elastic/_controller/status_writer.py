"""The run's status writer: status.json, rewritten whole at most every `min_interval_s` (at once
on a transition), and the metrics log's flush after it.

One role: decide when the record goes to storage, and keep that off the controller's thread. The
controller hands over the newest status fields (`update`); with `background=True` a thread of the
writer's own ("run-record-writer") writes them and flushes the metrics log, so a storage call that
stalls (seen for ~55 s on S3 when a node died) does not stall the controller's failure detection.
Without it, the write is made inline, on the caller's thread.

It is handed what it does explicitly: `write(status)` writes status.json, `flush()` appends the
metrics lines. A status field given as a callable (the worker lists, a record per worker) is
called here, on the writer's thread, when the status is written: building it never costs the
controller's loop; it must be safe to call from that thread, and must not read storage (a stalled
read would hold up every write after it: the newest committed step comes as a plain value,
found by the commit watch on its own thread).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("elastic.record")

CLOSE_WAIT_S = 120.0      # close() waits this long for a write in flight, then writes inline anyway


class StatusWriter:
    def __init__(self, write: Callable[[dict[str, Any]], None], flush: Callable[[], None], *,
                 min_interval_s: float = 1.0, background: bool = False, name: str = "the run record",
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        self._write = write
        self._flush = flush
        self._min_interval_s = min_interval_s
        self._name = name                             # what a failed write's log line names (the run's URL)
        self._clock = clock                           # the throttle's
        self._wall_clock = wall_clock                 # status.json's updated_at
        self._lock = threading.Lock()                 # guards the fields the writer's thread snapshots
        self._status: dict[str, Any] = {}
        self._last_write = -float("inf")
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="run-record-writer", daemon=True)
            self._thread.start()

    def update(self, *, force: bool = False, **status: Any) -> None:
        """Take the newest status fields; write them unless a write was made less than
        `min_interval_s` ago (`force`: a transition, written now). Never waits on storage in
        background mode: the thread takes the newest fields when it gets to them."""
        with self._lock:
            self._status.update(status)
        now = self._clock()
        if not force and now - self._last_write < self._min_interval_s:
            return
        self._last_write = now
        if self._thread is not None:
            self._wake.set()
        else:
            self.write_now()

    def close(self) -> None:
        """Stop the thread (after its current write) and write the newest status and lines;
        later writes are made inline."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._closing = True
            self._wake.set()
            thread.join(timeout=CLOSE_WAIT_S)
            self.write_now()

    def write_now(self) -> None:
        """status.json (its callable fields called now), then the metrics lines. A failed flush
        raises; a failed status write is logged by `write`."""
        with self._lock:
            status = dict(self._status)
        status = {k: v() if callable(v) else v for k, v in status.items()} | {"updated_at": self._wall_clock()}
        self._write(status)
        self._flush()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing:
                return
            try:
                self.write_now()
            except Exception:   # the next write retries; the run goes on
                log.exception("could not write the run record under %s", self._name)

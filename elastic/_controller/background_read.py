"""A storage read the control loop needs, made on a thread of its own: the loop reads a plain value.

Why: a storage call on the controller's thread stalls failure detection for as long as the call
stalls (S3 calls have been seen to hang ~55 s when a node died), and every other judgement with
it. What the loop needs from storage while a run goes (a STOP request, the newest committed
step) is read here, every `every_s` or at once after `wake()`, and the loop takes the newest
result (`value`) without waiting. A failed read keeps the last value; it is logged once as a
warning (with what was being read), then at DEBUG until a read succeeds again.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("elastic.controller")

T = TypeVar("T")

CLOSE_WAIT_S = 5.0     # close() waits this long for a read in flight (a stuck one is left behind: daemon)


class BackgroundRead(Generic[T]):
    """`read()` every `every_s` on a daemon thread named `name`, from `start()` to `close()`;
    `value` is the newest result (`initial` until the first read succeeds)."""

    def __init__(self, name: str, read: Callable[[], T], every_s: float, initial: T, *, what: str):
        self.value: T = initial
        self._name, self._read, self._every_s, self._what = name, read, every_s, what
        self._wake = threading.Event()
        self._closed = False
        self._failing = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start reading (a second call does nothing)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Read again now, not at the end of the interval."""
        self._wake.set()

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Stop reading, after the read in flight (waited for at most `timeout_s`)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._closed:
            try:
                value = self._read()
            except Exception:   # noqa: BLE001 - read again at the next interval; the run goes on
                (log.debug if self._failing else log.warning)(
                    "could not read %s (tried again every %.0fs)", self._what, self._every_s, exc_info=True)
                self._failing = True
            else:
                self.value = value
                if self._failing:
                    log.info("read %s again", self._what)
                self._failing = False
            self._wake.wait(self._every_s)
            self._wake.clear()

"""The driver's feed of run events: each metrics line, recovery and commit, numbered, handed out once.

The run record fills it in the controller's actor; `ElasticTrainer.fit` drains it about once a
second and hands the events to the user's callbacks (elastic.callbacks). An event stays until the
driver asks for the events after it: an answer lost on the way (a call that timed out) is asked
for again, so no event is skipped and none is delivered twice. Only a run with callbacks has a feed
(nobody drains it otherwise).
"""
from __future__ import annotations

import enum
import threading
from typing import Any


class FeedKind(enum.StrEnum):
    START = "start"             # the run trains: its first step of this invocation is next (callbacks' on_start)
    STEP = "step"               # a step's metrics.jsonl line
    LOG = "log"                 # a `ctx.log(...)` line of metrics.jsonl
    RECOVERY = "recovery"       # a closed recovery, as summary.json lists it
    CHECKPOINT = "checkpoint"   # a newly committed checkpoint: {step, url}
    # {step}: no recovery but a storage fallback takes the steps up to it back (RunSpec.kept_through);
    # what the callbacks that record only kept steps wait for (Callback.kept_steps_only)
    KEPT = "kept"


Event = tuple[int, FeedKind, dict[str, Any]]   # (number, kind, payload); numbers start at 1

MAX_EVENTS_PER_CALL = 10_000     # a driver that fell behind catches up over several calls
# A replacing controller's feed numbers its events from this far past its journal's: above any
# number the lost controller gave after its journal was written, so the driver skips none of them.
# Their events may repeat what the driver had (the replayed steps): the driver's end of the feed
# (elastic.callbacks.CallbackRunner) delivers each step once.
RESTART_GAP = 1 << 32


class RunFeed:
    def __init__(self) -> None:
        self._events: list[Event] = []
        self._next = 1
        self._lock = threading.Lock()      # filled by the controller's thread, drained by the driver's calls

    def put(self, kind: FeedKind, payload: dict[str, Any]) -> None:
        with self._lock:
            self._events.append((self._next, kind, payload))
            self._next += 1

    @property
    def next(self) -> int:
        """The next event's number."""
        with self._lock:
            return self._next

    def continue_after(self, journal_next: int) -> None:
        """This feed replaces a lost controller's, whose journal had reached `journal_next` (see RESTART_GAP)."""
        with self._lock:
            self._next = max(self._next, journal_next + RESTART_GAP)

    def after(self, number: int) -> list[Event]:
        """The events after `number` (the newest one the driver has); those up to it are dropped."""
        with self._lock:
            if self._events and self._events[0][0] <= number:
                self._events = [event for event in self._events if event[0] > number]
            return self._events[:MAX_EVENTS_PER_CALL]

"""Telling the loop's bug from a fault: the same error, at the same step, every time.

A process group that breaks with no lost peer is retried: a connection reset, a peer that
timed out once. A bug in the loop's collectives breaks it too (ranks passing tensors of other
shapes, a rank skipping a collective, a wrong `src`): gloo and NCCL report those as broken
collectives, not as the user's error. Retried, such a bug breaks the group again at the same
step, each time after `heartbeat_timeout_s`, until `max_failures` is spent, and the run then
ends on a count of failures instead of the error that would have told the user what to fix.

`RecurringErrors` keeps the errors of the last failures; when one breaks the group again at the
same step, `attempts` times in a row, the controller fails the run with it as the user's error.
Pure (no Ray, no torch, no clock), so the rule is tested on its own.
"""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# Numbers differ between two identical failures: ports, addresses, pids, timings, line numbers.
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")
# A rank waiting on the one that raised sees only its connection go or its wait time out: the
# consequence of an error elsewhere, and what a real fault (a flapping link, a stalled peer) looks
# like too. Such errors never make a failure recurring by themselves: only an error of its own.
_CONSEQUENCES = re.compile(r"closed by peer|reset by peer|pair closure|timed out|timeout|broken pipe",
                           re.IGNORECASE)


@dataclass(frozen=True)
class ErrorSighting:
    """One rank's error in one failure."""

    rank: int
    step: int                  # steps its state had completed: the error broke step + 1
    error_type: str | None
    message: str | None

    @property
    def key(self) -> tuple[int, str, str]:
        return self.step, self.error_type or "", _NUMBERS.sub("#", self.message or "")

    @property
    def is_consequence(self) -> bool:
        """A lost connection or a timeout: what this rank saw of an error elsewhere, or of a fault."""
        return bool(_CONSEQUENCES.search(self.message or ""))


class RecurringErrors:
    """The errors of the last `attempts` failures. Use `observe` once per failure."""

    def __init__(self, attempts: int = 2):
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.attempts = attempts
        self._previous: deque[set[tuple[int, str, str]]] = deque(maxlen=attempts - 1)

    def observe(self, sightings: Sequence[ErrorSighting]) -> ErrorSighting | None:
        """Record one failure's errors (one per rank that reported one). Returns the error that
        broke the group at the same step in this failure and each of the `attempts - 1` before
        it (same type, same message up to numbers), or None while it may still be a fault.
        Lost connections and timeouts are not counted (see `ErrorSighting.is_consequence`)."""
        keys = {s.key for s in sightings if not s.is_consequence}
        recurring = set(keys)
        for previous in self._previous:
            recurring &= previous
        full = len(self._previous) == self.attempts - 1
        self._previous.append(keys)
        if not full or not recurring:
            return None
        return next(s for s in sightings if s.key in recurring)

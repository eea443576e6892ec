"""Storage calls of the control loop, retried across ticks instead of ending the run.

Reading the newest checkpoint and writing the generation fence go to object storage, which
fails transiently (a throttled bucket, a restarting endpoint). `StorageRetry` turns such an
error into "not now": the controller tries again on a later tick, with backoff, and the error
is charged to the failure budget once (as `storage_error`), however many ticks it lasts. It
becomes fatal only when it has lasted FailureConfig.rendezvous_timeout_s, when the budget is
spent, or when the storage fences this run out (another run took it over).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic._controller.failure_budget import FailureBudget
from elastic.policies import Cause, Failure

log = logging.getLogger("elastic.controller")


@dataclass(frozen=True)
class StorageResult:
    ok: bool
    value: Any = None
    fatal: Exception | None = None     # the run fails with this ...
    failure: Failure | None = None     # ... charged as this failure, if any


@dataclass
class _Trouble:
    since: float
    attempts: int = 0
    retry_at: float = 0.0


class StorageRetry:
    """An ongoing storage error and its backoff (at most one at a time)."""

    def __init__(self, budget: FailureBudget, clock: Callable[[], float], give_up_after_s: float):
        self._budget, self._clock, self._give_up_after_s = budget, clock, give_up_after_s
        self._trouble: _Trouble | None = None

    def call(self, what: str, fn: Callable[[], Any]) -> StorageResult:
        from checkpointing import FencedError, StorageError
        now, trouble = self._clock(), self._trouble
        if trouble is not None and now < trouble.retry_at:
            return StorageResult(False)
        try:
            value = fn()
        except FencedError as error:
            # Another run holds the storage now (it took it over), or is past this one: stop.
            return StorageResult(False, fatal=error)
        except StorageError as error:
            if trouble is None:
                trouble = self._trouble = _Trouble(since=now)
                failure = Failure(Cause.STORAGE_ERROR, (), f"{what}: {error}")
                decision = self._budget.charge(failure)
                if decision.action == "fail":
                    return StorageResult(False, fatal=self._budget.exhausted(decision, failure), failure=failure)
            trouble.attempts += 1
            if now - trouble.since > self._give_up_after_s:
                return StorageResult(False, fatal=error)
            delay = min(10.0, 0.5 * 2 ** trouble.attempts)
            trouble.retry_at = now + delay
            log.warning("storage: %s failed (%s); retrying in %.1fs", what, error, delay)
            return StorageResult(False)
        self._trouble = None
        return StorageResult(True, value)

"""The controller's journal: what a controller that replaces a lost one needs and cannot read back
from storage or from the workers.

Storage holds the run's truth (FENCE, the manifests, metrics.jsonl, status.json) and the live
workers hold theirs (generation, rank, step, the records of their recent steps). What neither
holds is the controller's own account of the run: the state it is in and with which members, the
summary it accumulates (generations, recoveries, the time ledger), the failure budget spent, the
step and recovery ledgers, the nodes marked bad, the restarts so far. A `JournalEntry` is that
account as of one tick, pickled and kept where the next controller finds it.

Where: Ray's internal key-value store (the GCS), under the run's id (`RayJournal`). It outlives
the controller's process and node, not the Ray cluster's head; a run that loses the head loses
its workers too (docs/scale.md). It is written at every change of state and at most every
JOURNAL_EVERY_S otherwise (`Journal.due`), on the controller's thread, so that each entry is one
consistent cut of the controller's state; what happened after it is replayed from the workers'
records (state.Outbox.replay), which is why an entry only needs to be recent, not current.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from elastic._run_names import NAMESPACE

if TYPE_CHECKING:
    from elastic._controller.bad_nodes import BadNodes
    from elastic._controller.failure_budget import FailureBudget
    from elastic._controller.intake import IntakePosition
    from elastic._controller.ledgers import RecoveryLedger, StepLedger
    from elastic._controller.run_summary import RunSummary
    from elastic._controller.states import AnyState

log = logging.getLogger("elastic.controller")

JOURNAL_EVERY_S = 1.0       # the oldest an entry gets while nothing changes state (the status.json pace)
ENDED = b"ended"            # what the journal holds once the run ended
END_WAIT_S = 10.0           # how long the run's end waits for its journal to say so


@dataclass
class RecordState:
    """The run record's part of an entry (RunRecorder.journal_state / restore_journal)."""

    summary: RunSummary
    metrics_step: int                  # newest step of the metrics lines the summary has taken
    pending_lines: list[dict[str, Any]]   # those of its lines not on storage yet (a flush may not come)
    newest_commit: int                 # newest commit announced to the driver's feed
    feed_next: int                     # the feed's next event number


@dataclass
class JournalEntry:
    """The controller's account of the run as of one tick (see the module)."""

    written_at: float                  # wall clock
    state: AnyState
    generation: int                    # the newest generation started (GenerationFormer)
    intake: IntakePosition             # the newest step kept, the generations' starts
    next_wid: int                      # worker ids are never given twice, across controllers too
    record: RecordState
    steps: StepLedger
    recoveries: RecoveryLedger
    budget: FailureBudget
    bad_nodes: BadNodes
    history: list[tuple[str, str, str]]
    model_sha256: str | None
    last_committed: int | None
    world_size: int


class JournalStore(Protocol):
    """Where entries are kept (RayJournal; the unit tests' in-memory one)."""

    def put(self, data: bytes) -> None: ...
    def get(self) -> bytes | None: ...
    def delete(self) -> None: ...


class RayJournal:
    """The run's entry in Ray's internal key-value store (the GCS), under its run id."""

    def __init__(self, run_id: str):
        self._key = f"{run_id}/controller-journal"

    def put(self, data: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put
        _internal_kv_put(self._key, data, overwrite=True, namespace=NAMESPACE)

    def get(self) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get
        return _internal_kv_get(self._key, namespace=NAMESPACE)

    def delete(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del
        _internal_kv_del(self._key, namespace=NAMESPACE)


class BackgroundPuts:
    """A journal store whose `put` returns at once: the newest data is written by a daemon thread
    of its own (an older one not written yet is dropped: only the newest entry matters). Why: a
    GCS that is down (restarting under GCS fault tolerance) blocks a key-value put until it is
    back, and on the controller's thread that stalled the control loop for as long, status.json
    and failure detection with it (tests/integration/test_gcs_restart.py). `get` and `delete`
    go straight to the store: the first is read before any put, the second by a driver after
    the run."""

    def __init__(self, store: JournalStore):
        self._store = store
        self._pending: bytes | None = None
        self._ready = threading.Condition()
        self._failing = False
        threading.Thread(target=self._loop, name="controller-journal", daemon=True).start()

    def put(self, data: bytes) -> None:
        with self._ready:
            self._pending = data
            self._ready.notify()

    def get(self) -> bytes | None:
        return self._store.get()

    def delete(self) -> None:
        self._store.delete()

    def flush(self, timeout_s: float) -> bool:
        """Wait until the newest data handed over is written (or `timeout_s`); whether it was."""
        with self._ready:
            return self._ready.wait_for(lambda: self._pending is None, timeout_s)

    def _loop(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._pending is not None)
                data = self._pending
            assert data is not None
            try:
                self._store.put(data)
            except Exception:   # the next entry is written at the next tick
                if not self._failing:
                    log.warning("could not write the controller's journal (a replacing controller would "
                                "replay more of the workers' records)", exc_info=True)
                self._failing = True
            else:
                self._failing = False
            with self._ready:
                if self._pending is data:       # nothing newer came meanwhile
                    self._pending = None
                    self._ready.notify_all()


class Journal:
    """Writes the controller's entries to a store (pickled: the budget holds the user's policy) and
    reads the newest back. A write that fails is logged and retried at the next tick: the run goes
    on, and a replacing controller replays more of the workers' records."""

    def __init__(self, store: JournalStore, every_s: float = JOURNAL_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self._store, self._every_s, self._clock = store, every_s, clock
        self._written_at = -float("inf")
        self._failing = False

    def due(self, force: bool) -> bool:
        return force or self._clock() - self._written_at >= self._every_s

    def write(self, entry: JournalEntry) -> None:
        from ray import cloudpickle
        try:
            self._store.put(cloudpickle.dumps(entry))
        except Exception:
            if not self._failing:
                log.warning("could not write the controller's journal (a replacing controller would replay "
                            "more of the workers' records)", exc_info=True)
            self._failing = True
            return
        self._failing = False
        self._written_at = self._clock()

    def read(self) -> JournalEntry | None:
        """The newest entry, or None (none was written, the run ended, or it cannot be read back)."""
        import pickle
        try:
            data = self._store.get()
            return pickle.loads(data) if data and data != ENDED else None
        except Exception:
            log.warning("the controller's journal could not be read back", exc_info=True)
            return None

    def opening(self) -> tuple[JournalEntry | None, bool]:
        """What a starting controller reads, in one GCS read: the newest entry (as `read`), and
        whether the run ended (as `ended`)."""
        import pickle
        try:
            data = self._store.get()
        except Exception:
            log.warning("the controller's journal could not be read back", exc_info=True)
            return None, False
        if data == ENDED:
            return None, True
        try:
            return (pickle.loads(data) if data else None), False
        except Exception:
            log.warning("the controller's journal could not be read back", exc_info=True)
            return None, False

    def end(self) -> None:
        """The run ended: a restart of its controller (Ray restarts a detached actor that dies
        after the run) adopts nothing and starts nothing; its driver, if any, reads the record
        on storage."""
        try:
            self._store.put(ENDED)
            # Written before the outcome goes to the driver, whose reap deletes the entry after.
            if isinstance(self._store, BackgroundPuts) and not self._store.flush(END_WAIT_S):
                log.warning("the controller's journal was not marked ended within %.0fs", END_WAIT_S)
        except Exception:   # the workers are gone: a restart would find nothing to adopt
            log.warning("could not mark the controller's journal ended", exc_info=True)

    def ended(self) -> bool:
        try:
            return self._store.get() == ENDED
        except Exception:   # noqa: BLE001 - read again by whoever asks next
            return False

    def close(self) -> None:
        """The run's driver has its outcome: nothing of the run is left to read."""
        try:
            self._store.delete()
        except Exception:   # a stale entry is only read by a restart of this run
            log.debug("could not delete the controller's journal", exc_info=True)

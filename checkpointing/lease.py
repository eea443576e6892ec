"""The run lease: at most one run writes to a storage URL at a time.

Two runs on one URL (a job resubmitted while the old driver still runs, a retried Kubernetes
job) would share generations, write the same shard files and collect each other's checkpoints.
The lease is an owner field in `<url>/checkpoints/FENCE` (`run_id`), taken by compare-and-swap,
and a renewal time (`lease_at`, the holder's wall clock) that the holder keeps fresh:

  * The holder renews it (`LeaseKeeper`, a thread that does nothing else) every
    `stale_after_s / 4`, each renewal a compare-and-swap of FENCE that also checks FENCE still
    names the holder. A run is *live* while FENCE names it and its `lease_at` is younger than
    `stale_after_s`, unless its `<url>/status.json` says it ended (`finished`, `failed`,
    `stopped`, `stopped_early`). Liveness rests on the renewal alone, not on status.json's
    `updated_at`: a stalled status.json write or checkpoint listing does not make a live run
    look dead. (A status.json with no lease holder in FENCE, from a runtime that predates run
    ids, is still judged by its `updated_at`.)
  * `acquire_run_lease(url, run_id)` takes the lease when no other run holds it, or the holder
    is not live (a crashed run's storage is taken over once its lease has gone stale, so a
    plain re-run resumes), and raises `RunConflictError` naming the live holder otherwise.
    `takeover=True` takes it regardless: for an operator who knows the holder is dead (or
    wants it stopped).
  * A holder that finds at a renewal that another run took FENCE over has lost the lease:
    `LeaseKeeper.lost()` says so, as a RunConflictError, and the run must stop writing and end
    (the runtime's controller fails the run with it at its next tick). One that could not renew
    for `3/4` of `stale_after_s` (after that another run may judge it dead and take the storage)
    is unconfirmed: it writes none of its files (`LeaseKeeper.holds()` is False) until a renewal
    goes through again, which also tells whether another run took the storage meanwhile.
  * Every later fence update of the run (`RunLease.fence`, or
    `CheckpointManager.set_generation(..., run_id=)`) checks the owner in the same
    compare-and-swap: a run whose storage was taken over gets RunConflictError (a FencedError)
    at its next generation, and its workers are fenced by the taker's higher generation.

`DEFAULT_STALE_AFTER_S` is 60 s: four renewal intervals of 15 s, more than botocore's retry
budget for one stalled PUT (5 attempts with backoff) and than ordinary clock skew between hosts
(the check compares the holder's `lease_at` with this host's clock: keep clocks in sync, NTP).
A crashed run's URL can be reused without `takeover` once that long has passed.

Two runs that pass the liveness check at the same moment cannot both win: the owner field is
written by CAS, and the loser re-reads and finds a fresh lease.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from checkpointing import manifest as mf
from checkpointing.errors import RunConflictError
from checkpointing.masking import mask_text, mask_url
from checkpointing.storage import Storage

log = logging.getLogger("checkpointing.lease")

DEFAULT_STALE_AFTER_S = 60.0
# The holder's timing, as shares of the staleness bound (LeaseKeeper):
RENEW_EVERY = 0.25        # a renewal this often
RETRY_EVERY = 0.05        # a failed renewal is tried again this soon
UNCONFIRMED_AFTER = 0.75  # no renewal for this long: unconfirmed, the run stops writing (before a taker may come)
STATUS_NAME = "status.json"
FINAL_STATES = frozenset({"finished", "failed", "stopped", "stopped_early"})


@dataclasses.dataclass(frozen=True)
class RunLease:
    """A run's hold on a storage URL. Plain data: pickles across Ray actors."""

    url: str
    run_id: str
    generation: int | None  # FENCE's generation when the lease was taken: start at generation + 1
    taken_over_from: str | None = None  # the previous holder, when it was taken from a run
    storage_options: dict | None = None

    def fence(self, generation: int, *, start_step: int | None = None) -> None:
        """Start `generation` (FENCE compare-and-swap, with this run as owner). RunConflictError
        if another run took the storage over, FencedError if FENCE is already past it."""
        mf.advance_fence(Storage(self.url, self.storage_options), generation,
                         start_step=start_step, run_id=self.run_id)

    def renew(self, *, clock: Callable[[], float] = time.time) -> float:
        """Renew the lease (FENCE compare-and-swap of `lease_at`); returns the `lease_at` written.
        RunConflictError if FENCE no longer names this run."""
        return renew_run_lease(self.url, self.run_id, storage_options=self.storage_options, clock=clock)

    def release(self) -> None:
        """Let go at the end of the run: the next run needs no staleness wait or takeover.
        A no-op if another run holds the storage by now."""
        release_run_lease(self.url, self.run_id, storage_options=self.storage_options)


def _holder_status(storage: Storage) -> dict[str, Any] | None:
    try:
        doc = json.loads(storage.read_bytes(storage.path(STATUS_NAME)))
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # torn or not JSON: no evidence of a live run
    return doc if isinstance(doc, dict) else None


def _status_words(status: dict[str, Any], now: float) -> str:
    """What a holder's status.json says about it, for the error message."""
    updated = status.get("updated_at")
    age = now - updated if isinstance(updated, (int, float)) and not isinstance(updated, bool) else None
    pids = [w.get("pid") for w in status.get("workers") or [] if isinstance(w, dict)]
    return (f"status.json: state {status.get('state')!r}, generation {status.get('generation')}, step "
            f"{status.get('step')}" + (f", updated {max(0.0, age):.1f}s ago" if age is not None else "")
            + (f", worker pids {pids}" if pids else ""))


def _liveness(storage: Storage, fence: mf.Fence | None, run_id: str, stale_after_s: float,
              now: float) -> str | None:
    """A description of the live run holding `storage` other than `run_id`, or None."""
    owner = fence.run_id if fence is not None and not fence.released else None
    status = _holder_status(storage)
    if owner is None:
        # No holder named in FENCE: a runtime that predates run ids, whose only proof of life is
        # its status.json's updated_at.
        if status is None:
            return None
        writer = status.get("run_id")
        updated = status.get("updated_at")
        age = now - updated if isinstance(updated, (int, float)) and not isinstance(updated, bool) else None
        if writer != run_id and age is not None and age <= stale_after_s and status.get("state") not in FINAL_STATES:
            return f"run {writer or '(no run id)'} ({_status_words(status, now)})"
        return None
    if owner == run_id:
        return None
    # A status.json without a run id is the lease holder's (runtimes that predate run ids).
    says = status if status is not None and (status.get("run_id") or owner) == owner else None
    if says is not None and says.get("state") in FINAL_STATES:
        return None  # the holder wrote its final state: it has ended
    assert fence is not None
    if fence.lease_at is not None and now - fence.lease_at <= stale_after_s:
        return (f"run {owner} (took the lease, renewed {max(0.0, now - fence.lease_at):.1f}s ago"
                + (f"; {_status_words(says, now)}" if says is not None else "") + ")")
    return None


def renew_run_lease(url: str, run_id: str, *, storage_options: dict | None = None,
                    clock: Callable[[], float] = time.time) -> float:
    """Renew the lease of `run_id` on `url`: a compare-and-swap of FENCE's `lease_at` (the same
    conditional write that took it). Returns the `lease_at` written. Raises RunConflictError
    when FENCE no longer names `run_id` (`.owner`: the run that holds it now, None if none does):
    another run took the storage over, or the lease was released."""
    storage = Storage(url, storage_options)
    written: list[float] = []

    def change(cur: mf.Fence | None) -> mf.Fence:
        if cur is None or cur.run_id != run_id or cur.released:
            owner = cur.run_id if cur is not None and not cur.released else None
            why = (f"run {owner} took the storage over" if owner is not None
                   else "its lease was released or FENCE removed")
            raise RunConflictError(f"{url} is no longer held by this run ({run_id}): {why}; this run must stop "
                                   f"writing there", url=url, owner=owner)
        written.append(clock())
        return dataclasses.replace(cur, lease_at=written[-1], token=None)

    mf.update_fence(storage, change)
    return written[-1]


def acquire_run_lease(url: str, run_id: str, *, storage_options: dict | None = None,
                      stale_after_s: float = DEFAULT_STALE_AFTER_S, takeover: bool = False,
                      clock=time.time) -> RunLease:
    """Take `url` for run `run_id` before anything of the run is written there.

    Raises RunConflictError (a FencedError; `.owner` names the holder) when another run is
    live on `url`. Re-acquiring by the same `run_id` is a no-op that succeeds.
    """
    if not run_id or not isinstance(run_id, str):
        raise ValueError(f"acquire_run_lease: run_id must be a non-empty string, got {run_id!r}")
    if not stale_after_s > 0:
        raise ValueError(f"acquire_run_lease(stale_after_s={stale_after_s}) must be > 0")
    storage = Storage(url, storage_options)
    previous: dict[str, Any] = {}

    def change(cur: mf.Fence | None) -> mf.Fence:
        now = clock()
        live = _liveness(storage, cur, run_id, stale_after_s, now)
        if live is not None and not takeover:
            owner = cur.run_id if cur is not None else None
            raise RunConflictError(
                f"storage {storage.display_url} is in use by {live}; two runs on one storage would overwrite each "
                f"other's checkpoints. Stop that run (or wait for it), use another storage URL, or, if it "
                f"is dead, wait until its lease is {stale_after_s:.0f}s old (a live run renews it every "
                f"{stale_after_s * RENEW_EVERY:.0f}s) or take the storage "
                f"over explicitly (takeover=True)", url=url, owner=owner)
        previous["owner"] = cur.run_id if cur is not None and cur.run_id != run_id else None
        return mf.Fence(generation=cur.generation if cur is not None else None, run_id=run_id,
                        lease_at=now, released=False,
                        history=cur.history if cur is not None else ())

    fence = mf.update_fence(storage, change)
    return RunLease(url=url, run_id=run_id, generation=fence.generation,
                    taken_over_from=previous.get("owner"), storage_options=storage_options)


def release_run_lease(url: str, run_id: str, *, storage_options: dict | None = None) -> None:
    """Mark the lease of `run_id` on `url` released (no-op if another run holds it)."""
    storage = Storage(url, storage_options)

    def change(cur: mf.Fence | None) -> mf.Fence | None:
        if cur is None or cur.run_id != run_id or cur.released:
            return None
        return dataclasses.replace(cur, released=True, token=None)

    mf.update_fence(storage, change)


class LeaseKeeper:
    """Keeps a run's lease while the run goes: renews it on a thread of its own
    ("run-lease-keeper") that does nothing else, and says when the lease is lost.

    Why a thread of its own: the lease is the run's proof of life to any other run that would
    start on its storage. Renewed as a side effect of other work (status.json writes, a control
    loop's tick), it stopped whenever that work stalled (a status write or listing stuck for
    ~55 s on S3, a tick blocked on a Ray call), and a live run's storage could be taken over.

    Timing, all from `stale_after_s` (the bound by which another run judges the holder dead):
    a renewal every `stale_after_s / 4`; a failed one tried again after `stale_after_s / 20`.
    Each renewal is a compare-and-swap of FENCE that checks that FENCE still names this run.
    The lease is *lost* when a renewal finds another run holding FENCE (it took the storage
    over): that is final, and the run ends. It is *unconfirmed* while no renewal has succeeded for
    `3/4` of the bound, counted from the start of the last one that did: that deadline is a
    renewal's timeout (one stuck in a storage call counts as failing), and it comes before another
    run may judge this one dead. An unconfirmed run writes none of its own files (`holds()` is
    False) but trains on, and the keeper goes on trying: a storage stall is not a conflict, and
    ending the run for one would make any stall longer than the bound's quarter fatal. The first
    renewal that goes through again confirms it (FENCE still names this run: nobody took over
    meanwhile) and the writes resume; one that finds another run holding FENCE loses it.

    `lost()` and `holds()` read plain fields, never storage: the controller asks at every tick
    and acts on the answer on its own thread.
    """

    def __init__(self, lease: RunLease, *, stale_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 start: bool = True):
        bound = DEFAULT_STALE_AFTER_S if stale_after_s is None else stale_after_s
        if not bound > 0:
            raise ValueError(f"LeaseKeeper(stale_after_s={stale_after_s}) must be > 0")
        self._lease = lease
        self._shown = mask_url(lease.url)                      # the URL as messages and logs show it
        self.stale_after_s = bound
        self.renew_every_s = bound * RENEW_EVERY
        self.retry_every_s = bound * RETRY_EVERY
        self.unconfirmed_after_s = bound * UNCONFIRMED_AFTER
        self._clock, self._wall_clock = clock, wall_clock      # the deadline's; lease_at's
        self._lock = threading.Lock()                          # the fields below: set by the thread, read by anyone
        self._valid_from = clock()    # start of the newest renewal that succeeded (first: the lease was just taken)
        self._taken: RunConflictError | None = None      # a renewal found another run holding the storage
        self._failing: str | None = None                 # the last renewal's error, while they fail
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="run-lease-keeper", daemon=True)
            self._thread.start()

    @property
    def url(self) -> str:
        return self._lease.url

    def lost(self) -> RunConflictError | None:
        """Why this run no longer holds its storage (a RunConflictError whose `.owner` names the
        run that took it over), or None while it holds it, confirmed or not."""
        with self._lock:
            return self._taken

    def unconfirmed(self) -> str | None:
        """Why this run cannot tell that it still holds its storage (no renewal went through for
        `unconfirmed_after_s`), or None while a recent renewal confirms it."""
        with self._lock:
            late = self._clock() - self._valid_from
            if self._closed or late <= self.unconfirmed_after_s:
                return None
            return (f"this run could not renew its lease on {self._shown} for {late:.0f}s ("
                    f"{self._failing or 'a renewal is stuck in a storage call'}); after {self.stale_after_s:.0f}s "
                    f"another run may take the storage over, so this run writes none of its files there until a "
                    f"renewal goes through again")

    def holds(self) -> bool:
        """Whether this run writes its record (status.json, metrics.jsonl, summary.json) now:
        not once another run took the storage over, nor while its lease is unconfirmed."""
        return self.lost() is None and self.unconfirmed() is None

    def renew_once(self) -> bool:
        """One renewal (the thread's work); True if it went through."""
        started = self._clock()
        try:
            self._lease.renew(clock=self._wall_clock)
        except RunConflictError as error:
            with self._lock:
                self._taken = error
            log.error("run %s lost its lease on %s: %s", self._lease.run_id, self._shown, error)
            return False
        except Exception as error:   # noqa: BLE001 - storage trouble: tried again until the deadline
            with self._lock:
                first = self._failing is None
                self._failing = f"last error: {type(error).__name__}: {mask_text(str(error))}"
            (log.warning if first else log.debug)(
                "could not renew the run's lease on %s (%s); trying again every %.1fs, the run writes none of its "
                "files if none goes through for %.0fs", self._shown, self._failing, self.retry_every_s,
                self.unconfirmed_after_s)
            return False
        with self._lock:
            late = self._clock() - self._valid_from > self.unconfirmed_after_s
            self._valid_from = max(self._valid_from, started)
            recovered, self._failing = self._failing is not None, None
        if late:
            log.warning("renewed the run's lease on %s again: nobody took the storage over; the run's files "
                        "are written again", self._shown)
        elif recovered:
            log.info("renewed the run's lease on %s again", self._shown)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop renewing (the run is ending: it releases the lease next). A renewal stuck in a
        storage call is not waited for past `timeout_s`: a late one cannot undo the release,
        since it checks that FENCE still names this run, unreleased."""
        with self._lock:
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        delay = 0.0      # the first renewal at once: the lease was taken before this process started
        while not self._stop.wait(delay):
            if self.lost() is not None:
                return
            delay = self.renew_every_s if self.renew_once() else self.retry_every_s

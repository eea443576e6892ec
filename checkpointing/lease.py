"""The run lease: at most one run writes to a storage URL at a time.

Two runs on one URL (a job resubmitted while the old driver still runs, a retried Kubernetes
job) would share generations, write the same shard files and collect each other's checkpoints.
The lease is an owner field in `<url>/checkpoints/FENCE`, taken by compare-and-swap, plus a
liveness check of the holder:

  * A run is *live* while `<url>/status.json` is fresh: the runtime rewrites it about once a
    second, `updated_at` is younger than `stale_after_s`, and its `state` is not final
    (`finished`, `failed`, `stopped`, `stopped_early`). A lease taken less than
    `stale_after_s` ago also counts as live (the run may not have written status.json yet).
  * `acquire_run_lease(url, run_id)` takes the lease when no other run holds it, or the holder
    is not live (a crashed run's storage is taken over once its status.json has gone stale,
    so a plain re-run resumes), and raises `RunConflictError` naming the live holder otherwise.
    `takeover=True` takes it regardless: for an operator who knows the holder is dead (or
    wants it stopped).
  * Every later fence update of the run (`RunLease.fence`, or
    `CheckpointManager.set_generation(..., run_id=)`) checks the owner in the same
    compare-and-swap: a run whose storage was taken over gets RunConflictError (a FencedError)
    at its next generation, and its workers are fenced by the taker's higher generation.

`DEFAULT_STALE_AFTER_S` is 60 s: 60 status intervals, more than botocore's retry budget for one
stalled status PUT (5 attempts with backoff) and than ordinary clock skew between hosts (the
check compares the holder's `updated_at` with this host's clock: keep clocks in sync, NTP).
A crashed run's URL can be reused without `takeover` once that long has passed.

Two runs that pass the liveness check at the same moment cannot both win: the owner field is
written by CAS, and the loser re-reads and finds a fresh lease.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from checkpointing import manifest as mf
from checkpointing.errors import RunConflictError
from checkpointing.storage import Storage

DEFAULT_STALE_AFTER_S = 60.0
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


def _liveness(storage: Storage, fence: mf.Fence | None, run_id: str, stale_after_s: float,
              now: float) -> str | None:
    """A description of the live run holding `storage` other than `run_id`, or None."""
    owner = fence.run_id if fence is not None and not fence.released else None
    status = _holder_status(storage)
    if status is not None:
        # A status.json without a run id is the lease holder's (runtimes that predate run ids).
        writer = status.get("run_id") or owner
        updated = status.get("updated_at")
        age = now - updated if isinstance(updated, (int, float)) and not isinstance(updated, bool) else None
        if writer != run_id and age is not None and age <= stale_after_s and status.get("state") not in FINAL_STATES:
            pids = [w.get("pid") for w in status.get("workers") or [] if isinstance(w, dict)]
            return (f"run {writer or '(no run id)'} (status.json: state {status.get('state')!r}, "
                    f"generation {status.get('generation')}, step {status.get('step')}, updated "
                    f"{max(0.0, age):.1f}s ago" + (f", worker pids {pids}" if pids else "") + ")")
        if writer == owner and status.get("state") in FINAL_STATES:
            return None  # the holder wrote its final state: it has ended
    if fence is not None and owner is not None and owner != run_id and fence.lease_at is not None \
            and now - fence.lease_at <= stale_after_s:
        return f"run {owner} (took the lease {max(0.0, now - fence.lease_at):.1f}s ago)"
    return None


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
                f"is dead, wait until its status.json is {stale_after_s:.0f}s old or take the storage "
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

"""CheckpointManager: the API the runtime calls at step boundaries.

Owns the save pipeline (stage in the training thread, upload + commit in one background
thread, at most one save in flight), failure accounting (failures are recorded, and raised only
after `max_consecutive_failures` in a row: then `SaveFailureLimitError`, fatal by design, and
every later save raises it too; a save broken by a lost peer is not counted, the runtime
recovers from the peer's loss), fencing by generation, and GC. Saving and loading
are collective over the current default group's ranks; see `_groups` for which group is used.
Public methods are meant to be called from the training thread; `committed`, `set_generation`
and `gc` are also safe from other threads and processes. Those three need no torch: the
saving and loading modules (DCP) are imported on first use, so a process that only lists,
fences or collects (the run's controller, the `ckpt` CLI) does not pay for importing torch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from checkpointing import manifest as mf
from checkpointing import retention
from checkpointing._groups import SideGroup
from checkpointing._write_process import WriteProcess
from checkpointing.errors import CheckpointError, FencedError, SaveFailureLimitError
from checkpointing.masking import mask_text
from checkpointing.storage import Storage

if TYPE_CHECKING:
    from checkpointing._save import SaveJob

log = logging.getLogger("checkpointing")


class CheckpointManager:
    """Atomic, sharded, optionally asynchronous checkpoints under `<url>/checkpoints/`."""

    def __init__(self, url: str, *, keep: int | None = 3, storage_options: dict | None = None,
                 async_save: bool = True, max_consecutive_failures: int = 3,
                 collective_timeout_s: float = 600.0,
                 peer_failure: Callable[[BaseException], bool] | None = None,
                 write_process: bool = False) -> None:
        """`peer_failure(error)`: whether a failed save broke because its process group did (a
        peer died, hung or was cut off); such a save does not count against
        `max_consecutive_failures`. Default: torch's DistError or a RuntimeError naming the
        backend (gloo, nccl, c10d). A runtime with a finer classifier passes its own.

        `write_process`: an async save's files are serialised, hashed and uploaded by a child
        process of this one (checkpointing._write_process), not by its background thread, so
        that work does not hold the training process's GIL. Not for memory:// (a process's own
        memory) nor synchronous saves (they write the caller's live tensors)."""
        if keep is not None and keep < 1:
            raise ValueError(f"CheckpointManager(keep={keep}): keep must be >= 1, or None to keep all")
        if max_consecutive_failures < 1:
            raise ValueError(f"CheckpointManager(max_consecutive_failures={max_consecutive_failures}) "
                             "must be >= 1")
        if collective_timeout_s <= 0:
            raise ValueError(f"CheckpointManager(collective_timeout_s={collective_timeout_s}) must be > 0")
        self.url = url
        self.keep = keep
        self.async_save = async_save
        self.max_consecutive_failures = max_consecutive_failures
        self._peer_failure = peer_failure or _peer_failure
        self.storage = Storage(url, storage_options)
        self._writer = (WriteProcess() if write_process and async_save and not self.storage.process_local
                        else None)
        self._group = SideGroup(collective_timeout_s)
        self._lock = threading.Lock()  # guards gc against the background commit's retention pass
        self._inflight: tuple[Future, int] | None = None
        self._unreported: mf.CommitInfo | None = None  # a sync save's outcome, for wait()
        self._staged: dict | None = None  # previous staged copy: its buffers are reused
        self._known_fence: int | None = None
        self.consecutive_failures = 0
        self.last_error: BaseException | None = None
        self.last_commit: mf.CommitInfo | None = None
        self._closed = False
        self._before_commit: Callable[[], None] | None = None  # test hook (crash injection)
        self._cancel: threading.Event | None = None  # the in-flight save's cancel flag
        self._thread: threading.Thread | None = None
        self._abandoned: list[threading.Thread] = []  # abandoned saves' threads not yet ended

    # ---- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: dict, *, generation: int, meta: dict | None = None) -> None:
        """Checkpoint `state` as `step`. Collective: every rank calls it at the same boundary.

        Async: returns once `state` is copied to host memory (after waiting for the previous
        upload, if any). Sync: returns after the commit. Raises SaveFailureLimitError (a
        CheckpointError) once `max_consecutive_failures` saves in a row have failed,
        FencedError when `generation` is older than a fence this manager has seen.

        `meta`: the caller's own non-tensor state as strict JSON (dicts, lists, str, numbers,
        bools, None; a non-finite float is stored as null), stored in the COMMITTED manifest
        itself and returned by `load_latest` as `LoadResult.meta`. Unlike non-tensor values in
        `state` (pickled by DCP, see the README's "Trust boundary"), it is never unpickled.
        Only rank 0's `meta` is stored. Raises TypeError at once for a value JSON cannot hold.
        """
        if self._closed:
            raise CheckpointError(f"save() after close() on CheckpointManager({self.storage.display_url!r})",
                                  url=self.url)
        if step < 0:
            raise ValueError(f"save(step={step}): step must be >= 0")
        # Validated and snapshotted now, in the caller's thread: a later change to the caller's
        # dict cannot leak into an async save, and a bad value is the caller's error at once.
        meta = json.loads(json.dumps(mf.strict_json(meta), allow_nan=False)) if meta is not None else None
        self._raise_if_failing()
        if self._known_fence is not None and generation < self._known_fence:
            raise FencedError(
                f"save of step {step} at generation {generation} refused: {self.storage.display_url}/checkpoints/"
                f"FENCE is at generation {self._known_fence}", url=self.url)
        from checkpointing._save import SaveJob
        from checkpointing.staging import stage_state_dict
        self._finish_inflight()  # bounded memory: one staged copy at a time
        self._raise_if_failing()
        group = self._group.view()  # collective only when the default group changed
        if not self.async_save:
            job = SaveJob(self.storage, step, generation, state, group, self._before_commit,
                          self._retention, meta=meta)
            self._unreported = self._record(self._run(job))
            self._raise_if_failing()
            return
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        if self._abandoned:
            log.warning("%d abandoned save(s) under %s still hold their staged copy (stuck in a "
                        "collective until collective_timeout_s); staging another", len(self._abandoned),
                        self.storage.display_url)
        self._staged = stage_state_dict(state, self._staged)
        job = SaveJob(self.storage, step, generation, self._staged, group, self._before_commit,
                      self._retention, meta=meta, process=self._writer)
        future: Future = Future()
        # A daemon thread per save (one at a time): a save stuck in a collective with a dead
        # peer (see abandon) must not keep the interpreter from exiting.
        thread = threading.Thread(target=lambda: future.set_result(self._run(job)),
                                  name=f"ckpt-upload-{step}", daemon=True)
        self._cancel, self._thread = job.cancel, thread
        thread.start()
        self._inflight = (future, step)

    def _run(self, job: SaveJob) -> mf.CommitInfo | BaseException:
        """Runs a save; returns the outcome as a value (the training thread decides)."""
        try:
            from checkpointing._save import run_save
            return run_save(job)
        except BaseException as e:  # noqa: BLE001 - DCP raises BaseException subclasses
            return e

    def _retention(self, info: mf.CommitInfo) -> None:
        with self._lock:
            # writer_generation: the pass is skipped if FENCE has moved past this generation,
            # and never touches a newer generation's data.
            retention.collect(self.storage, keep=self.keep, protect={info.step},
                              writer_generation=info.generation)

    def _record(self, outcome: mf.CommitInfo | BaseException) -> mf.CommitInfo | None:
        if isinstance(outcome, mf.CommitInfo):
            self.consecutive_failures = 0
            self.last_commit = outcome
            self.last_error = None        # the error of a save since the last commit, or none
            return outcome
        self.last_error = outcome
        if isinstance(outcome, FencedError):
            # Not a storage failure: this worker is a zombie. Later saves at this generation
            # are refused up front.
            try:
                fence = mf.read_fence(self.storage)
            except CheckpointError:
                fence = None
            if fence is not None:
                self._known_fence = max(self._known_fence or fence, fence)
            log.warning("%s", outcome)
            return None
        if self._peer_failure(outcome):
            # A collective broke because a peer died or was cut off: the runtime recovers from
            # that peer's loss; it says nothing about storage, so it does not count.
            log.warning("checkpoint save to %s broke with its process group (not counted against "
                        "max_consecutive_failures): %s: %s", self.storage.display_url, type(outcome).__name__,
                        mask_text(str(outcome)))
            return None
        self.consecutive_failures += 1
        log.warning("checkpoint save to %s failed (%d in a row, limit %d): %s: %s",
                    self.storage.display_url, self.consecutive_failures, self.max_consecutive_failures,
                    type(outcome).__name__, mask_text(str(outcome)))
        return None

    def _finish_inflight(self) -> mf.CommitInfo | None:
        if self._inflight is None:
            outcome, self._unreported = self._unreported, None
            return outcome
        future, _ = self._inflight
        outcome = future.result()
        self._inflight = None
        return self._record(outcome)

    def _raise_if_failing(self) -> None:
        if self.consecutive_failures >= self.max_consecutive_failures:
            cause = self.last_error
            described = mask_text(f"{type(cause).__name__}: {cause}")
            # `from None`: the limit is final. A cause chain holding the StorageError would make a
            # runtime that retries storage trouble recover, and fail the next save again, forever.
            raise SaveFailureLimitError(
                f"{self.consecutive_failures} consecutive checkpoint saves to {self.storage.display_url} failed "
                f"(max_consecutive_failures={self.max_consecutive_failures}); last cause: "
                f"{described}. Fix the storage (credentials, quota, endpoint) and resume from the last "
                f"committed checkpoint, or raise max_consecutive_failures", url=self.url,
                last_cause=described) from None

    def wait(self) -> mf.CommitInfo | None:
        """Block until the in-flight save (if any) is committed or failed; its CommitInfo, or
        None if it failed or there was no save since the last wait (a sync save's outcome is
        returned by the next wait too)."""
        outcome = self._finish_inflight()
        self._raise_if_failing()
        return outcome

    @property
    def in_flight_step(self) -> int | None:
        return self._inflight[1] if self._inflight is not None else None

    def close(self) -> mf.CommitInfo | None:
        """Wait for the in-flight save and stop the background thread. Does not raise for a
        failed save (see `last_error`), so it is safe in `finally` blocks."""
        try:
            return self._finish_inflight() if not self._closed else None
        finally:
            self._closed = True
            self._staged = None
            if self._writer is not None:
                self._writer.close()

    def abandon(self) -> None:
        """Stop waiting for the in-flight save, without blocking: call this instead of wait()
        when a peer died (the save's collectives would block until collective_timeout_s).

        The abandoned save cannot commit unless every rank had already finished writing; it is
        not counted as a failure. Its staging buffers are dropped, and the side group is
        recreated by the next save/load (after the runtime re-forms the default group).
        """
        if self._inflight is not None:
            log.warning("abandoning in-flight save of step %d under %s", self._inflight[1], self.storage.display_url)
            if self._cancel is not None:
                self._cancel.set()  # the upload stops at its next write and never commits
            if self._thread is not None:
                self._abandoned.append(self._thread)
        self._inflight = None
        self._cancel = None
        # Dropped, not reused: the abandoned thread may still be reading them. It releases its
        # own reference once DCP's writes end (at the next write, after the cancel).
        self._staged = None
        self._group.forget()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def bind_group(self) -> None:
        """Collective: create the side group for the current default group now.

        Call it on every rank right after forming the default group. Otherwise the first save
        creates it, and a peer lost at that moment leaves the others waiting on the store for
        collective_timeout_s; created with the group, its connections fail as soon as the peer
        is gone (and a runtime that cuts the group's connections on failure can cut these too).
        """
        self._group.view()

    # ---- loading and inspection --------------------------------------------------------------
    def load_latest(self, state: dict) -> mf.LoadResult | None:
        """Collective: load the newest verified committed checkpoint into `state` in place."""
        from checkpointing._load import load_latest
        self._finish_inflight()
        return load_latest(self.storage, state, self._group.view())

    def committed(self) -> list[mf.CommitInfo]:
        """Committed checkpoints, newest last (manifests only; checksums not rechecked).
        Reads every manifest: prefer `latest()` or `committed_since()` in a polling loop."""
        return mf.list_committed(self.storage, log=log)

    def latest(self) -> mf.CommitInfo | None:
        """The newest committed checkpoint (FENCE, one listing, manifests newest first until
        a valid one: usually one GET)."""
        return next(mf.iter_committed(self.storage, log=log), None)

    def committed_since(self, step: int | None) -> list[mf.CommitInfo]:
        """Committed checkpoints newer than `step` (all if None), oldest first; reads only their
        manifests (for a poller that announces new commits)."""
        return list(reversed(list(mf.iter_committed(self.storage, log=log, after=step))))

    def latest_hint(self) -> int | None:
        """The step checkpoints/LATEST names (one small GET), or None. A hint for pollers, never
        for correctness: `latest()` decides (see manifest.LATEST_NAME)."""
        return mf.read_latest_hint(self.storage)

    # ---- fencing and GC ----------------------------------------------------------------------
    def set_generation(self, generation: int, *, start_step: int | None = None,
                       run_id: str | None = None) -> None:
        """Record `generation` as current in `<url>/checkpoints/FENCE`; older ones are fenced.

        A compare-and-swap: raises FencedError if FENCE is already newer, also when another
        writer advanced it between this call's read and write (generations must grow across
        runs too: start a new run at `checkpointing.read_fence(url) + 1`). Idempotent for the
        generation already current (controller and every worker may call it).

        `start_step`: the step this generation starts from (the step it restores). Recorded in
        FENCE's history: a manifest of an older generation whose step is past it is a fenced
        writer's late commit, and listing, loading and GC ignore it. Pass it from the controller
        whenever a generation starts. `run_id`: the run holding the storage (see
        `checkpointing.acquire_run_lease`); RunConflictError if another run holds it now.
        """
        mf.advance_fence(self.storage, generation, start_step=start_step, run_id=run_id)
        self._known_fence = generation

    def gc(self, *, verify: bool = False) -> dict:
        """Delete uncommitted step dirs (except a live save's) and committed ones beyond `keep`.

        verify=True rechecks checksums newest first and always keeps the newest checkpoint that
        verifies, even beyond `keep` (one full read of it). Returns {"deleted", "kept"}.
        """
        protect = {self.in_flight_step} if self.in_flight_step is not None else set()
        with self._lock:
            return retention.collect(self.storage, keep=self.keep, protect=protect, verify=verify)


_BACKEND_MARKERS = ("gloo", "nccl", "c10d", "processgroup")  # as elastic._worker.worker judges them


def _peer_failure(error: BaseException) -> bool:
    """Whether a save failed because its process group broke (a peer died, hung or was cut off),
    judged like the runtime does: torch's DistError, or a RuntimeError naming the backend."""
    try:
        import torch.distributed as dist
        dist_error = getattr(dist, "DistError", None)
    except ImportError:  # pragma: no cover
        dist_error = None
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if dist_error is not None and isinstance(e, dist_error):
            return True
        if isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _BACKEND_MARKERS):
            return True
        todo.append(e.__cause__)
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> error
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
    return False

"""One save, from fence check to COMMITTED: the commit protocol.

Internal; run by every rank (in the background thread for async saves), in the same order on
every rank, with collectives only on the side group:
  1. rank 0 reads FENCE and broadcasts the verdict, so every rank takes the same branch;
  2. DCP writes each rank's shards into step_<n>/g<gen>/ (replicated tensors once, DTensor
     shards by their owner); DCP gathers per-rank failures, so every rank raises or none does;
  3. every rank's file records (size, sha256, taken while writing) are gathered to rank 0, the
     one writer of the manifest (not to every rank: that would move O(N^2) bytes); having them
     means every rank's files were closed, i.e. durable;
  4. rank 0 re-checks the fence and the existing manifest, then PUTs COMMITTED in one
     conditional write (create if absent, or replace exactly the version it read: see
     `Storage.put_if`) and broadcasts the outcome, so every rank returns the same CommitInfo or
     raises the same error.

The conditional PUT is what makes step 4 safe against a writer that stalls between its checks
and its PUT: if a newer generation committed the step meanwhile, the stale PUT fails, the writer
re-reads, finds the newer manifest and is fenced. A late commit of a step no newer generation
has committed yet can still land; the fence history makes every reader and GC ignore it (see
manifest.py). A lost PUT response that the client retried finds its own bytes: success.
An abandoned save (`cancel` set) stops writing at its next write and never commits.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from checkpointing import manifest as mf
from checkpointing._dcp_io import StorageWriter, unaddressable_dtensors
from checkpointing._groups import GroupView
from checkpointing._write_process import WriteProcess
from checkpointing.errors import CheckpointError, FencedError, SaveCancelledError, StorageError
from checkpointing.masking import mask_text
from checkpointing.storage import PreconditionFailed, Storage

log = logging.getLogger("checkpointing")


@dataclasses.dataclass
class SaveJob:
    storage: Storage
    step: int
    generation: int
    state: dict
    group: GroupView
    before_commit: Callable[[], None] | None = None  # test hook: crash point before COMMITTED
    # Rank 0, after the commit and before the other ranks hear of it (retention): when wait()
    # returns on any rank, storage already reflects it.
    after_commit: Callable[[mf.CommitInfo], None] | None = None
    meta: dict | None = None  # strict JSON stored in the manifest
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    process: WriteProcess | None = None  # writes this rank's files from a child (checkpointing._write_process)


def _caching_planner(job: SaveJob) -> DefaultSavePlanner:
    """DCP's planner with plan caching: a rank whose local plan is unchanged since the previous
    save sends an empty plan, and the coordinator reuses its cached global plan and metadata
    instead of gathering and checking N plans at every save. Cached per side group and
    generation (a re-formed group plans afresh); the older generations' entries are dropped."""
    key = f"{DefaultSavePlanner.__name__}:g{job.generation}:w{job.group.world_size}:pg{id(job.group.pg)}"
    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan,
                  SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
        for old in [k for k in cache if k.startswith(f"{DefaultSavePlanner.__name__}:g") and k != key]:
            del cache[old]
    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = key
    return planner


def _fence_verdict(storage: Storage, generation: int) -> tuple[str, Any]:
    try:
        fence = mf.read_fence(storage)
    except CheckpointError as e:
        return "error", e
    if fence is not None and generation < fence:
        return "fenced", fence
    return "ok", fence


def _fenced(storage: Storage, job: SaveJob, fence: int) -> FencedError:
    return FencedError(
        f"save of step {job.step} at generation {job.generation} refused: {storage.display_url}/"
        f"checkpoints/FENCE is at generation {fence} (this worker belongs to an older "
        f"generation; it must rejoin and pass the current generation to save())",
        url=storage.url)


def _as_checkpoint_error(storage: Storage, job: SaveJob, e: BaseException) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, CheckpointException):
        # DCP wraps every rank's failure; surface the first one and which rank it came from.
        excs = {r: (f[0] if isinstance(f, tuple) else f) for r, f in sorted(e.failures.items())}
        causes = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in excs.items())
        storage_like = any(isinstance(x, (StorageError, OSError)) for x in excs.values())
        cls = StorageError if storage_like else CheckpointError
        return cls(f"writing step {job.step} to {storage.display_url} failed: {causes}", url=storage.url)
    return CheckpointError(
        f"writing step {job.step} to {storage.display_url} failed: {type(e).__name__}: {e}",
        url=storage.url)


def _commit(job: SaveJob, records: list[dict]) -> mf.CommitInfo:
    storage = job.storage
    data_dir = mf.data_dir_name(job.generation)
    files: dict[str, dict] = {}
    for rank_files in records:
        for rel, rec in rank_files.items():
            files[f"{data_dir}/{rel}"] = rec
    if not any(rel.endswith("/.metadata") for rel in files):
        raise CheckpointError(f"step {job.step}: DCP wrote no .metadata under {storage.display_url}",
                              url=storage.url)
    if job.before_commit is not None:
        job.before_commit()
    if job.cancel.is_set():
        raise SaveCancelledError(f"save of step {job.step} abandoned before its commit", url=storage.url)
    raw = mf.encode_manifest(job.step, job.group.world_size, job.generation, data_dir, files,
                             meta=job.meta)
    sp = mf.step_path(storage, job.step)
    path = f"{sp}/{mf.MANIFEST_NAME}"
    for _ in range(mf.CAS_ATTEMPTS):
        # Re-check right before the PUT: a new generation may have formed during the upload.
        verdict, fence = _fence_verdict(storage, job.generation)
        if verdict == "error":
            raise fence
        if verdict == "fenced":
            raise _fenced(storage, job, fence)
        try:
            existing, token = storage.read_versioned(path)
        except FileNotFoundError:
            existing, token = None, None
        if existing is not None:
            if existing == raw:
                break  # our own PUT, whose response was lost and whose retry found it
            try:
                current = mf.decode_manifest(existing, storage.url_for(sp), step=job.step)
            except CheckpointError:
                current = None  # unreadable: replace it (by CAS, like any other version)
            if current is not None and current.generation > job.generation:
                raise _fenced(storage, job, current.generation)
            # An older generation's commit of this step (or this generation's earlier one, whose
            # files this save has just rewritten): replace exactly the version read.
        try:
            storage.put_if(path, raw, if_token=token)
        except PreconditionFailed:
            continue  # someone wrote or deleted it since the read: judge again
        break
    else:
        raise StorageError(f"committing step {job.step} under {storage.display_url} lost {mf.CAS_ATTEMPTS} "
                           f"compare-and-swaps on its COMMITTED in a row", url=storage.url)
    info = mf.decode_manifest(raw, storage.url_for(sp), step=job.step)
    try:
        mf.write_latest_hint(storage, info)
    except Exception as e:  # noqa: BLE001 - a hint: pollers fall back to listing
        log.warning("could not update %s/checkpoints/%s after committing step %d: %s", storage.display_url,
                    mf.LATEST_NAME, job.step, mask_text(str(e)))
    return info


def run_save(job: SaveJob) -> mf.CommitInfo:
    """Run the protocol; returns the CommitInfo on every rank or raises the same error class."""
    storage, group = job.storage, job.group

    verdict = group.broadcast(_fence_verdict(storage, job.generation) if group.rank == 0 else None)
    if verdict[0] == "error":
        raise verdict[1]
    if verdict[0] == "fenced":
        raise _fenced(storage, job, verdict[1])

    path = f"{mf.step_path(storage, job.step)}/{mf.data_dir_name(job.generation)}"
    writer = StorageWriter(storage, path, cancel=job.cancel, process=job.process)
    try:
        dcp.save(job.state, storage_writer=writer, planner=_caching_planner(job), process_group=group.pg,
                 no_dist=group.pg is None)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = _as_checkpoint_error(storage, job, e)
        unaddressable = unaddressable_dtensors(job.state)
        if unaddressable and type(error) is CheckpointError:
            # DCP's own words ("overlapping chunks") do not say which layout it cannot write.
            error = CheckpointError(
                f"{error} -- {len(unaddressable)} DTensor(s) have a layout DCP cannot address on this rank: "
                f"{'; '.join(unaddressable[:3])}{'; ...' if len(unaddressable) > 3 else ''} (a shard that is "
                f"not one block of the global tensor; see checkpointing._dcp_io)", url=storage.url)
        raise error from e
    finally:
        # The staged host copy is not needed past this point: an abandoned save that now waits
        # in a collective with a dead peer must not hold it until the collective times out.
        job.state = {}

    records = group.gather(writer.written)

    outcome: tuple[str, Any] | None = None
    if group.rank == 0:
        assert records is not None
        try:
            committed = _commit(job, records)
            outcome = ("ok", dataclasses.asdict(committed))
        except Exception as e:  # noqa: BLE001 - broadcast it: the other ranks wait for the verdict
            outcome = ("error", _as_checkpoint_error(storage, job, e))
        else:
            if job.after_commit is not None:
                try:
                    job.after_commit(committed)
                except Exception as e:  # noqa: BLE001 - housekeeping: never fail a committed save
                    log.warning("after commit of step %d under %s: %s", job.step, storage.display_url,
                                mask_text(str(e)))
    outcome = group.broadcast(outcome)
    if outcome[0] == "error":
        raise outcome[1]
    info = mf.CommitInfo(**outcome[1])
    log.info("committed step %d (generation %d, world size %d, %d files, %.1f MB) at %s",
             info.step, info.generation, info.world_size, len(info.files),
             info.total_bytes / 1e6, storage.display(info.path))
    return info

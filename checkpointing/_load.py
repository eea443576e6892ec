"""Load the newest committed checkpoint that verifies, resharded to the current world size.

Internal; collective over the side group, called from the training thread on every rank.
Rank 0 lists the steps and reads their manifests newest first, only as far as needed, and
broadcasts each, so every rank considers the same candidates.
Verification is split: each rank rechecks sizes and sha256 of every world_size-th file, and the
verdicts are all-gathered, so a checkpoint is read once for verification however many ranks
there are. A mismatch skips to the previous committed checkpoint with a warning; a storage
error is raised instead (a transient outage must not silently roll training back).
Files found *missing* may mean the listing went stale during the load (another writer, e.g. an
abandoned save of the previous generation, committed a newer step and its retention deleted
this one): the candidates are then listed once more, and if a newer checkpoint appeared the
load raises StorageError (retryable: the caller re-plans from the newer one) rather than falling
back or calling the checkpoints corrupt.
DCP then reads only the byte ranges each rank needs (and only files the manifest lists): DCP
resharding handles a different world size for replicated tensors and DTensor shards alike, on 1-D
and 2-D meshes (TP 2 x DP 2 into TP 1 or another DP strategy, and back). A state holding a
DTensor whose shard DCP cannot address (see _dcp_io) is refused on every rank, in the
verification's all-gather, before DCP would fill it with the wrong elements.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from checkpointing import manifest as mf
from checkpointing._dcp_io import StorageReader, unaddressable_dtensors
from checkpointing._groups import GroupView
from checkpointing.errors import CheckpointError, CorruptCheckpointError, StorageError
from checkpointing.storage import Storage

log = logging.getLogger("checkpointing")


def _on_rank0(group: GroupView, read):
    """`read()` on rank 0, its result (or its CheckpointError) on every rank."""
    payload = None
    if group.rank == 0:
        try:
            payload = ("ok", read())
        except CheckpointError as e:
            payload = ("error", e)
    payload = group.broadcast(payload)
    if payload[0] == "error":
        raise payload[1]
    return payload[1]


class _Candidates:
    """Committed checkpoints newest first, the same on every rank, read lazily: one listing, and
    a manifest only when the previous candidate did not verify (usually one GET in all)."""

    def __init__(self, storage: Storage, group: GroupView) -> None:
        self.storage, self.group = storage, group
        # FENCE before the listing: a commit made after a newer generation started is judged by
        # that generation's entry of the history.
        self.fence, self.steps = _on_rank0(group, lambda: (mf.read_fence_doc(storage), mf.list_steps(storage)))

    def manifest(self, step: int) -> mf.CommitInfo | None:
        def read():
            try:
                info = mf.read_manifest(self.storage, step)
            except CorruptCheckpointError as e:
                log.warning("%s", e)
                return None
            if info is not None and self.fence is not None and (why := self.fence.rejects(info)):
                log.warning("ignoring the manifest of step %d at %s: %s", step, self.storage.display(info.path),
                            why)
                return None
            return dataclasses.asdict(info) if info is not None else None
        d = _on_rank0(self.group, read)
        return mf.CommitInfo(**d) if d is not None else None

    def newest_first(self):
        for step in reversed(self.steps):
            info = self.manifest(step)
            if info is not None:
                yield info

    def newer_committed(self, than: int) -> list[int]:
        """Committed steps newer than `than` that a fresh listing shows and this one did not."""
        again = _Candidates(self.storage, self.group)
        known = set(self.steps)
        return [s for s in again.steps if s > than and s not in known and again.manifest(s) is not None]


def _reason(bad: list[dict]) -> str:
    reason = "; ".join(f"{b['file']}: {b['reason']}" for b in bad[:5])
    if len(bad) > 5:
        reason += f"; and {len(bad) - 5} more files"
    return reason


def _verify_shared(storage: Storage, info: mf.CommitInfo, group: GroupView,
                   unaddressable: list[str]) -> list[dict]:
    """Every rank's share of the file checks, and (in the same all-gather) every rank's
    DTensors DCP cannot address (see _dcp_io): a load into those is refused on every rank."""
    names = sorted(info.files)
    mine = {n: info.files[n] for i, n in enumerate(names) if i % group.world_size == group.rank}
    local: tuple[str, list[dict] | CheckpointError | list[str]]  # ("ok", bad files), ("error", why)
    if unaddressable:
        local = ("layout", unaddressable)
    else:
        try:
            local = ("ok", mf.verify_files(storage, info.step, mine))
        except CheckpointError as e:
            local = ("error", e)
    verdicts = group.all_gather(local)
    layout = [(rank, keys) for rank, (kind, keys) in enumerate(verdicts) if kind == "layout"]
    if layout:
        rank, keys = layout[0]
        raise CheckpointError(
            f"refusing to load step {info.step} from {storage.display(info.path)}: {len(keys)} DTensor(s) of "
            f"the state to fill have a layout DCP cannot address on rank {rank} (and {len(layout) - 1} other "
            f"rank(s)): {'; '.join(keys[:3])}{'; ...' if len(keys) > 3 else ''}. A rank's shard is not one "
            f"block of the global tensor there, and DCP reads one block per rank (first offset, local "
            f"shape): it would fill the shards with the wrong elements. Load into a layout whose shards "
            f"are blocks (TP before FSDP gives (_StridedShard(d), Shard(d)); Shard and Replicate always "
            f"are), then redistribute", url=storage.url)
    for kind, value in verdicts:
        if kind == "error":
            raise value
    return [bad for _, bads in verdicts for bad in bads]


def load_latest(storage: Storage, state: dict, group: GroupView) -> mf.LoadResult | None:
    skipped: list[dict] = []
    candidates = _Candidates(storage, group)
    relisted = False
    unaddressable = unaddressable_dtensors(state)
    for info in candidates.newest_first():
        bad = _verify_shared(storage, info, group, unaddressable)
        if bad and not relisted and any(b["reason"] == "missing" for b in bad):
            relisted = True
            newer = candidates.newer_committed(info.step)
            if newer:
                raise StorageError(
                    f"checkpoint step {info.step} under {storage.display_url} lost files while loading "
                    f"({_reason(bad)}) and newer committed step(s) {newer} appeared meanwhile (another "
                    f"writer committed and collected); retry the load", url=storage.url)
        if bad:
            reason = _reason(bad)
            log.warning("checkpoint step %d at %s does not match its manifest (%s); falling back "
                        "to the previous committed checkpoint", info.step, storage.display(info.path), reason)
            skipped.append({"step": info.step, "reason": reason})
            continue
        path = f"{mf.step_path(storage, info.step)}/{info.data_dir}".rstrip("/")
        t0 = time.monotonic()
        try:
            dcp.load(state, storage_reader=StorageReader(storage, path, allowed=mf.data_files(info)),
                     process_group=group.pg, no_dist=group.pg is None)
        except (Exception, CheckpointException) as e:
            excs = [f[0] if isinstance(f, tuple) else f
                    for f in getattr(e, "failures", {0: e}).values()]
            cls = StorageError if any(isinstance(x, (StorageError, OSError)) for x in excs) else CheckpointError
            raise cls(
                f"loading step {info.step} from {storage.display(info.path)} failed: "
                f"{'; '.join(f'{type(x).__name__}: {x}' for x in excs)} (the state passed to "
                f"load_latest must have the keys saved, built for the current world size)",
                url=storage.url) from e
        log.info("loaded step %d (saved at world size %d, now %d) from %s in %.2fs",
                 info.step, info.world_size, group.world_size, storage.display(info.path), time.monotonic() - t0)
        return mf.LoadResult(step=info.step, world_size=info.world_size,
                             generation=info.generation, path=info.path, skipped=skipped,
                             meta=info.meta)
    if skipped:
        raise CorruptCheckpointError(
            f"no committed checkpoint under {storage.display_url} matches its manifest "
            f"(skipped steps {[s['step'] for s in skipped]}); inspect with "
            f"`python -m checkpointing verify {storage.display_url}`", url=storage.url)
    return None

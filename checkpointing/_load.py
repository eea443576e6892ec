"""Load the newest committed checkpoint that verifies, resharded to the current world size.

Internal; collective over the side group, called from the training thread on every rank.
Rank 0 lists the manifests and broadcasts them so every rank considers the same candidates.
Verification is split: each rank rechecks sizes and sha256 of every world_size-th file, and the
verdicts are all-gathered, so a checkpoint is read once for verification however many ranks
there are. A mismatch skips to the previous committed checkpoint with a warning; a storage
error is raised instead (a transient outage must not silently roll training back).
DCP then reads only the byte ranges each rank needs: DCP resharding handles a different
world size for replicated tensors and DTensor shards alike.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from checkpointing import manifest as mf
from checkpointing._dcp_io import StorageReader
from checkpointing._groups import GroupView
from checkpointing.errors import CheckpointError, CorruptCheckpointError, StorageError
from checkpointing.storage import Storage

log = logging.getLogger("checkpointing")


def _candidates(storage: Storage, group: GroupView) -> list[mf.CommitInfo]:
    payload = None
    if group.rank == 0:
        try:
            payload = ("ok", [dataclasses.asdict(c) for c in mf.list_committed(storage, log=log)])
        except CheckpointError as e:
            payload = ("error", e)
    payload = group.broadcast(payload)
    if payload[0] == "error":
        raise payload[1]
    return [mf.CommitInfo(**d) for d in payload[1]]


def _verify_shared(storage: Storage, info: mf.CommitInfo, group: GroupView) -> list[dict]:
    names = sorted(info.files)
    mine = {n: info.files[n] for i, n in enumerate(names) if i % group.world_size == group.rank}
    try:
        local = ("ok", mf.verify_files(storage, info.step, mine))
    except CheckpointError as e:
        local = ("error", e)
    verdicts = group.all_gather(local)
    for kind, value in verdicts:
        if kind == "error":
            raise value
    return [bad for _, bads in verdicts for bad in bads]


def load_latest(storage: Storage, state: dict, group: GroupView) -> mf.LoadResult | None:
    skipped: list[dict] = []
    for info in reversed(_candidates(storage, group)):
        bad = _verify_shared(storage, info, group)
        if bad:
            reason = "; ".join(f"{b['file']}: {b['reason']}" for b in bad[:5])
            if len(bad) > 5:
                reason += f"; and {len(bad) - 5} more files"
            log.warning("checkpoint step %d at %s does not match its manifest (%s); falling back "
                        "to the previous committed checkpoint", info.step, info.path, reason)
            skipped.append({"step": info.step, "reason": reason})
            continue
        path = f"{mf.step_path(storage, info.step)}/{info.data_dir}".rstrip("/")
        t0 = time.monotonic()
        try:
            dcp.load(state, storage_reader=StorageReader(storage, path),
                     process_group=group.pg, no_dist=group.pg is None)
        except (Exception, CheckpointException) as e:
            excs = [f[0] if isinstance(f, tuple) else f
                    for f in getattr(e, "failures", {0: e}).values()]
            cls = StorageError if any(isinstance(x, (StorageError, OSError)) for x in excs) else CheckpointError
            raise cls(
                f"loading step {info.step} from {info.path} failed: "
                f"{'; '.join(f'{type(x).__name__}: {x}' for x in excs)} (the state passed to "
                f"load_latest must have the keys saved, built for the current world size)",
                url=storage.url) from e
        log.info("loaded step %d (saved at world size %d, now %d) from %s in %.2fs",
                 info.step, info.world_size, group.world_size, info.path, time.monotonic() - t0)
        return mf.LoadResult(step=info.step, world_size=info.world_size,
                             generation=info.generation, path=info.path, skipped=skipped)
    if skipped:
        raise CorruptCheckpointError(
            f"no committed checkpoint under {storage.url} matches its manifest "
            f"(skipped steps {[s['step'] for s in skipped]}); inspect with "
            f"`python -m checkpointing verify {storage.url}`", url=storage.url)
    return None

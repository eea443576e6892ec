"""Garbage collection: uncommitted step directories, stale generations and retention.

Anything without COMMITTED is not a checkpoint. A committed checkpoint beyond `keep` is
deleted manifest first, so that a crash halfway through a deletion leaves an uncommitted
directory (collected next time), never a committed one with missing files. The newest
committed checkpoint is never deleted.
"""

from __future__ import annotations

import logging

from checkpointing import manifest as mf
from checkpointing.storage import Storage

log = logging.getLogger("checkpointing")


def collect(storage: Storage, *, keep: int | None, protect: set[int] = frozenset(),
            protect_newer_uncommitted: bool = False, dry_run: bool = False,
            verify: bool = False) -> dict:
    """Delete garbage under `<url>/checkpoints/`.

    protect: steps being written by a live save (left alone entirely).
    protect_newer_uncommitted: leave uncommitted steps newer than the newest committed one (a
    process outside the run, e.g. the CLI, cannot know whether they are in progress).
    verify: recheck checksums newest first until one verifies, and keep that one even beyond
    `keep` (so retention never leaves only corrupt checkpoints). Costs one full read.
    Returns {"deleted": [paths], "kept": [steps]}.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    committed = {c.step: c for c in mf.list_committed(storage, log=log)}
    newest = max(committed) if committed else None
    keep_steps = set(sorted(committed)[-keep:] if keep is not None else committed)
    if verify:
        for step in sorted(committed, reverse=True):
            if not mf.verify_files(storage, step, committed[step].files):
                keep_steps.add(step)
                break
            log.warning("gc: committed step %d under %s does not verify", step, storage.url)
    deleted: list[str] = []

    def rm(path: str) -> None:
        deleted.append(storage.url_for(path))
        if not dry_run:
            storage.rm(path)

    for step in mf.list_steps(storage):
        if step in protect:
            continue
        sp = mf.step_path(storage, step)
        info = committed.get(step)
        if info is None:
            if protect_newer_uncommitted and (newest is None or step > newest):
                continue
            rm(sp)
        elif step not in keep_steps:
            rm(f"{sp}/{mf.MANIFEST_NAME}")  # first: from here on the step is not a checkpoint
            rm(sp)
        else:
            # Data of other generations for the same step (an older attempt, a zombie's writes).
            for name in storage.listdir(sp):
                if name != mf.MANIFEST_NAME and name != info.data_dir:
                    rm(f"{sp}/{name}")
    if deleted:
        log.info("gc under %s deleted %d paths", storage.url, len(deleted))
    return {"deleted": deleted, "kept": sorted(keep_steps)}

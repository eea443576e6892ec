"""Garbage collection: uncommitted step directories, stale generations and retention.

Anything without a valid COMMITTED is not a checkpoint: no manifest, an unreadable one, or one
the fence history rejects (a fenced writer's late commit, see manifest.py). A committed
checkpoint beyond `keep` is deleted manifest first, so that a crash halfway through a deletion
leaves an uncommitted directory (collected next time), never a committed one with missing
files. The newest committed checkpoint is never deleted.

A pass never touches a newer generation's data: a writer's pass (`writer_generation`, run after
its commit) first re-reads FENCE and is skipped entirely if the fence has moved past the writer
(the writer is a zombie now: its view of what is garbage is stale), and in any pass a data
directory `g<gen>` of a generation newer than the writer's (or, for an operator's pass, newer
than FENCE) is spared, so is the step directory holding it. Steps are deleted entry by entry,
never by a recursive delete of the step directory, so files a newer generation starts writing
after the listing survive.

Manifests are read newest first, and only as far as needed: once `keep` valid checkpoints (and,
with `verify`, one that verifies) are found, older steps are deleted without reading their
manifests.
"""

from __future__ import annotations

import logging
from collections.abc import Set

from checkpointing import manifest as mf
from checkpointing.errors import CorruptCheckpointError
from checkpointing.storage import Storage

log = logging.getLogger("checkpointing")


def collect(storage: Storage, *, keep: int | None, protect: Set[int] = frozenset(),
            protect_newer_uncommitted: bool = False, dry_run: bool = False,
            verify: bool = False, writer_generation: int | None = None) -> dict:
    """Delete garbage under `<url>/checkpoints/`.

    protect: steps being written by a live save (never deleted; a valid one counts as kept).
    protect_newer_uncommitted: leave uncommitted steps newer than the newest committed one (a
    process outside the run, e.g. the CLI, cannot know whether they are in progress).
    verify: recheck checksums newest first until one verifies, and keep that one even beyond
    `keep` (so retention never leaves only corrupt checkpoints). Costs one full read.
    writer_generation: the generation of the writer running this pass after its commit; the
    pass is skipped if FENCE is past it, and spares data of newer generations. None (operator,
    CLI): spares data of generations newer than FENCE.
    Returns {"deleted": [paths], "kept": [steps]} (+ "skipped": reason when skipped).
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    fence = mf.read_fence_doc(storage)
    current = fence.generation if fence is not None else None
    if writer_generation is not None and current is not None and current > writer_generation:
        skipped = (f"FENCE is at generation {current}, past this writer's {writer_generation}: "
                   f"a newer generation owns the storage")
        log.info("gc under %s skipped: %s", storage.display_url, skipped)
        return {"deleted": [], "kept": [], "skipped": skipped}
    gc = _Pass(storage, spare_above=writer_generation if writer_generation is not None else current,
               dry_run=dry_run)
    kept: list[int] = []
    verified = not verify
    seen_committed = False

    for step in reversed(mf.list_steps(storage)):
        if step not in protect and verified and keep is not None and len(kept) >= keep:
            gc.delete_step(step)  # older than every kept checkpoint: no need to read its manifest
            continue
        try:
            info = mf.read_manifest(storage, step)
        except CorruptCheckpointError as e:
            log.warning("gc: %s", e)
            info = None
        if info is not None and fence is not None and (reason := fence.rejects(info)) is not None:
            log.warning("gc: step %d at %s: %s", step, storage.display(info.path), reason)
            info = None
        if info is None:
            if step in protect or (protect_newer_uncommitted and not seen_committed):
                continue
            gc.delete_step(step)
            continue
        seen_committed = True
        keep_it = step in protect or keep is None or len(kept) < keep
        if not verified:
            if not mf.verify_files(storage, step, info.files):
                keep_it = verified = True
            else:
                log.warning("gc: committed step %d under %s does not verify", step, storage.display_url)
        if keep_it:
            kept.append(step)
            gc.drop_other_generations(step, info)
        else:
            gc.delete_step(step)
    if gc.deleted:
        log.info("gc under %s deleted %d paths", storage.display_url, len(gc.deleted))
    return {"deleted": gc.deleted, "kept": sorted(kept)}


class _Pass:
    """The deletions of one pass; `deleted` lists what was (or, dry run, would be) deleted."""

    def __init__(self, storage: Storage, *, spare_above: int | None, dry_run: bool) -> None:
        self.storage = storage
        self.spare_above = spare_above  # data dirs of generations above this are never touched
        self.dry_run = dry_run
        self.deleted: list[str] = []

    def _spared(self, name: str) -> bool:
        gen = mf.parse_data_dir(name)
        return gen is not None and self.spare_above is not None and gen > self.spare_above

    def _rm(self, path: str, *, report: bool = True) -> None:
        if report:
            self.deleted.append(self.storage.url_for(path))
        if not self.dry_run:
            self.storage.rm(path)

    def drop_other_generations(self, step: int, info: mf.CommitInfo) -> None:
        """In a kept step: data of other (older, fenced) generations' attempts at the same step."""
        sp = mf.step_path(self.storage, step)
        for name in self.storage.listdir(sp):
            if mf.parse_data_dir(name) is None or name == info.data_dir or self._spared(name):
                continue
            self._rm(f"{sp}/{name}")

    def delete_step(self, step: int) -> None:
        """Manifest first, then each entry; never a newer generation's data dir, and never a
        recursive delete of the step directory (files a newer generation writes after this
        listing survive; a local step directory is removed only once empty)."""
        sp = mf.step_path(self.storage, step)
        names = self.storage.listdir(sp)
        spared = [n for n in names if self._spared(n)]
        if spared:
            log.info("gc: step %d under %s holds data of newer generation(s) %s: left alone",
                     step, self.storage.display_url, spared)
            if mf.MANIFEST_NAME in names:
                self._rm(f"{sp}/{mf.MANIFEST_NAME}")
            for name in names:
                if mf.parse_data_dir(name) is not None and name not in spared:
                    self._rm(f"{sp}/{name}")
            return
        self.deleted.append(self.storage.url_for(sp))
        if mf.MANIFEST_NAME in names:
            self._rm(f"{sp}/{mf.MANIFEST_NAME}", report=False)  # first: no longer a checkpoint
        for name in names:
            if name != mf.MANIFEST_NAME:
                self._rm(f"{sp}/{name}", report=False)
        if not self.dry_run:
            self.storage.rmdir_if_empty(sp)

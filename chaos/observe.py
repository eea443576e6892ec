"""The run as seen from outside: the files the runtime publishes on storage.

Everything the chaos suite knows about a run comes from here: `status.json` (live state and
worker pids), `summary.json`, `metrics.jsonl` and the checkpoint directories with their
COMMITTED manifests (read through the `checkpointing` package's public storage and manifest
modules, uncached). For S3 the runner reads the store directly, never through its fault proxy,
so a storage outage blinds the run, not the observer.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from checkpointing import manifest as mf
from checkpointing.errors import CheckpointError
from checkpointing.storage import Storage

log = logging.getLogger("chaos.observe")


def fence_facts(fence: mf.Fence | None) -> dict | None:
    """FENCE as plain data for the history: generation, holder, and [generation, start step,
    run id] for each generation of its history."""
    if fence is None:
        return None
    return {"generation": fence.generation, "run_id": fence.run_id,
            "history": [[e.generation, e.start_step, e.run_id] for e in fence.history]}


class RunView:
    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.storage = Storage(url, storage_options)

    # ---- run record ----------------------------------------------------------------------
    def read_json(self, name: str) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(self.storage.path(name)))
        except FileNotFoundError:
            return None
        except (CheckpointError, ValueError) as e:
            # A transient read error or a file caught mid-replace on a non-atomic store: the
            # caller polls again.
            log.debug("could not read %s: %s", name, e)
            return None

    def status(self) -> dict | None:
        return self.read_json("status.json")

    def summary(self) -> dict | None:
        return self.read_json("summary.json")

    def metrics(self) -> list[dict[str, Any]]:
        try:
            text = self.storage.read_bytes(self.storage.path("metrics.jsonl")).decode()
        except (FileNotFoundError, CheckpointError):
            return []
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

    def workers(self) -> list[dict]:
        """Workers of the current generation, as status.json lists them (rank, pid, node_id)."""
        status = self.status() or {}
        return sorted(status.get("workers") or [], key=lambda w: w["rank"])

    # ---- checkpoints ---------------------------------------------------------------------
    def committed(self) -> list[mf.CommitInfo]:
        return mf.list_committed(self.storage)

    def fence(self) -> mf.Fence | None:
        """FENCE: the newest generation, the run holding the storage and the generations'
        history with the step each started from."""
        return mf.read_fence_doc(self.storage)

    def manifests(self) -> tuple[mf.Fence | None, dict[int, int], dict[int, int]]:
        """FENCE, then every readable manifest as step -> generation, split into those the fence
        history accepts (the committed checkpoints, as `committed()` lists them) and those it
        rejects (a fenced writer's late commit, or a timeline a later generation abandoned).
        FENCE is read before the listing, as the runtime's readers do."""
        fence = self.fence()
        accepted, rejected = {}, {}
        for step in mf.list_steps(self.storage):
            try:
                info = mf.read_manifest(self.storage, step)
            except CheckpointError:
                continue
            if info is None:
                continue
            if fence is not None and fence.rejects(info) is not None:
                rejected[step] = info.generation
            else:
                accepted[step] = info.generation
        return fence, accepted, rejected

    def step_dirs(self) -> list[int]:
        return mf.list_steps(self.storage)

    def has_manifest(self, step: int) -> bool:
        return self.storage.exists(f"{mf.step_path(self.storage, step)}/{mf.MANIFEST_NAME}")

    def step_files(self, step: int) -> list[str]:
        """Files under a step directory (relative to it), committed or not."""
        return self.storage.find(mf.step_path(self.storage, step))

    def verify(self, info: mf.CommitInfo) -> list[dict]:
        """Mismatches between a committed checkpoint's files and its manifest ([] when intact)."""
        return mf.verify_files(self.storage, info.step, info.files)

    def corrupt_file(self, step: int, relpath: str, n_bytes: int = 16) -> dict:
        """Flip `n_bytes` bytes in the middle of one file of a step directory (same size)."""
        path = f"{mf.step_path(self.storage, step)}/{relpath}"
        data = bytearray(self.storage.read_bytes(path))
        if not data:
            raise ValueError(f"{path} is empty: nothing to corrupt")
        start = max(0, len(data) // 2 - n_bytes // 2)
        for i in range(start, min(len(data), start + n_bytes)):
            data[i] ^= 0xFF
        self.storage.write_atomic(path, bytes(data))
        return {"step": step, "file": relpath, "offset": start, "bytes": min(n_bytes, len(data) - start),
                "size": len(data)}

    def is_empty(self) -> bool:
        return not self.storage.listdir(self.storage.root)

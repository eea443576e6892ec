"""Checkpoint layout on storage, the COMMITTED manifest, checksums and the generation fence.

Layout under `<url>/checkpoints/`:
  step_<step:08d>/COMMITTED        the manifest; its presence is what makes a checkpoint
  step_<step:08d>/g<gen:06d>/...   the DCP files written by generation <gen>
  FENCE                            the newest generation, the run holding the storage, and the
                                   history of generations with the step each one started from

Shards live in a per-generation subdirectory so that a zombie from an older generation that
passed its fence check before the new generation wrote FENCE still cannot overwrite a newer
generation's files for the same step. The shared objects, COMMITTED and FENCE, are only ever
written by compare-and-swap (`Storage.put_if`): a commit creates COMMITTED if absent or replaces
the exact version it read; a fence update replaces the exact FENCE it read. Two generations can
therefore never both believe they advanced the fence, and a writer that lost the race re-reads.

The fence history closes the last window: a writer of generation h that passed every check and
then stalled can still commit a step no later generation has committed yet. Every generation g
records the step it started from (`start_step`); a manifest of generation h whose step is past
the start step of some generation g > h belongs to a timeline that g abandoned, and listing,
loading and GC treat it as not committed (`Fence.rejects`).

Manifests are validated before anything is read through them: `data_dir` must be the writing
generation's `g<gen:06d>`, every file key a plain relative path inside it, so a tampered or
corrupt manifest can never point a reader outside the step directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, overload

from checkpointing.errors import CorruptCheckpointError, FencedError, RunConflictError, SaveCancelledError, StorageError
from checkpointing.storage import PreconditionFailed, Storage

MANIFEST_NAME = "COMMITTED"
FENCE_NAME = "FENCE"
# checkpoints/LATEST: a small hint, the newest step committed (written by the committer after
# COMMITTED). It lets a poller see "nothing new" in one small GET instead of a listing and a
# manifest read. It is never trusted for correctness: whoever restores lists the manifests, and
# a poller still lists now and then (a hint write may fail, and a hint may be stale).
LATEST_NAME = "LATEST"
LATEST_FORMAT = 1
CHECKPOINTS_DIR = "checkpoints"
FORMAT_VERSION = 1        # of COMMITTED (`meta` is an optional key older readers ignore)
FENCE_FORMAT = 2          # FENCE with run ownership and history; format 1 had only `generation`
FENCE_HISTORY_MAX = 1000  # newest entries kept; an older generation's manifest is still judged by them
CAS_ATTEMPTS = 8          # re-reads after a lost compare-and-swap before giving up
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_DATA_DIR_RE = re.compile(r"^g(\d{6,})$")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True)
class CommitInfo:
    """A committed checkpoint as its manifest describes it."""

    step: int
    world_size: int
    generation: int
    path: str  # URL of the step directory
    files: dict  # relpath (to the step directory) -> {"size": int, "sha256": str}
    committed_at: float
    data_dir: str = ""  # subdirectory holding the DCP files, relative to the step directory
    meta: dict | None = None  # the caller's JSON state saved with it (`save(..., meta=)`)

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What `CheckpointManager.load_latest` loaded, and the newer checkpoints it had to skip."""

    step: int
    world_size: int
    generation: int
    path: str
    skipped: list = dataclasses.field(default_factory=list)  # [{"step": int, "reason": str}]
    meta: dict | None = None  # the JSON state saved with the checkpoint, or None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def data_dir_name(generation: int) -> str:
    return f"g{generation:06d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_data_dir(name: str) -> int | None:
    """The generation of a data directory name (`g000004` -> 4), or None for anything else."""
    m = _DATA_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def checkpoints_path(storage: Storage) -> str:
    return storage.path(CHECKPOINTS_DIR)


def step_path(storage: Storage, step: int) -> str:
    return storage.path(CHECKPOINTS_DIR, step_dir_name(step))


# ---- JSON state (`meta`) ---------------------------------------------------------------------
def strict_json(value: Any, where: str = "meta") -> Any:
    """`value` as plain strict JSON: dict (str keys), list, str, int, float, bool, None.

    A non-finite float becomes None (the project's rule for every file it writes); anything
    else that JSON cannot hold raises TypeError naming where it is.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; JSON object keys are strings")
            out[k] = strict_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [strict_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where} is a {type(value).__name__}, which JSON cannot hold; pass plain "
                    f"dicts, lists, strings, numbers, bools and None (tensors belong in the state)")


# ---- manifest --------------------------------------------------------------------------------
def encode_manifest(step: int, world_size: int, generation: int, data_dir: str,
                    files: dict[str, dict], *, meta: dict | None = None) -> bytes:
    doc = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "generation": generation,
        "data_dir": data_dir,
        "files": {k: files[k] for k in sorted(files)},
        "committed_at": time.time(),
    }
    if meta is not None:
        doc["meta"] = strict_json(meta)
    return json.dumps(doc, indent=1, allow_nan=False).encode()


def _int(doc: dict, key: str, minimum: int) -> int:
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def check_relpath(key: str, data_dir: str) -> None:
    """A manifest file key must be a normalized relative path inside `data_dir`."""
    if not isinstance(key, str) or "\\" in key or "\x00" in key or key.startswith("/"):
        raise ValueError(f"file key {key!r} is not a relative path")
    parts = key.split("/")
    if len(parts) < 2 or parts[0] != data_dir:
        raise ValueError(f"file key {key!r} is not inside the data directory {data_dir!r}")
    for part in parts:
        if part in ("", ".", "..") or not _SEGMENT_RE.match(part):
            raise ValueError(f"file key {key!r} is not a normalized relative path")


def decode_manifest(raw: bytes, path_url: str, *, step: int | None = None) -> CommitInfo:
    """Parse and validate a manifest; CorruptCheckpointError when it is unreadable or names a
    path outside its step's data directory (never trusted: it sits next to the data it lists)."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        fmt = doc.get("format", FORMAT_VERSION)
        if fmt != FORMAT_VERSION:
            raise ValueError(f"format {fmt!r} is not {FORMAT_VERSION} (written by another version?)")
        info_step = _int(doc, "step", 0)
        if step is not None and info_step != step:
            raise ValueError(f"it says step {info_step} but sits in {step_dir_name(step)}")
        generation = _int(doc, "generation", 0)
        data_dir = doc["data_dir"]
        if data_dir != data_dir_name(generation):
            raise ValueError(f"data_dir {data_dir!r} is not {data_dir_name(generation)!r} "
                             f"(generation {generation})")
        if not isinstance(doc["files"], dict) or not doc["files"]:
            raise ValueError("files must be a non-empty object")
        files = {}
        for k, v in doc["files"].items():
            check_relpath(k, data_dir)
            size, sha = v["size"], v["sha256"]
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"file {k!r}: size {size!r}")
            if not isinstance(sha, str) or not _SHA256_RE.match(sha):
                raise ValueError(f"file {k!r}: sha256 {sha!r}")
            files[k] = {"size": size, "sha256": sha}
        meta = doc.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"meta must be a JSON object, got {type(meta).__name__}")
        committed_at = doc["committed_at"]
        if isinstance(committed_at, bool) or not isinstance(committed_at, (int, float)):
            raise ValueError(f"committed_at {committed_at!r}")
        return CommitInfo(
            step=info_step, world_size=_int(doc, "world_size", 1), generation=generation,
            path=path_url, files=files, committed_at=float(committed_at), data_dir=data_dir, meta=meta,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"unreadable manifest {path_url}/{MANIFEST_NAME}: {type(e).__name__}: {e}; it is ignored "
            f"(python -m checkpointing gc deletes it) - restore it if it should be there",
            url=path_url) from e


def data_files(info: CommitInfo) -> set[str]:
    """The manifest's files relative to its data directory (what a DCP reader may open)."""
    prefix = info.data_dir + "/"
    return {k[len(prefix):] for k in info.files if k.startswith(prefix)}


def read_manifest(storage: Storage, step: int) -> CommitInfo | None:
    """The manifest of `step`, or None when the step is not committed (no fence check)."""
    sp = step_path(storage, step)
    try:
        raw = storage.read_bytes(f"{sp}/{MANIFEST_NAME}")
    except FileNotFoundError:
        return None
    return decode_manifest(raw, storage.url_for(sp), step=step)


def write_latest_hint(storage: Storage, info: CommitInfo) -> None:
    """Point checkpoints/LATEST at `info` (one small PUT; see LATEST_NAME)."""
    doc = {"format": LATEST_FORMAT, "step": info.step, "generation": info.generation, "at": time.time()}
    storage.write_atomic(f"{checkpoints_path(storage)}/{LATEST_NAME}", json.dumps(doc).encode())


def read_latest_hint(storage: Storage) -> int | None:
    """The step checkpoints/LATEST names, or None (absent or unreadable: a hint, see LATEST_NAME)."""
    try:
        doc = json.loads(storage.read_bytes(f"{checkpoints_path(storage)}/{LATEST_NAME}"))
        step = doc["step"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def list_steps(storage: Storage) -> list[int]:
    """Every step directory (committed or not), oldest first."""
    steps = (parse_step(n) for n in storage.listdir(checkpoints_path(storage)))
    return sorted(s for s in steps if s is not None)


def iter_committed(storage: Storage, *, log=None, after: int | None = None,
                   fence: Fence | None | bool = True) -> Iterator[CommitInfo]:
    """Committed checkpoints, NEWEST FIRST, reading one manifest per step only as far as the
    caller iterates (`next(...)` reads the newest only). Stops below `after` (exclusive).

    Skipped with a warning on `log`: an unreadable or invalid manifest, and a manifest the fence
    history rejects (a fenced writer's late commit). `fence=True` reads FENCE first (before
    listing, so a commit made after a newer generation started is judged by that generation's
    entry); pass a `Fence` already read, or None to skip the history check.
    """
    if fence is True:
        fence = read_fence_doc(storage)
    for step in reversed(list_steps(storage)):
        if after is not None and step <= after:
            return
        try:
            info = read_manifest(storage, step)
        except CorruptCheckpointError as e:
            if log is not None:
                log.warning("%s", e)
            continue
        if info is None:
            continue
        reason = fence.rejects(info) if isinstance(fence, Fence) else None
        if reason is not None:
            if log is not None:
                log.warning("ignoring the manifest of step %d at %s: %s", info.step, storage.display(info.path), reason)
            continue
        yield info


def list_committed(storage: Storage, *, log=None) -> list[CommitInfo]:
    """Committed checkpoints, oldest first. An unreadable manifest, or one the fence history
    rejects, is reported and left out."""
    return list(reversed(list(iter_committed(storage, log=log))))


def latest_committed(url: str, storage_options: dict | None = None) -> CommitInfo | None:
    """Newest committed checkpoint under `url` (manifest only, checksums not rechecked).

    Reads FENCE, one listing, and manifests newest first until one is valid. Usable from any
    process, in a process group or not (controller, CLI, tests).
    """
    return next(iter_committed(Storage(url, storage_options)), None)


# ---- fence -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FenceEntry:
    generation: int
    start_step: int | None  # the step the generation started from (restored), if known
    run_id: str | None
    at: float


@dataclasses.dataclass(frozen=True)
class Fence:
    """What `<url>/checkpoints/FENCE` holds, and the version token it was read with."""

    generation: int | None       # None: a lease was taken but no generation started yet
    run_id: str | None = None    # the run holding the storage (see checkpointing.lease)
    lease_at: float | None = None
    released: bool = False       # the holder ended cleanly and let go
    history: tuple[FenceEntry, ...] = ()          # oldest first
    token: str | None = dataclasses.field(default=None, compare=False)

    def rejects(self, info: CommitInfo) -> str | None:
        """Why `info` is not part of the run's timeline, or None if it may be."""
        for e in self.history:
            if e.generation > info.generation and e.start_step is not None and info.step > e.start_step:
                return (f"generation {info.generation} committed step {info.step} after generation "
                        f"{e.generation} had started from step {e.start_step}: a fenced writer's late "
                        f"commit, not part of the run's timeline")
        return None

    def encode(self) -> bytes:
        doc = {"format": FENCE_FORMAT, "generation": self.generation, "run_id": self.run_id,
               "lease_at": self.lease_at, "released": self.released,
               "history": [dataclasses.asdict(e) for e in self.history[-FENCE_HISTORY_MAX:]],
               "updated_at": time.time()}
        return json.dumps(doc, indent=1, allow_nan=False).encode()


def fence_path(storage: Storage) -> str:
    return storage.path(CHECKPOINTS_DIR, FENCE_NAME)


def _decode_fence(raw: bytes, token: str | None, url: str) -> Fence:
    try:
        doc = json.loads(raw)
        gen = doc["generation"]
        if gen is not None and (isinstance(gen, bool) or not isinstance(gen, int) or gen < 0):
            raise ValueError(f"generation {gen!r}")
        history = tuple(FenceEntry(generation=int(e["generation"]),
                                   start_step=None if e.get("start_step") is None else int(e["start_step"]),
                                   run_id=e.get("run_id"), at=float(e.get("at", 0.0)))
                        for e in doc.get("history", ()))
        lease_at = doc.get("lease_at")
        return Fence(generation=gen, run_id=doc.get("run_id"),
                     lease_at=None if lease_at is None else float(lease_at),
                     released=bool(doc.get("released", False)), history=history, token=token)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        # Treating garbage as "no fence" would let zombies write; make the operator fix it.
        raise CorruptCheckpointError(
            f"unreadable fence {url}/{CHECKPOINTS_DIR}/{FENCE_NAME}: {e}; rewrite it with "
            f"CheckpointManager.set_generation(<current generation>) after deleting it", url=url) from e


def read_fence_doc(storage: Storage) -> Fence | None:
    """FENCE with its version token (for a compare-and-swap), or None if it does not exist."""
    try:
        raw, token = storage.read_versioned(fence_path(storage))
    except FileNotFoundError:
        return None
    return _decode_fence(raw, token, storage.url)


def read_fence(storage: Storage) -> int | None:
    doc = read_fence_doc(storage)
    return doc.generation if doc is not None else None


@overload
def update_fence(storage: Storage, change: Callable[[Fence | None], Fence]) -> Fence: ...
@overload
def update_fence(storage: Storage, change: Callable[[Fence | None], Fence | None]) -> Fence | None: ...


def update_fence(storage: Storage, change: Callable[[Fence | None], Fence | None]) -> Fence | None:
    """Compare-and-swap FENCE: `change(current Fence | None) -> Fence | None` (None: no write;
    it may raise to refuse). Re-reads and re-applies `change` when another writer got there first.
    Returns the FENCE written, or the current one when `change` wrote none (None: no FENCE)."""
    path = fence_path(storage)
    for _ in range(CAS_ATTEMPTS):
        current = read_fence_doc(storage)
        new = change(current)
        if new is None:
            return current
        try:
            storage.put_if(path, new.encode(), if_token=current.token if current is not None else None)
        except PreconditionFailed:
            continue
        return new
    raise StorageError(f"updating {storage.display_url}/{CHECKPOINTS_DIR}/{FENCE_NAME} lost {CAS_ATTEMPTS} "
                       f"compare-and-swaps in a row: something else is rewriting it", url=storage.url)


def advance_fence(storage: Storage, generation: int, *, start_step: int | None = None,
                  run_id: str | None = None) -> Fence:
    """Make `generation` current (a CAS on FENCE); older generations are fenced from then on.

    Idempotent for the generation already current (same run, or `run_id` None). Raises
    FencedError if FENCE is already past `generation`, also when another writer advanced it
    between the read and the write; RunConflictError if `run_id` is given and FENCE belongs to
    another run (this run's storage was taken over), or that run already took `generation`.
    """
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation must be an integer >= 0, got {generation!r}")

    def change(cur: Fence | None) -> Fence | None:
        if cur is not None:
            if run_id is not None and cur.run_id not in (None, run_id) and not cur.released:
                raise RunConflictError(
                    f"{storage.display_url} is held by run {cur.run_id}, not this run ({run_id}): another run "
                    f"took its storage over; this run must stop", url=storage.url, owner=cur.run_id)
            if cur.generation is not None and cur.generation > generation:
                raise FencedError(
                    f"generation {generation} refused: {storage.display_url}/{CHECKPOINTS_DIR}/{FENCE_NAME} is "
                    f"already at generation {cur.generation} (run {cur.run_id}); generations must grow: "
                    f"use a generation > {cur.generation}", url=storage.url)
            if cur.generation == generation:
                entry = next((e for e in reversed(cur.history) if e.generation == generation), None)
                taken_by = entry.run_id if entry is not None else None
                if run_id is not None and taken_by not in (None, run_id):
                    raise RunConflictError(
                        f"generation {generation} under {storage.display_url} was already started by run {taken_by}",
                        url=storage.url, owner=taken_by)
                if start_step is None or (entry is not None and entry.start_step == start_step):
                    return None
                # Recording the start step of the current generation once its restore is planned
                # (the controller fences first, then plans, so a commit racing the plan is fenced).
                history = tuple(dataclasses.replace(e, start_step=start_step) if e is entry else e
                                for e in cur.history)
                if entry is None:
                    history += (FenceEntry(generation=generation, start_step=start_step,
                                           run_id=run_id, at=time.time()),)
                return dataclasses.replace(cur, history=history, token=None)
        history = (cur.history if cur is not None else ()) + (
            FenceEntry(generation=generation, start_step=start_step, run_id=run_id, at=time.time()),)
        owner = run_id if run_id is not None else (cur.run_id if cur is not None else None)
        return Fence(generation=generation, run_id=owner,
                     lease_at=cur.lease_at if cur is not None else None,
                     released=False if run_id is not None else (cur.released if cur is not None else False),
                     history=history[-FENCE_HISTORY_MAX:])

    result = update_fence(storage, change)
    assert result is not None, "change() writes whenever there is no FENCE yet"
    return result


def write_fence(storage: Storage, generation: int, *, start_step: int | None = None) -> None:
    """`advance_fence` without a run id (kept for tools and tests that set a generation)."""
    advance_fence(storage, generation, start_step=start_step)


# ---- checksums ---------------------------------------------------------------------------------
class HashingWriter:
    """Wraps a binary write stream; records size and sha256 of what passes through."""

    def __init__(self, raw, cancel: threading.Event | None = None) -> None:
        self.raw = raw
        self.size = 0
        self._h = hashlib.sha256()
        self._cancel = cancel  # set by CheckpointManager.abandon: stop uploading, commit nothing

    def write(self, data) -> int:
        if self._cancel is not None and self._cancel.is_set():
            raise SaveCancelledError("save abandoned (CheckpointManager.abandon): upload stopped")
        mv = memoryview(data).cast("B")
        self._h.update(mv)  # hashlib releases the GIL for large buffers
        self.size += mv.nbytes
        return self.raw.write(mv)

    def tell(self) -> int:
        # DCP records item offsets with tell(); counting is exact and avoids a backend call.
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        # DCP closes the stream it was given; the owner of `raw` fsyncs and closes it after.
        pass

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def hash_stream(stream) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    while True:
        chunk = stream.read(_CHUNK)
        if not chunk:
            return size, h.hexdigest()
        h.update(chunk)
        size += len(chunk)


def verify_files(storage: Storage, step: int, files: dict[str, dict]) -> list[dict]:
    """Recheck sizes then checksums of `files`; returns [{"file", "reason"}] for mismatches."""
    sp = step_path(storage, step)
    bad = []
    for rel, want in sorted(files.items()):
        path = f"{sp}/{rel}"
        try:
            size = storage.size(path)
            if size != want["size"]:
                bad.append({"file": rel, "reason": f"size {size} != manifest {want['size']}"})
                continue
            with storage.open_read(path) as f:
                _, digest = hash_stream(f)
        except FileNotFoundError:
            bad.append({"file": rel, "reason": "missing"})
            continue
        if digest != want["sha256"]:
            bad.append({"file": rel, "reason": f"sha256 {digest[:12]}.. != manifest {want['sha256'][:12]}.."})
    return bad


def manifest_dict(info: CommitInfo) -> dict[str, Any]:
    return dataclasses.asdict(info)

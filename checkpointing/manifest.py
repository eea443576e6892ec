"""Checkpoint layout on storage, the COMMITTED manifest, checksums and the generation fence.

Layout under `<url>/checkpoints/`:
  step_<step:08d>/COMMITTED        the manifest; its presence is what makes a checkpoint
  step_<step:08d>/g<gen:06d>/...   the DCP files written by generation <gen>
  FENCE                            the newest generation; older ones may not write or commit

Shards live in a per-generation subdirectory so that a zombie from an older generation that
passed its fence check before the new generation wrote FENCE still cannot overwrite a newer
generation's files for the same step: the only shared object is COMMITTED, guarded by the fence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from typing import Any

from checkpointing.errors import CorruptCheckpointError
from checkpointing.storage import Storage

MANIFEST_NAME = "COMMITTED"
FENCE_NAME = "FENCE"
CHECKPOINTS_DIR = "checkpoints"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8,})$")
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


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def data_dir_name(generation: int) -> str:
    return f"g{generation:06d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def checkpoints_path(storage: Storage) -> str:
    return storage.path(CHECKPOINTS_DIR)


def step_path(storage: Storage, step: int) -> str:
    return storage.path(CHECKPOINTS_DIR, step_dir_name(step))


def encode_manifest(step: int, world_size: int, generation: int, data_dir: str,
                    files: dict[str, dict]) -> bytes:
    doc = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "generation": generation,
        "data_dir": data_dir,
        "files": {k: files[k] for k in sorted(files)},
        "committed_at": time.time(),
    }
    return json.dumps(doc, indent=1).encode()


def decode_manifest(raw: bytes, path_url: str) -> CommitInfo:
    try:
        doc = json.loads(raw)
        files = {str(k): {"size": int(v["size"]), "sha256": str(v["sha256"])}
                 for k, v in doc["files"].items()}
        return CommitInfo(
            step=int(doc["step"]), world_size=int(doc["world_size"]),
            generation=int(doc["generation"]), path=path_url, files=files,
            committed_at=float(doc["committed_at"]), data_dir=str(doc.get("data_dir", "")),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(
            f"unreadable manifest {path_url}/{MANIFEST_NAME}: {e}; delete that step directory "
            f"(python -m checkpointing gc) or restore it", url=path_url) from e


def read_manifest(storage: Storage, step: int) -> CommitInfo | None:
    """The manifest of `step`, or None when the step is not committed."""
    sp = step_path(storage, step)
    try:
        raw = storage.read_bytes(f"{sp}/{MANIFEST_NAME}")
    except FileNotFoundError:
        return None
    return decode_manifest(raw, storage.url_for(sp))


def list_steps(storage: Storage) -> list[int]:
    """Every step directory (committed or not), oldest first."""
    steps = (parse_step(n) for n in storage.listdir(checkpoints_path(storage)))
    return sorted(s for s in steps if s is not None)


def list_committed(storage: Storage, *, log=None) -> list[CommitInfo]:
    """Committed checkpoints, oldest first. An unreadable manifest is reported and left out."""
    out = []
    for step in list_steps(storage):
        try:
            info = read_manifest(storage, step)
        except CorruptCheckpointError as e:
            if log is not None:
                log.warning("%s", e)
            continue
        if info is not None:
            out.append(info)
    return out


def latest_committed(url: str, storage_options: dict | None = None) -> CommitInfo | None:
    """Newest committed checkpoint under `url` (manifest only, checksums not rechecked).

    Usable from any process, in a process group or not (controller, CLI, tests).
    """
    committed = list_committed(Storage(url, storage_options))
    return committed[-1] if committed else None


# ---- checksums ---------------------------------------------------------------------------------
class HashingWriter:
    """Wraps a binary write stream; records size and sha256 of what passes through."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.size = 0
        self._h = hashlib.sha256()

    def write(self, data) -> int:
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


# ---- fence -------------------------------------------------------------------------------------
def read_fence(storage: Storage) -> int | None:
    try:
        raw = storage.read_bytes(storage.path(CHECKPOINTS_DIR, FENCE_NAME))
    except FileNotFoundError:
        return None
    try:
        return int(json.loads(raw)["generation"])
    except (ValueError, KeyError, TypeError) as e:
        # Treating garbage as "no fence" would let zombies write; make the operator fix it.
        raise CorruptCheckpointError(
            f"unreadable fence {storage.url}/{CHECKPOINTS_DIR}/{FENCE_NAME}: {e}; rewrite it with "
            f"CheckpointManager.set_generation(<current generation>)", url=storage.url) from e


def write_fence(storage: Storage, generation: int) -> None:
    doc = {"generation": generation, "updated_at": time.time()}
    storage.write_atomic(storage.path(CHECKPOINTS_DIR, FENCE_NAME), json.dumps(doc).encode())


def manifest_dict(info: CommitInfo) -> dict[str, Any]:
    return dataclasses.asdict(info)

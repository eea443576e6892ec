"""torch.distributed.checkpoint (DCP) storage writer/reader on top of `Storage`.

Internal. DCP's own FsspecWriter opens its own (cached) fsspec instance and can only fsync
through `os.sync()` on non-local streams; this adapter routes every byte through `Storage`,
records size + sha256 of each file as it is written (no read-back for the manifest), fsyncs
local files, and makes `rename` cheap on object stores (the only rename DCP does is the
small `.metadata` file). A writer stops at its next write once its save is cancelled (an
abandoned save); a reader opens only the files its manifest lists (DCP's `.metadata` names the
files to read, and it is not trusted to stay inside the checkpoint).

Requests that would grow with the world size for nothing are left out: a rank with nothing to
write (under DDP every rank but the lowest: replicated tensors are written once) writes no file
at all, where DCP's writer would PUT an empty `.distcp` per rank; and no rank but the coordinator
asks whether a `.metadata` exists already (DCP's writer asks on every rank, only to warn).
(Under tensor parallelism every rank holds TP shards of its own, and DCP's de-duplication keys
items by name and global offset, not by placement: a DTensor replicated over the DP dimension of a
2-D mesh, (Replicate(), Shard(0)), is written once per TP shard, and a rank left with nothing
after de-duplication still writes no file.)

DCP records each rank's piece of a DTensor as one block of the global tensor: its first global
offset and its local shape (torch.distributed.tensor._utils.compute_local_shape_and_global_offset).
A placement whose local shard is not one block (a `_StridedShard` that is not directly refined by
the `Shard` it was made for, e.g. (Shard(0), _StridedShard(0, sf=2)), or _StridedShard alone) is
mis-addressed: a save fails in DCP's plan validation ("overlapping chunks"), and a load into it
fills every shard with the wrong elements, silently. `unaddressable_dtensors` finds those, so
that loads refuse them first (see _load) and saves say why DCP refused. FSDP2 over TP
(parallelize_module, then fully_shard) gives (_StridedShard(d, sf=tp), Shard(d)): blocks.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
    _split_by_size_and_type,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpointing._write_process import WriteProcess, resolve
from checkpointing.errors import CorruptCheckpointError
from checkpointing.manifest import HashingWriter
from checkpointing.storage import Storage

# Single-process saves/loads (no process group) are intended here, not a misconfiguration.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class _StorageFS(FileSystemBase):
    def __init__(self, storage: Storage, base: str, *, cancel: threading.Event | None = None,
                 allowed: set[str] | None = None) -> None:
        self.storage = storage
        self.base = base.rstrip("/")
        self._lock = threading.Lock()  # DCP may write files from several threads
        self.written: dict[str, dict] = {}  # path relative to base -> {"size", "sha256"}
        self.cancel = cancel
        self.allowed = allowed  # reader: the manifest's files (relative to base); None: any

    def _rel(self, path) -> str:
        path = os.fspath(path)
        return path[len(self.base) + 1:] if path.startswith(self.base + "/") else path

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator:
        path = os.fspath(path)
        if "r" in mode:
            if self.allowed is not None and self._rel(path) not in self.allowed:
                raise CorruptCheckpointError(
                    f"the checkpoint's .metadata asks to read {path!r}, which its manifest does not "
                    f"list; refusing to read outside the checkpoint", url=self.storage.url)
            with self.storage.open_read(path) as stream:
                yield stream
            return
        raw = self.storage.open_write(path)
        hashing = HashingWriter(raw, self.cancel)
        try:
            yield hashing
            self.storage.fsync_file(raw)
            raw.close()  # object stores upload here: errors must fail the save
        except BaseException:
            # Abort the upload (s3fs discards the multipart) and leave no partial file behind.
            discard = getattr(raw, "discard", None)
            try:
                discard() if discard else raw.close()
            except Exception:  # noqa: BLE001 - best-effort cleanup: the save raises the original error
                pass
            try:
                self.storage.rm(path, recursive=False)
            except Exception:  # noqa: BLE001 - best-effort cleanup: the save raises the original error
                pass
            raise
        with self._lock:
            self.written[self._rel(path)] = {"size": hashing.size, "sha256": hashing.hexdigest()}

    def concat_path(self, path, suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path, **kwargs) -> str:
        return os.fspath(path)

    def rename(self, path, new_path) -> None:
        # Only DCP's `.metadata.tmp -> .metadata` goes through here. Atomicity is not needed:
        # nothing is a checkpoint before COMMITTED exists. Rewrite the small file under its
        # final name instead of a server-side copy (which S3 lacks as a rename).
        path, new_path = os.fspath(path), os.fspath(new_path)
        if self.storage.is_local:
            os.replace(path, new_path)
        else:
            data = self.storage.read_bytes(path)
            self.storage.write_atomic(new_path, data)
            self.storage.rm(path, recursive=False)
        with self._lock:
            rec = self.written.pop(self._rel(path), None)
            if rec is not None:
                self.written[self._rel(new_path)] = rec

    def mkdir(self, path) -> None:
        self.storage.makedirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def exists(self, path) -> bool:
        return self.storage.exists(os.fspath(path))

    def rm_file(self, path) -> None:
        self.storage.rm(os.fspath(path), recursive=False)

    def ls(self, path) -> list[str]:
        return [self.concat_path(path, n) for n in self.storage.listdir(os.fspath(path))]


class StorageWriter(FileSystemWriter):
    """DCP writer into `<storage path>`; `written` has size + sha256 of this rank's files."""

    def __init__(self, storage: Storage, path: str, *, thread_count: int = 1,
                 cancel: threading.Event | None = None, process: WriteProcess | None = None) -> None:
        """`process`: write this rank's files from that child process (checkpointing._write_process)
        instead of this one; DCP's planning stays here."""
        # sync_files=False: DCP's fallback is a global os.sync(); _StorageFS fsyncs local files.
        super().__init__(path, single_file_per_rank=True, sync_files=False,
                         thread_count=thread_count, overwrite=True)
        self._storage_fs = _StorageFS(storage, path, cancel=cancel)
        self._process = process
        # DCP takes any FileSystemBase here (torch's FsspecWriter does the same); the base class
        # annotates `fs` with its local FileSystem.
        self.fs = self._storage_fs  # type: ignore[assignment]
        self.path = path

    @property
    def written(self) -> dict[str, dict]:
        return dict(self._storage_fs.written)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # DCP's asks every rank whether a .metadata exists (one HEAD per rank on S3) only to
        # warn that it overwrites; the commit protocol decides what a step's files are. (This
        # writer always plans collectively: DCP's per-rank prefixes come in prepare_global_plan.)
        self.fs.mkdir(self.path)      # a no-op on object stores (see Storage.makedirs)
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not plan.items:
            # Nothing of this rank's to write: no file (DCP's writer would PUT an empty one).
            done: Future[list[WriteResult]] = Future()
            done.set_result([])
            return done
        if self._process is None:
            return super().write_data(plan, planner)
        # The files as DCP's own writer names and fills them (one per bucket), written by the child.
        files = []
        for number, bucket in enumerate(_split_by_size_and_type(self.thread_count, plan.items)):
            name = f"{plan.storage_data.prefix}{number}{DEFAULT_SUFFIX}"
            files.append((self.fs.concat_path(self.path, name), name, bucket))
        fs = self._storage_fs
        results, written = self._process.write(fs.storage.url, fs.storage.storage_options, os.fspath(self.path), files,
                                               resolve(planner, plan.items), self.transforms,
                                               self.serialization_format, fs.cancel)
        with fs._lock:
            fs.written.update(written)
        done = Future()
        done.set_result(results)
        return done


class StorageReader(FileSystemReader):
    """DCP reader from `<storage path>`; with `allowed`, only those files (relative to it) open."""

    def __init__(self, storage: Storage, path: str, *, allowed: set[str] | None = None) -> None:
        super().__init__(path)
        self.fs = _StorageFS(storage, path, allowed=allowed)  # type: ignore[assignment]  # as in StorageWriter
        self.path = path


def unaddressable_dtensors(state: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the DTensors in `state` whose shard on this rank is not one block of the
    global tensor (see the module docstring), with their placements. Local: no collective."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - torch builds without distributed
        return []
    found: list[str] = []

    def visit(key: str, value: Any) -> None:
        if isinstance(value, DTensor):
            if any(isinstance(p, _StridedShard) for p in value.placements) and not _one_block(value):
                found.append(f"{key} {tuple(value.placements)}")
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(f"{key}.{k}" if key else str(k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{key}.{i}" if key else str(i), v)

    visit(prefix, state)
    return found


def _one_block(dtensor: Any) -> bool:
    """Whether this rank's shard of `dtensor` covers consecutive global indices in every dim:
    the global indices each placement leaves this rank, composed as torch composes them for
    DCP's offsets, compared with the block DCP assumes."""
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
        from torch.distributed.tensor.placement_types import Shard, _StridedShard
        mesh = dtensor.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return True
        sizes = list(dtensor.shape)
        indices: dict[int, Any] = {}
        for mesh_dim, placement in enumerate(dtensor.placements):
            if not isinstance(placement, (Shard, _StridedShard)):  # not a subclass of Shard in 2.13
                continue
            dim = placement.dim
            sizes[dim], indices[dim] = _get_shard_size_and_offsets(
                sizes[dim], mesh.size(mesh_dim), coordinate[mesh_dim], placement, indices.get(dim),
                dtensor.shape[dim], False)
    except Exception:  # noqa: BLE001 - torch internals moved: cannot tell, let DCP decide as before
        return True
    import torch
    for dim, index in indices.items():
        if sizes[dim] and index is not None:
            index = torch.as_tensor(index)
            first = int(index[0])
            if not torch.equal(index, torch.arange(first, first + sizes[dim], dtype=index.dtype)):
                return False
    return True

"""A rank's checkpoint files written by a process of its own.

Internal. A save's bulk CPU work is serialising the tensors (DCP's torch.save framing), hashing
them (SHA-256 for the manifest) and handing the bytes to fsspec (s3fs's signing and HTTP). Run on
a thread of the training process, that work shares the interpreter with the training loop: its
Python parts hold the GIL the loop needs between kernels. Here it runs in a child process per
rank instead (DCP's process-based async save makes the same move for the whole save). The
training process keeps what needs its process group or decides the commit: DCP's planning
collectives, the gather of the file records and the commit protocol (checkpointing._save), so
fencing, atomic commit and retention are unchanged.

What crosses: the host copies staging made, in shared memory (torch.multiprocessing moves a
tensor's storage there in place the first time it is sent; staging reuses its buffers, so later
saves send handles only), with the write items and DCP's serialisation settings. What comes back:
DCP's write results and the files' sizes and SHA-256s.

The child is started on the first save (spawned: a clean interpreter, not a fork of a process
that runs threads and a process group), ends within a second of its parent (a watch of the
parent's pid), and is killed when a save is cancelled: an abandoned save
stops writing at once, and the next save starts a fresh child.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from typing import Any, NamedTuple

from checkpointing.errors import SaveCancelledError, StorageError

POLL_S = 0.1   # how often a waiting save looks at its cancel flag and the child's liveness


class WriteProcess:
    """The child process one rank's saves write their files through (one save at a time)."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def write(self, storage_url: str, storage_options: dict, base: str, files: list, data: dict,
              transforms: Any, serialization_format: Any,
              cancel: threading.Event | None = None) -> tuple[list, dict[str, dict]]:
        """Write `files` ((path, storage key, write items) each, as DCP's writer plans them) with
        the resolved `data` of their items (by item index); (write results, {path relative to
        `base`: {size, sha256}}). Raises StorageError with what the child raised, or if it
        died; SaveCancelledError once `cancel` is set."""
        with self._lock:
            conn = self._start()
            conn.send((storage_url, storage_options, base, files, data, transforms, serialization_format))
            del data    # the child holds the shared buffers now; this frame drops its references
            while not conn.poll(POLL_S):
                if cancel is not None and cancel.is_set():
                    self._stop()
                    raise SaveCancelledError("save abandoned (CheckpointManager.abandon): the writer process "
                                             "was stopped")
                if not self._proc.is_alive():
                    code = self._proc.exitcode
                    self._stop()
                    raise StorageError(f"the checkpoint writer process died (exit code {code}) while writing "
                                       f"under {base}", url=storage_url)
            try:
                outcome = conn.recv()
            except EOFError:
                self._stop()
                raise StorageError(f"the checkpoint writer process closed its pipe while writing under {base}",
                                   url=storage_url) from None
        if isinstance(outcome, _Failed):
            raise StorageError(f"writing the checkpoint's files under {base} failed in the writer process: "
                               f"{outcome.kind}: {outcome.text}", url=storage_url)
        return outcome

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> Any:
        if self._proc is not None and self._proc.is_alive():
            return self._conn
        self._stop()
        import torch.multiprocessing as mp  # registers the reductions that share tensors
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        # Spawn re-imports the parent's main module in the child unless told it has none; a Ray
        # worker's is Ray's, which the child needs nothing of.
        main = sys.modules.get("__main__")
        saved = getattr(main, "__file__", None)
        try:
            if main is not None and saved is not None:
                del main.__file__
            proc = ctx.Process(target=_serve, args=(child, os.getpid()), daemon=True, name="ckpt-writer")
            proc.start()
        finally:
            if main is not None and saved is not None:
                main.__file__ = saved
        child.close()
        self._proc, self._conn = proc, parent
        return parent

    def _stop(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def resolve(planner: Any, items: list) -> dict:
    """The data of each write item, ready to cross to the child: tensors on the CPU with storages
    of their own size (as DCP's serial loader makes them), byte items as bytes."""
    from torch.distributed.checkpoint.planner import WriteItemType
    out: dict = {}
    for item in items:
        value = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            out[item.index] = value.getvalue()
            continue
        tensor = value.detach().cpu()
        if tensor.untyped_storage().size() != tensor.nbytes:
            tensor = tensor.clone()
        out[item.index] = tensor
    return out


class _Failed(NamedTuple):
    """What the child raised, as its class name and text."""

    kind: str
    text: str


class _Resolved:
    """DCP's planner, as far as its writer asks it: the data of each write item."""

    def __init__(self, data: dict) -> None:
        self._data = data

    def resolve_data(self, item: Any) -> Any:
        value = self._data[item.index]
        return io.BytesIO(value) if isinstance(value, bytes) else value


def _write(storage_url: str, storage_options: dict, base: str, files: list, data: dict, transforms: Any,
           serialization_format: Any) -> tuple[list, dict[str, dict]]:
    """In the child: DCP's own file writing (its framing, offsets and results), through the
    hashing filesystem the in-process writer uses."""
    import queue

    from torch.distributed.checkpoint.filesystem import _write_files_from_queue

    from checkpointing._dcp_io import _StorageFS
    from checkpointing.storage import Storage
    fs = _StorageFS(Storage(storage_url, storage_options), base)
    files_queue: queue.Queue = queue.Queue()
    for entry in files:
        files_queue.put(tuple(entry))
    results: queue.Queue = queue.Queue()
    _write_files_from_queue(create_stream=fs.create_stream, file_queue=files_queue, result_queue=results,
                            planner=_Resolved(data),  # type: ignore[arg-type]  # resolve_data is all it asks
                            transforms=transforms, inflight_threshhold=0,
                            use_fsync=False, thread_count=1, serialization_format=serialization_format)
    written: list = []
    while not results.empty():
        written += results.get_nowait()
    return written, dict(fs.written)


def _serve(conn: Any, parent_pid: int) -> None:
    """The child's loop: one write per message, until the pipe closes or the parent is gone."""
    _die_with_parent(parent_pid)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        try:
            outcome: Any = _write(*message)
        except BaseException as error:  # noqa: BLE001 - sent back: the saving rank raises it
            # As text: an exception's pickle keeps its positional arguments only, and this
            # package's errors take the URL as a keyword.
            outcome = _Failed(type(error).__name__, str(error))
        del message
        conn.send(outcome)


def _die_with_parent(parent_pid: int) -> None:
    """Exit within a second of the parent's death (a SIGKILLed worker leaves no writer behind).
    A watch of the parent's pid, not PR_SET_PDEATHSIG: that signal follows the parent's thread
    that started the child, and saves start it from their own short-lived threads."""
    if os.getppid() != parent_pid:
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

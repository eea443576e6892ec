"""Atomic, sharded, asynchronous checkpoints on any fsspec URL (file://, plain paths, s3://, memory://).

Public API:
    CheckpointManager          save / wait / close / load_latest / committed / latest /
                               committed_since / set_generation / gc
    CommitInfo, LoadResult     what a manifest says; what load_latest loaded (and skipped), with
                               the JSON `meta` saved alongside
    latest_committed(url)      newest committed checkpoint, from any process (no process group)
    read_fence(url)            current generation in <url>/checkpoints/FENCE, or None
    acquire_run_lease(url, run_id) -> RunLease
                               one run per storage URL (RunConflictError names the live holder)
    LeaseKeeper(lease)         renews a held lease on a thread of its own; lost() once it is not
    AppendLog, read_log        an append-only file (metrics.jsonl) that object stores do not
                               rewrite on every append
    export_model_state(url)    the model weights of a committed checkpoint, plain CPU tensors
    export(url, out)           the same, written as one file `torch.load(out, weights_only=True)` reads
    export_hf(url, out)        the same as a directory `from_pretrained(out)` reads (safetensors, config.json)
    ExportResult               what export wrote
    CheckpointError > StorageError, CorruptCheckpointError, SaveFailureLimitError,
                      SaveCancelledError, FencedError > RunConflictError

A checkpoint is `<url>/checkpoints/step_<step:08d>/` with a `COMMITTED` manifest written last,
by one writer, in one PUT. This package does not import the runtime (`elastic`).
"""

from checkpointing._export import ExportResult, export, export_model_state
from checkpointing._export_hf import HF_CONFIG, export_hf
from checkpointing.appendlog import AppendLog, read_log
from checkpointing.errors import (
    CheckpointError,
    CorruptCheckpointError,
    FencedError,
    RunConflictError,
    SaveCancelledError,
    SaveFailureLimitError,
    StorageError,
)
from checkpointing.lease import (
    DEFAULT_STALE_AFTER_S,
    LeaseKeeper,
    RunLease,
    acquire_run_lease,
    release_run_lease,
    renew_run_lease,
)
from checkpointing.manager import CheckpointManager
from checkpointing.manifest import CommitInfo, LoadResult, latest_committed
from checkpointing.manifest import read_fence as _read_fence
from checkpointing.storage import Storage


def read_fence(url: str, storage_options: dict | None = None) -> int | None:
    """The generation in `<url>/checkpoints/FENCE`, or None if no generation was set yet."""
    return _read_fence(Storage(url, storage_options))


__all__ = [
    "CheckpointManager",
    "CommitInfo",
    "LoadResult",
    "latest_committed",
    "read_fence",
    "export_model_state",
    "export",
    "export_hf",
    "HF_CONFIG",
    "ExportResult",
    "acquire_run_lease",
    "release_run_lease",
    "renew_run_lease",
    "LeaseKeeper",
    "RunLease",
    "DEFAULT_STALE_AFTER_S",
    "AppendLog",
    "read_log",
    "CheckpointError",
    "StorageError",
    "CorruptCheckpointError",
    "FencedError",
    "RunConflictError",
    "SaveFailureLimitError",
    "SaveCancelledError",
]

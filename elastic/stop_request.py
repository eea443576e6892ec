"""The stop request: `<storage>/STOP`, an operator's "commit a checkpoint and end" for a live run.

`elastic stop URL` writes it (`request_stop`). The run's controller looks for it (`read_stop`) and,
when it finds one, has every rank commit a checkpoint at the next step boundary (the path a
preemption notice takes) and ends the run with status "stopped": resumable like any other run,
by running it again with the same storage. `ElasticTrainer` removes a STOP left by an earlier run
(`clear_stop`) when it claims the storage, so a resume does not stop at once.

STOP is one small JSON object, written in one PUT (atomic on S3 as on a local disk):
`{"format": 1, "requested_at": <unix s>, "reason": "...", "host": "...", "run_id": ...}` (run_id:
the run status.json named when it was written, for the reader's information). Its presence is the
request: a STOP that is no JSON object (`touch <storage>/STOP` by hand) stops the run too.

No torch and no Ray here: the CLI imports it.
"""
from __future__ import annotations

import json
import socket
import time
from typing import Any

from checkpointing.storage import Storage

STOP_NAME = "STOP"
STOP_FORMAT = 1


def request_stop(url: str, options: dict | None = None, reason: str = "", *,
                 run_id: str | None = None) -> None:
    """Write `<url>/STOP`. A StorageError (unreachable store, credentials) passes up."""
    storage = Storage(url, options)
    doc = {"format": STOP_FORMAT, "requested_at": time.time(), "reason": reason, "host": socket.gethostname(),
           "run_id": run_id}
    storage.write_atomic(storage.path(STOP_NAME), json.dumps(doc).encode())


def read_stop(storage: Storage) -> dict[str, Any] | None:
    """The stop request under `storage`, or None when there is none. A STOP that is no JSON
    object is still a request (its presence is what counts): it reads as one with no details.
    A StorageError passes up (the caller decides how often to ask again)."""
    try:
        raw = storage.read_bytes(storage.path(STOP_NAME))
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return {"format": None, "requested_at": None, "reason": "(STOP is no JSON object: written by hand?)",
                "host": None, "run_id": None}
    return doc


def clear_stop(storage: Storage) -> None:
    """Remove the stop request, if any (a no-op without one)."""
    storage.rm(storage.path(STOP_NAME), recursive=False)

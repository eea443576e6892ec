"""The end of a run as the driver records it when the controller cannot.

The controller owns the run's record (status.json, summary.json: see _run_record). When its actor
dies (its process killed or out of memory, a bug in it) nobody else would write the end of the
run: status.json would say "running" for good and summary.json would be missing, or be a previous
attempt's. The driver then writes both, saying that the run failed and why, from what it can
still read on storage; unless the controller's own record is complete (it wrote its final
status.json after summary.json, during this fit(), and then died or its outcome could not be
fetched), which is kept as it is. Best effort: a storage that fails here is logged, never raised, since
`fit()` returns a failed Result rather than raising once the run has started.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from elastic._credentials import mask_text, mask_url
from elastic.errors import ElasticError, WorkerLostError

log = logging.getLogger("elastic.trainer")


def lost_controller_error(error: BaseException) -> ElasticError:
    """The typed error of a run whose controller's `run()` did not return: a dead actor is a
    WorkerLostError (infrastructure: re-running resumes), anything else an ElasticError."""
    from ray.exceptions import RayActorError
    text = mask_text(" ".join(str(error).split()))   # a wrapped storage error may name the URL
    if len(text) > 600:
        text = text[:600] + " ..."
    advice = "re-run with the same storage to resume from the last committed checkpoint"
    if isinstance(error, RayActorError):
        return WorkerLostError(f"the run's controller actor died ({type(error).__name__}: {text}); its workers "
                               f"went with it; {advice}")
    return ElasticError(f"the run's controller failed ({type(error).__name__}: {text}); {advice}")


def record_lost_controller(url: str, storage_options: dict | None, *, error: ElasticError,
                           traceback: str | None, config: dict[str, Any], total_steps: int,
                           started_at: float) -> tuple[dict[str, Any], bool]:
    """Write status.json (state "failed", the error) and summary.json (status "failed", the
    error, what storage still tells: the last step status.json saw, the committed checkpoints).
    Returns (the summary, whether it is the controller's own: then nothing was written)."""
    from checkpointing.storage import Storage
    from elastic.schemas import dumps, strict
    shown = mask_url(url)
    error_doc: dict[str, Any] = {"type": type(error).__name__, "message": mask_text(str(error)),
                                 "traceback": None if traceback is None else mask_text(traceback), "ranks": []}
    status: dict[str, Any] = {}
    storage = None
    try:
        storage = Storage(url, storage_options)
        status = json.loads(storage.read_bytes(storage.path("status.json")))
    except Exception:   # what cannot be read is left out
        log.debug("could not read the last status.json under %s", shown, exc_info=True)
    if storage is not None and status.get("state") in ("finished", "failed") \
            and float(status.get("updated_at") or 0) >= started_at:
        try:
            own = json.loads(storage.read_bytes(storage.path("summary.json")))
            log.warning("the controller recorded the end of the run before it was lost: its summary.json "
                        "is kept (status %s)", own.get("status"))
            return own, True
        except Exception:   # then the driver writes it
            log.debug("could not read the controller's summary.json under %s", shown, exc_info=True)
    checkpoints: list[int] = []
    try:
        from checkpointing import manifest
        if storage is not None:
            checkpoints = sorted(info.step for info in manifest.list_committed(storage))
    except Exception:
        log.debug("could not list the committed checkpoints under %s", shown, exc_info=True)
    step = status["step"] if isinstance(status.get("step"), int) else 0
    from elastic.schemas import status_doc, summary_doc
    summary = summary_doc(status="failed", final_step=step, total_steps=total_steps, checkpoints=checkpoints,
                          wall_s=time.time() - started_at, config=config, error=error_doc)
    status = status_doc(**{**status, "state": "failed", "error": error_doc, "updated_at": time.time()})
    for name, payload in (("status.json", status), ("summary.json", summary)):
        try:
            if storage is None:
                raise ElasticError(f"storage {shown!r} could not be opened")
            storage.write_atomic(storage.path(name), dumps(payload, indent=1).encode())
        except Exception:   # the Result still says it all
            log.exception("could not write %s under %s after the controller was lost", name, shown)
    return strict(summary), False

"""The run files that other tools parse, by format version, and a JSON Schema for each.

status.json, summary.json and every line of metrics.jsonl carry `format` (an int), as a
checkpoint's COMMITTED does. Within one format a file may gain keys (readers ignore the ones they
do not know, and the schemas allow them); a key that is removed, renamed or changes meaning
raises the format, and the schema of the new format ships beside the old one.

The schemas (JSON Schema 2020-12) ship in this package: `elastic/schemas/<file>.schema.json`,
read with `load_schema("status.json")`. They check the shape of a file and the vocabulary of its
enumerated fields (states, statuses, causes, rungs); `jsonschema` validates against them (the
tests do it on the files of real runs), but nothing here imports it.

This module also owns the files' shape as the run writes them: `status_doc` and `summary_doc`
build every status.json and summary.json (the driver's, the controller's, the lost controller's),
and `dumps` writes strict JSON (a non-finite number as null).
"""
from __future__ import annotations

import json
import math
import time
from importlib import resources
from typing import Any

STATUS_FORMAT = 1
SUMMARY_FORMAT = 1
METRICS_FORMAT = 1

SCHEMA_FILES = {"status.json": "status.schema.json", "summary.json": "summary.schema.json",
                "metrics.jsonl": "metrics.schema.json"}


def load_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of run file `name` ("status.json", "summary.json", or "metrics.jsonl",
    whose schema is that of one line)."""
    try:
        filename = SCHEMA_FILES[name]
    except KeyError:
        raise ValueError(f"no schema for {name!r}; the schemas: {', '.join(SCHEMA_FILES)}") from None
    return json.loads(resources.files(__name__).joinpath(filename).read_text())


def strict(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN nor Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(payload: Any, **kwargs: Any) -> str:
    """Strict JSON of `payload` (non-finite floats as null): what every reader's parser accepts."""
    return json.dumps(strict(payload), allow_nan=False, **kwargs)


def status_doc(state: str, **fields: Any) -> dict[str, Any]:
    """A status.json: its format, the run's state, what the writer knows now (generation, step,
    workers, run_id, ...), and when it was written (`updated_at`, unless given)."""
    return {"format": STATUS_FORMAT, "state": state, **fields, "updated_at": fields.get("updated_at", time.time())}


def summary_doc(*, status: str, final_step: int, total_steps: int, config: dict[str, Any] | None,
                error: dict[str, Any] | None, wall_s: float, checkpoints: list[int] | None = None,
                world_size_history: list | None = None, layout_history: list | None = None,
                recoveries: list | None = None,
                loss_first: float | None = None, loss_last: float | None = None, model_sha256: str | None = None,
                time_ledger: dict[str, float] | None = None, metrics: dict[str, Any] | None = None,
                goodput: float | None = None, resumed_from: int | None = None, stragglers: list | None = None,
                checkpoint_fallbacks: list | None = None, samples_consumed: int | None = None,
                data_order_sha256: str | None = None,
                controller_restarts: list | None = None, invocations: list | None = None) -> dict[str, Any]:
    """A summary.json, every key in its place (what the run did not get to know is null or
    empty): the controller's at a run's end, the driver's when the controller was lost."""
    doc: dict[str, Any] = {
        "format": SUMMARY_FORMAT, "status": status, "final_step": final_step, "total_steps": total_steps,
        "world_size_history": world_size_history or [], "layout_history": layout_history or [],
        "recoveries": recoveries or [],
        "checkpoints": checkpoints or [], "loss_first": loss_first, "loss_last": loss_last,
        "model_sha256": model_sha256, "wall_s": round(wall_s, 3)}
    if time_ledger is not None:
        doc["time_ledger"] = time_ledger
    doc.update({"metrics": metrics or {}, "goodput": goodput, "resumed_from": resumed_from,
                "stragglers": stragglers or [], "checkpoint_fallbacks": checkpoint_fallbacks or [],
                "samples_consumed": samples_consumed, "data_order_sha256": data_order_sha256,
                "controller_restarts": controller_restarts or [], "invocations": invocations or [],
                "config": config, "error": error})
    return doc

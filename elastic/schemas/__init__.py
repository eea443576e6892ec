"""The run files that other tools parse, by format version, and a JSON Schema for each.

status.json, summary.json and every line of metrics.jsonl carry `format` (an int), as a
checkpoint's COMMITTED does. Within one format a file may gain keys (readers ignore the ones they
do not know, and the schemas allow them); a key that is removed, renamed or changes meaning
raises the format, and the schema of the new format ships beside the old one.

The schemas (JSON Schema 2020-12) ship in this package: `elastic/schemas/<file>.schema.json`,
read with `load_schema("status.json")`. They check the shape of a file and the vocabulary of its
enumerated fields (states, statuses, causes, rungs); `jsonschema` validates against them (the
tests do it on the files of real runs), but nothing here imports it.
"""
from __future__ import annotations

import json
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

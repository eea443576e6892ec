"""Validate a run's files against the JSON Schemas that ship in elastic/schemas (tests only:
jsonschema is a test dependency). Used by the unit tests of the writers and by the integration
test of a run with a recovery."""
from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator

from checkpointing.appendlog import read_log
from checkpointing.storage import Storage
from elastic.schemas import load_schema


def validate(name: str, doc: Any) -> None:
    """Raise jsonschema.ValidationError (every error listed) when `doc` does not fit `name`'s schema."""
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    errors = sorted(Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        from jsonschema import ValidationError
        raise ValidationError(f"{name} does not fit its schema:\n" + "\n".join(
            f"  at {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors))


def check_time_ledger(summary: dict) -> None:
    """Every second of the run in one part of its time ledger: the parts sum to `wall_s` within
    2 % (a run's summary.json; every integration run that validates its files checks it)."""
    ledger, wall_s = summary.get("time_ledger"), summary["wall_s"]
    assert ledger is not None, "summary.json has no time_ledger"
    total = sum(ledger.values())
    assert abs(total - wall_s) <= 0.02 * wall_s + 0.01, \
        f"time_ledger sums to {total:.3f}s, wall_s is {wall_s}s: {ledger}"
    for recovery in summary["recoveries"]:
        assert "time_ledger" in recovery, f"a recovery without its time_ledger: {recovery}"


def validate_run(url: str, options: dict | None = None) -> dict[str, int]:
    """Validate status.json, summary.json and every line of metrics.jsonl under `url`; returns how
    many documents of each were checked (so a caller can assert that the files were there)."""
    storage = Storage(url, options)
    checked = {}
    for name in ("status.json", "summary.json"):
        doc = json.loads(storage.read_bytes(storage.path(name)))
        validate(name, doc)
        checked[name] = 1
        if name == "summary.json":
            check_time_ledger(doc)
    lines = read_log(storage, storage.path("metrics.jsonl")).decode().splitlines()
    for line in lines:
        validate("metrics.jsonl", json.loads(line))
    checked["metrics.jsonl"] = len(lines)
    return checked

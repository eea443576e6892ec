"""The history of a chaos run: every operation of the nemesis and every observation, in order.

As in Jepsen, invariants are checked against this record (plus the run's own summary), not
against live state. Each event is a flat JSON object with `t` (unix seconds) and `type`; it is
appended to `history.jsonl` as it happens, so a runner that dies still leaves its history.

Event types:
  job_start / job_exit    an attempt of the job (with its command line / exit code)
  running                 the run reached `running` for the first time in an attempt
  invoke / heal           a fault was injected / healed (`index`, `fault`, `detail`, run state)
  skip                    a scheduled fault was not injected (`reason`: run ended, unsupported...)
  commits                 the committed checkpoints changed (`steps`, `generations`, `newest`, and
                          `rejected`: [step, generation] of manifests the fence history rejects)
  cluster                 a namespaced cluster started (`id`, `description`, `heal`: the command
                          that removes what it leaves if the runner is killed)
  fence                   FENCE changed (`generation`, `run_id`, `history`: [generation, start
                          step, run id] per generation)
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from typing import Any


class History:
    def __init__(self, path: str | None = None, events: Iterable[dict] = ()):
        self.path = path
        self.events: list[dict[str, Any]] = list(events)
        self._lock = threading.Lock()   # the storage watcher appends from its own thread
        self._file = open(path, "a") if path else None

    def record(self, type_: str, **fields: Any) -> dict:
        event = {"t": round(time.time(), 3), "type": type_, **fields}
        with self._lock:
            self.events.append(event)
            if self._file is not None:
                self._file.write(json.dumps(event, default=str) + "\n")
                self._file.flush()
        return event

    def of_type(self, *types: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e["type"] in types]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @classmethod
    def load(cls, path: str) -> History:
        with open(path) as f:
            return cls(None, [json.loads(line) for line in f if line.strip()])

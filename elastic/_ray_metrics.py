"""The run's metrics through Ray's own metrics (`ray.util.metrics`), so they appear on Ray's
Prometheus endpoint next to Ray's, tagged with the run's storage URL.

Controller side: `RayMetricsListener` listens to the run record (a `RunListener` of
elastic._controller.run_record, called on the controller's thread) and exports what it is told (world size,
step rate, steps, recoveries by cause, recovery seconds, and the run's time ledger: seconds per
part of the wall time, a gauge tagged `part`). Worker side: rank 0 calls
`checkpoint_committed` when it learns of a commit (checkpoint seconds and bytes). Metric names
start with `elastic_`; Prometheus adds Ray's `ray_` prefix.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic._protocol import StepRecord

RECOVERY_BUCKETS_S = [0.5, 1, 2, 5, 10, 30, 60, 120, 300]
CHECKPOINT_BUCKETS_S = [0.1, 0.5, 1, 2, 5, 10, 30, 60, 300]


@functools.cache
def _metrics() -> dict[str, Any]:
    """Created once per process (Ray registers metrics by name)."""
    from ray.util.metrics import Counter, Gauge, Histogram
    tags = ("run",)
    return {
        "world_size": Gauge("elastic_world_size", "Ranks in the current generation", tags),
        "step_rate": Gauge("elastic_steps_per_second", "Completed steps per second (smoothed)", tags),
        "steps": Counter("elastic_steps", "Completed (kept or later redone) steps", tags),
        "recoveries": Counter("elastic_recoveries", "Recoveries, by cause", ("run", "cause")),
        "recovery_s": Histogram("elastic_recovery_seconds", "Seconds from detection to the next completed step",
                                RECOVERY_BUCKETS_S, ("run", "cause")),
        "checkpoint_s": Histogram("elastic_checkpoint_seconds", "Seconds from save to commit",
                                  CHECKPOINT_BUCKETS_S, tags),
        "checkpoint_bytes": Counter("elastic_checkpoint_bytes", "Bytes of committed checkpoints", tags),
        "time_ledger": Gauge("elastic_time_ledger_seconds",
                             "Seconds of the run's wall time so far, by part (productive, redone, detection, "
                             "reform, restore, checkpoint_stall, startup, waiting)", ("run", "part")),
    }


class RayMetricsListener:
    """Exports the run record's steps and recoveries as Ray metrics."""

    def __init__(self, run: str, metrics: dict[str, Any] | None = None):
        self._tags = {"run": run}
        self._metrics = metrics if metrics is not None else _metrics()
        self._last_time: float | None = None
        self._rate = 0.0            # steps per second, smoothed

    def on_step(self, record: StepRecord) -> None:
        m = self._metrics
        m["steps"].inc(1, tags=self._tags)
        m["world_size"].set(record.world_size, tags=self._tags)
        if self._last_time is not None and record.time > self._last_time:
            rate = 1.0 / (record.time - self._last_time)
            self._rate = rate if self._rate == 0 else 0.9 * self._rate + 0.1 * rate
            m["step_rate"].set(self._rate, tags=self._tags)
        self._last_time = record.time

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        tags = {**self._tags, "cause": recovery["cause"]}
        self._metrics["recoveries"].inc(1, tags=tags)
        self._metrics["recovery_s"].observe(recovery["recover_s"], tags=tags)

    def on_time_ledger(self, parts: dict[str, float]) -> None:
        for part, seconds in parts.items():
            self._metrics["time_ledger"].set(seconds, tags={**self._tags, "part": part})


def checkpoint_committed(run: str, seconds: float, nbytes: int) -> None:
    m = _metrics()
    m["checkpoint_s"].observe(max(0.0, seconds), tags={"run": run})
    if nbytes > 0:      # a Ray counter refuses increments <= 0
        m["checkpoint_bytes"].inc(nbytes, tags={"run": run})

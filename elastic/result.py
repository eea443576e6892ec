"""What `ElasticTrainer.fit()` returns: the run's outcome (`Result`) and its metrics (`RunMetrics`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunMetrics:
    """The loop's metrics over the kept steps (a step lost in a failure and redone counts once,
    with its redone value; a resumed run's include the steps before the resume, read back from
    metrics.jsonl): `loss`, `lr` (when the loop prepared an optimizer) and every metric it passed
    to `ctx.report` (rank mean) or `ctx.log`. A non-finite value is a float here (NaN for one read
    back as null).

    `last`: name -> the value at the newest step that has one (summary.json's `metrics`).
    `history`: name -> `[[step, value], ...]` in step order.
    """

    last: dict[str, float] = field(default_factory=dict)
    history: dict[str, list[list]] = field(default_factory=dict)


@dataclass
class Result:
    """Outcome of `ElasticTrainer.fit()`."""

    status: str                          # "finished" | "failed" | "stopped" (elastic stop) | "stopped_early"
    final_step: int
    storage: str
    summary: dict[str, Any] = field(default_factory=dict)   # summary.json as written (strict JSON values)
    error: BaseException | None = None   # the user's exception (original type) or a typed ElasticError
    error_traceback: str | None = None
    metrics: RunMetrics = field(default_factory=RunMetrics)
    checkpoint: str | None = None        # URL of the newest committed checkpoint, <storage>/checkpoints/step_<step:08d>

    @property
    def ok(self) -> bool:
        """The run finished, or stopped on request (`elastic stop`, SIGTERM to the driver: `ray
        job stop`) with its step committed, resumable: both are what was asked for. A run
        that failed, or whose loop returned before total_steps ("stopped_early"), is not ok."""
        return self.status in ("finished", "stopped")

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise self.error


def newest_checkpoint(storage: str, committed: list[int] | None) -> str | None:
    """The URL of the newest committed checkpoint, or None."""
    from elastic._controller.run_record import checkpoint_url
    return checkpoint_url(storage, max(committed)) if committed else None

"""When the first generation may start: enough workers placed, and no more worth waiting for.

`StartGate` judges the placement while the run is SCHEDULING: start once `max_workers` are
ready, or once `min_workers` are and the placement has settled (nothing pending; with no
maximum, the ready count held PROBE_GRACE_S with at most the probe placement pending) or the
wait is over: ScalingConfig.startup_wait_s for placements still pending, the longer of it and
starting_wait_s while a placed worker is starting (it is coming: waiting for the rest of its
start costs less than a re-form after the first step). Give up (too few) after
rendezvous_timeout_s.
"""
from __future__ import annotations

import enum

from elastic.config import FailureConfig, ScalingConfig
from elastic.errors import InsufficientWorkersError

PROBE_GRACE_S = 2.0      # no maximum: start once the ready count held this long (the cluster is full)


class Gate(enum.Enum):
    WAIT = "wait"
    START = "start"
    TOO_FEW = "too_few"     # min_workers could not be placed in time


class StartGate:
    """Remembers since when the ready count holds (a placement settles when it stops moving)."""

    def __init__(self, scaling: ScalingConfig, rendezvous_timeout_s: float) -> None:
        self._scaling, self._rendezvous_timeout_s = scaling, rendezvous_timeout_s
        self._ready_count = 0
        self._ready_since = 0.0

    def judge(self, *, ready: int, pending: int, waited_s: float, now: float, starting: int = 0) -> Gate:
        """`pending`: slots not ready (placement pending or starting); `starting`: those of
        them placed, whose worker is starting."""
        scaling = self._scaling
        if ready != self._ready_count:
            self._ready_count, self._ready_since = ready, now
        maximum = scaling.max_workers
        # With no maximum, the probe placement stays pending once the cluster is full.
        settled = not pending if maximum is not None else (
            pending <= 1 and now - self._ready_since >= PROBE_GRACE_S)
        enough = ready >= scaling.min_workers
        wait_s = max(scaling.startup_wait_s, scaling.starting_wait_s) if starting else scaling.startup_wait_s
        if (maximum is not None and ready >= maximum) or (enough and (settled or waited_s >= wait_s)):
            return Gate.START
        if not enough and waited_s > self._rendezvous_timeout_s:
            return Gate.TOO_FEW
        return Gate.WAIT


def too_few_to_start(ready: int, scaling: ScalingConfig, failure: FailureConfig) -> InsufficientWorkersError:
    return InsufficientWorkersError(
        f"only {ready} of min_workers={scaling.min_workers} workers could be placed in "
        f"{failure.rendezvous_timeout_s:.0f}s; add resources, lower ScalingConfig.min_workers "
        f"or raise FailureConfig.rendezvous_timeout_s")

"""Pluggable policies: they look at what happened and return a decision; they never act.

The controller alone acts on decisions. Users may pass their own subclasses to ElasticTrainer.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from elastic.errors import ConfigError

log = logging.getLogger("elastic.policy")

class Cause(enum.StrEnum):
    """Why a recovery happened or a run failed, as recorded in summary.json (`cause`)."""

    WORKER_DIED = "worker_died"            # its process or actor died
    NODE_LOST = "node_lost"                # its node left the cluster
    HANG = "hang"                          # silent past the heartbeat timeout (incl. a cut link), or no step
    COLLECTIVE_ERROR = "collective_error"  # the process group broke with no lost peer
    STORAGE_ERROR = "storage_error"        # storage failed a save, a load or a controller call
    PREEMPTED = "preempted"                # a preemption notice (SIGTERM): left at a step boundary
    HARDWARE_ERROR = "hardware_error"      # a GPU failed (ECC, off the bus, Xid): its worker is replaced
    SDC = "sdc"                            # replicas' parameters disagreed (silent data corruption): rolled back
    STRAGGLER = "straggler"                # a slow rank evicted by the scaling policy (voluntary)
    SCALE_UP = "scale_up"                  # workers joined (voluntary)
    USER_ERROR = "user_error"              # the loop's own error: fails the run
    FATAL_ERROR = "fatal_error"            # fenced out, or checkpoint saves failing past their limit


# Causes counted against FailureConfig.max_failures (everything but the run's own errors).
INFRA_CAUSES = tuple(c for c in Cause if c not in (Cause.USER_ERROR, Cause.FATAL_ERROR))
USER_CAUSE = Cause.USER_ERROR
FATAL_CAUSE = Cause.FATAL_ERROR
HARDWARE_CAUSE = Cause.HARDWARE_ERROR
# A worker's error kind (elastic._worker.worker.classify_error) -> the cause it stands for.
CAUSE_OF_ERROR_KIND = {"user": Cause.USER_ERROR, "infra": Cause.STORAGE_ERROR, "fatal": Cause.FATAL_ERROR,
                       "comm": Cause.COLLECTIVE_ERROR, "hardware": Cause.HARDWARE_ERROR, "sdc": Cause.SDC}


@dataclass(frozen=True)
class Failure:
    """A failure observed by the controller, not yet acted on."""

    cause: Cause
    ranks: tuple[int, ...]     # ranks (in the failing generation) that were lost or raised
    message: str = ""
    # The worker's own error behind the failure, when a worker reported one: kept so that a run
    # that fails on it (or on too many of them) says what really went wrong.
    error_type: str | None = None
    error_message: str | None = None
    error_traceback: str | None = None
    step: int | None = None    # sdc: the step whose fingerprints (or spot check) disagreed
    since: int | None = None   # sdc: the run goes back to a state from before this step (default `step`)

    @property
    def is_user_error(self) -> bool:
        return self.cause == USER_CAUSE

    @property
    def is_infrastructure(self) -> bool:
        """Counted against FailureConfig.max_failures."""
        return self.cause not in (USER_CAUSE, FATAL_CAUSE)


FAILURE_ACTIONS = ("recover", "fail")


@dataclass(frozen=True)
class FailureDecision:
    action: str                # "recover" | "fail"
    reason: str

    def __post_init__(self) -> None:
        # Checked here, where a custom policy builds it: the controller reads any action but
        # "fail" as "recover", so a typo would silently retry.
        if self.action not in FAILURE_ACTIONS:
            raise ConfigError(f"FailureDecision.action must be one of {FAILURE_ACTIONS} (a FailurePolicy.decide "
                              f"retries with 'recover'), got {self.action!r}")
        if not isinstance(self.reason, str):
            raise ConfigError(f"FailureDecision.reason must be a str (it is logged and recorded), "
                              f"got {type(self.reason).__name__}")


@dataclass(frozen=True)
class ResizeDecision:
    target_world_size: int
    reason: str

    def __post_init__(self) -> None:
        size = self.target_world_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"ResizeDecision.target_world_size must be an int >= 1 (a ScalingPolicy returns "
                              f"None to keep the world size), got {size!r}")
        if not isinstance(self.reason, str):
            raise ConfigError(f"ResizeDecision.reason must be a str (it is logged and recorded), "
                              f"got {type(self.reason).__name__}")


class FailurePolicy:
    """Default: user-code errors and fatal errors fail fast; infrastructure failures are
    recovered until more than `max_failures` of them have happened."""

    def decide(self, failure: Failure, *, infra_failures_so_far: int, max_failures: int | None) -> FailureDecision:
        if failure.is_user_error:
            decision = FailureDecision("fail", f"user code raised on ranks {list(failure.ranks)}: not retried")
        elif not failure.is_infrastructure:
            decision = FailureDecision("fail", f"{failure.message}: not retryable")
        elif max_failures is not None and infra_failures_so_far >= max_failures:
            decision = FailureDecision(
                "fail", f"{infra_failures_so_far + 1} infrastructure failures exceed "
                        f"FailureConfig.max_failures={max_failures}")
        else:
            decision = FailureDecision("recover", f"{failure.cause} on ranks {list(failure.ranks)}: "
                                                  f"failure {infra_failures_so_far + 1} of "
                                                  f"{'unlimited' if max_failures is None else max_failures}")
        log.info("failure policy: %s (%s)", decision.action, decision.reason)
        return decision


class ScalingPolicy:
    """Default: run with as many workers as are available, up to `max_workers` (None: no
    limit); grow as soon as spare workers are ready."""

    def decide_resize(self, *, world_size: int, ready_spares: int, min_workers: int,
                      max_workers: int | None) -> ResizeDecision | None:
        target = world_size + ready_spares if max_workers is None else min(max_workers, world_size + ready_spares)
        if target > world_size:
            decision = ResizeDecision(target, f"{ready_spares} spare worker(s) ready: grow {world_size} -> {target}")
            log.info("scaling policy: %s", decision.reason)
            return decision
        return None

    def decide_eviction(self, *, rank: int, score: float, world_size: int,
                        min_workers: int) -> ResizeDecision | None:
        """A rank is flagged as a straggler (`score`: its compute time over the others').

        Default: evict it only when the group goes faster without it. With N ranks and one s
        times slower, a step takes s with it and 1 without it, but the N-1 others carry the
        work of N: the group is faster without it when s > N/(N-1). Never below min_workers.
        """
        if world_size - 1 < min_workers:
            log.info("scaling policy: keep straggler rank %d (score %.2f): %d workers is min_workers",
                     rank, score, world_size)
            return None
        breakeven = world_size / (world_size - 1)
        if score <= breakeven:
            log.info("scaling policy: keep straggler rank %d: score %.2f <= %d/%d, the group would not "
                     "go faster without it", rank, score, world_size, world_size - 1)
            return None
        decision = ResizeDecision(world_size - 1, f"rank {rank} is a straggler (score {score:.2f} > "
                                                  f"{world_size}/{world_size - 1}): evict it")
        log.info("scaling policy: %s", decision.reason)
        return decision

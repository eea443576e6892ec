"""Typed errors of the elastic runtime: one root, one subclass per failure domain.

Every error is a plain Exception subclass whose constructor takes the message and nothing it
needs besides (WorkerLostError's `lost` is a keyword with a default: pickling rebuilds an
exception from its message and restores its attributes), so it pickles across Ray actors
unchanged. Messages name the setting to change.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:     # only for the type: elastic.policies imports this module
    from elastic.policies import Cause


class ElasticError(Exception):
    """Root of every error raised by the elastic runtime."""


class ConfigError(ElasticError, ValueError):
    """A configuration value is invalid; the message names the field and what to change."""


class StorageConfigError(ConfigError):
    """The storage URL is not supported or cannot be reached."""


class WorkerLostError(ElasticError):
    """A worker died, hung, or was cut off (infrastructure failure, retried by the policy).

    `lost`: the ids of the workers the raiser saw fail, each with why, where it knows them (a
    call to some workers that failed on a few: the controller replaces those and cuts the
    others' group, which they may be joining already)."""

    def __init__(self, message: str, lost: Mapping[int, Cause] | None = None):
        super().__init__(message)
        self.lost: dict[int, Cause] = dict(lost or {})


class InsufficientWorkersError(ElasticError):
    """Fewer than `ScalingConfig.min_workers` workers could be placed in time."""


class TooManyFailuresError(ElasticError):
    """The failure budget is spent: more infrastructure failures than `FailureConfig.max_failures`
    allows over the run's life (this class), or one of the two rules below fired."""


class FailureRateError(TooManyFailuresError):
    """More than `FailureConfig.failure_rate_limit` infrastructure failures within
    `failure_rate_window_s`: the run fails faster than it can be kept going."""


class NoProgressError(TooManyFailuresError):
    """`FailureConfig.max_failures_without_progress` failures in a row came with no step kept
    past where the one before had reached: a crash loop, not a run meeting faults."""


class DatasetError(ElasticError):
    """A dataset cannot be used as given: no shards, a missing or corrupt shard, rows of another
    length than the model's; the message names the file and what to change."""


class StateError(ElasticError):
    """The loop's state handling breaks the contract: `ctx.restore()` was not called before the
    first `report()`, or the objects handed to it do not match the state being loaded."""


class RestoreRequiredError(StateError):
    """A generation reached `ctx.report()` without calling `ctx.restore()`: on a resume or a
    rescale it would silently retrain from step 0 on fresh weights."""


class NonFiniteLossError(ElasticError):
    """The loss (mean over ranks) of a step was NaN or infinite, with
    FailureConfig.on_nonfinite_loss="fail"; the message names the step. No checkpoint was
    committed from that step."""


class SilentCorruptionError(ElasticError):
    """The ranks that must hold bit-identical parameters after a step (the replicas of one
    shard) did not: silent data corruption (elastic._worker.fingerprint). Every rank of the group
    raises it at the same step boundary; the controller replaces the ranks named (`ranks`, by a
    strict majority of their replicas; `suspects` when there was none) and rolls the run back to
    a state from before `since`: `step` itself when the parameters disagreed at `step`; for the
    compute spot check (elastic._worker.spot_check), the step after the last check that passed.
    No checkpoint is ever committed from `since` or later."""

    def __init__(self, message: str, *, step: int, ranks: tuple[int, ...] = (), suspects: tuple[int, ...] = (),
                 since: int | None = None):
        super().__init__(message)
        self.step, self.ranks, self.suspects = step, tuple(ranks), tuple(suspects)
        self.since = step if since is None else since

    def __reduce__(self) -> tuple:
        return _silent_corruption, (str(self), self.step, self.ranks, self.suspects, self.since)


def _silent_corruption(message: str, step: int, ranks: tuple[int, ...], suspects: tuple[int, ...],
                       since: int | None = None) -> SilentCorruptionError:
    return SilentCorruptionError(message, step=step, ranks=ranks, suspects=suspects, since=since)


class UserCodeError(ElasticError):
    """The user's train_loop raised; carries the original type name and traceback.

    Used only when the original exception cannot be pickled; otherwise the original
    exception itself is returned in `Result.error`.
    """


# Checkpoint errors come from the checkpointing package (which may not import this one):
# CheckpointError > StorageError, CorruptCheckpointError, FencedError. Re-exported by `elastic`.

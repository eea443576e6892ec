"""Typed, picklable errors of the checkpointing package.

One root (`CheckpointError`) so callers can catch everything this package raises, one subclass
per failure domain. Errors cross process boundaries (Ray actors, multiprocessing), so each one
pickles with its message and its `url`; messages name the URL and the setting to change. A
message never shows a URL's password: the root masks every URL in it (`checkpointing.masking`),
wrapped backend errors' text included.
"""

from __future__ import annotations

from checkpointing.masking import mask_text


class CheckpointError(Exception):
    """Root of every error raised by `checkpointing`."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(mask_text(message))
        self.url = url

    def __reduce__(self):
        # Exception's default reduce passes only `args`; keep the keyword-only `url` too.
        return (_rebuild, (type(self), self.args[0] if self.args else "", self.url))


def _rebuild(cls: type, message: str, url: str | None) -> CheckpointError:
    return cls(message, url=url)


class StorageError(CheckpointError):
    """The storage backend refused or failed an operation (after the backend's own retries)."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint does not match its manifest (size or checksum), or no committed
    checkpoint verifies."""


class FencedError(CheckpointError):
    """A save from an older generation than `<url>/checkpoints/FENCE` was refused, or a fence
    update lost its compare-and-swap: someone else advanced FENCE first."""


class RunConflictError(FencedError):
    """Another run holds `<url>` (FENCE names it and its lease is fresh), or took this run's
    storage over, or this run could not renew its lease in time (lease.LeaseKeeper). `owner` is
    the other run's id (None when the other run predates run ids, or no other run is known)."""

    def __init__(self, message: str, *, url: str | None = None, owner: str | None = None) -> None:
        super().__init__(message, url=url)
        self.owner = owner

    def __reduce__(self):
        return (_rebuild_conflict, (type(self), self.args[0] if self.args else "", self.url, self.owner))


def _rebuild_conflict(cls: type, message: str, url: str | None, owner: str | None) -> RunConflictError:
    return cls(message, url=url, owner=owner)


class SaveFailureLimitError(CheckpointError):
    """`max_consecutive_failures` saves in a row failed: the run must stop (fatal by design).

    Raised without a `__cause__` on purpose: a runtime that classifies errors by their cause
    chain (storage trouble = retry) must see this as final. The last failure is named in the
    message and kept, as text, in `last_cause`.
    """

    def __init__(self, message: str, *, url: str | None = None, last_cause: str | None = None) -> None:
        super().__init__(message, url=url)
        self.last_cause = last_cause

    def __reduce__(self):
        return (_rebuild_limit, (type(self), self.args[0] if self.args else "", self.url, self.last_cause))


def _rebuild_limit(cls: type, message: str, url: str | None, last_cause: str | None) -> SaveFailureLimitError:
    return cls(message, url=url, last_cause=last_cause)


class SaveCancelledError(CheckpointError):
    """An abandoned save stopped writing (`CheckpointManager.abandon`); never committed."""

"""Typed, picklable errors of the checkpointing package.

One root (`CheckpointError`) so callers can catch everything this package raises, one subclass
per failure domain. Errors cross process boundaries (Ray actors, multiprocessing), so each one
pickles with its message and its `url`; messages name the URL and the setting to change.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error raised by `checkpointing`."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url

    def __reduce__(self):
        # Exception's default reduce passes only `args`; keep the keyword-only `url` too.
        return (_rebuild, (type(self), self.args[0] if self.args else "", self.url))


def _rebuild(cls: type, message: str, url: str | None) -> "CheckpointError":
    return cls(message, url=url)


class StorageError(CheckpointError):
    """The storage backend refused or failed an operation (after the backend's own retries)."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint does not match its manifest (size or checksum), or no committed
    checkpoint verifies."""


class FencedError(CheckpointError):
    """A save from an older generation than `<url>/checkpoints/FENCE` was refused."""

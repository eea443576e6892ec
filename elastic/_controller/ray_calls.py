"""What the worker group and the node agents share about Ray's calls: which references have
their answer, and a failed call's error in the words the group acts on and logs."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import ray
from ray import ObjectRef
from ray.exceptions import RayError, RayTaskError

from elastic._protocol import PollFailure

T = TypeVar("T")


def answered(items: list[T], ref_of: Callable[[T], ObjectRef | None]) -> tuple[list[tuple[T, ObjectRef]], list[T]]:
    """The items whose reference (`ref_of`; those without one are left out) has its answer now,
    each with it, and the items still waiting: one ray.wait that does not block."""
    waiting = [(item, ref) for item in items if (ref := ref_of(item)) is not None]
    if not waiting:
        return [], []
    ready = set(ray.wait([ref for _, ref in waiting], num_returns=len(waiting), timeout=0)[0])
    return [(item, ref) for item, ref in waiting if ref in ready], [item for item, ref in waiting if ref not in ready]


def poll_failure(error: RayError) -> PollFailure:
    """A poll's error as the group acts on it: the poll itself raised (RayTaskError), or the
    worker's actor is gone (any other RayError)."""
    if isinstance(error, RayTaskError):
        return PollFailure(actor_gone=False, message=first_line(error))
    return PollFailure(actor_gone=True, message=error_line(error))


def error_line(error: BaseException) -> str:
    """The first line of Ray's error (its type's name if it has no message)."""
    return (str(error).splitlines() or [type(error).__name__])[0]


def first_line(error: BaseException) -> str:
    """The exception's own message: a RayTaskError's first lines are Ray's traceback header."""
    cause = getattr(error, "cause", None)
    shown = cause if isinstance(cause, BaseException) else error
    text = f"{type(shown).__name__}: {shown}"
    return (text.splitlines() or [type(error).__name__])[0]

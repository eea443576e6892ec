"""A rank's own compute time per step, without the time it waits for its peers.

Straggler scoring (elastic._controller.stragglers) needs what this rank costs the group, and step time
cannot tell: in synchronous training every rank's step takes as long as the slowest rank's.

With DDP the gradient all-reduce of a bucket is launched by a communication hook the moment
the bucket's gradients are ready on this rank; the last launch is the end of this rank's
backward. Waiting happens after that (in the reducer's final wait), so compute time is the time
from the previous step boundary to the last launch: data, forward and backward, all local.
Compression hooks (bf16, PowerSGD; elastic._worker.wrap) run inside the timed hook, after its stamp:
their collectives never count as compute; the compression arithmetic of the buckets launched
before the last one does (it runs on the training thread between stamps), alike on every rank.
Without a hook (FSDP, or a model that is not wrapped) it falls back to the time until the rank
enters the step-boundary collective; for FSDP that includes waits in its all-gathers, which
evens the ranks out: a slow FSDP rank goes unflagged rather than a healthy one flagged.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class StepTimer:
    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._compute_done: float | None = None

    def start(self) -> None:
        """At a step boundary, after the collective that ends the previous step."""
        self._start = time.perf_counter()
        self._compute_done = None

    def mark_compute_done(self) -> None:
        self._compute_done = time.perf_counter()

    def compute_s(self) -> float:
        end = self._compute_done if self._compute_done is not None else time.perf_counter()
        return max(0.0, end - self._start)


def timed_comm_hook(timer: StepTimer, hook: Callable[[Any, dist.GradBucket], Any] | None = None):
    """A DDP communication hook that stamps the launch of each bucket, then runs `hook`
    (default: DDP's own all-reduce, averaged over the world size)."""
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        hook = allreduce_hook

    # No annotations: DDP checks them against dist.GradBucket, and postponed evaluation
    # (from __future__ import annotations) turns them into strings it rejects.
    def timed(state, bucket):
        timer.mark_compute_done()
        return hook(state, bucket)

    return timed

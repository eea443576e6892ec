"""The group's exchange of one step's values, posted at the step's end.

Each rank's report() posts one all-gather of a fixed-size vector (loss, stop flag, preemption
flag, compute seconds, hash of the metric names, metric slots). Where its values are read depends
on where they live (`PendingExchange.read_later`):

- CPU (gloo): the all-gather completes within the report that posts it (a few hundred bytes,
  ~1.6 ms of a step on the small model, BENCHMARKS O1). Left pending into the next step, it was
  an unfinished collective on gloo's threads when a peer died, and the survivors' teardown of the
  generation hung on it under load (9a4fd0a). Why: `~ProcessGroupGloo` waits for its work queue
  to drain, and it runs wherever the group's last reference drops; with an all-gather pending on
  a live peer that never posts it, `destroy_process_group()` (and `_abort_process_group()`, which
  does not abort gloo work) blocked the full collective timeout in a 3-process probe, and
  returned at once while a reference to the group was still held elsewhere. Reading the exchange
  a step later on CPUs needs that: broken groups kept referenced until their work completes.
- GPU (NCCL): the vector is assembled on the device (the loss and tensor metrics are never read
  on the host at their step), all-gathered on the group's stream like DDP's all-reduces, and
  copied to pinned host memory with a non-blocking copy behind an event. The host never waits for
  the device at the step: the boundary reads the values when the next step ends, after queueing
  that step's kernels (a wait there, for a device still busy with the step before, holds the host
  at most one step ahead of the device, which keeps the device's queue full). A broken group's
  pending NCCL work is aborted with its communicator, like DDP's.

A pending exchange is resolved exactly once: `collect()` (the group's values) or `own_values()`
(this rank's, when the group broke before the exchange completed).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class PendingExchange:
    """One step's all-gather in flight, with this rank's own vector for a fallback."""

    def __init__(self, mine: torch.Tensor, world_size: int):
        self._mine = mine
        self._gathered = [torch.empty_like(mine) for _ in range(world_size)]
        # On gloo: done when wait() returns. On NCCL: the current stream waits for the collective,
        # which orders the copy below after it; the host does not wait.
        dist.all_gather(self._gathered, mine, async_op=True).wait()
        self.read_later = mine.is_cuda   # the boundary reads it at the next step (see the module docstring)
        self._host: torch.Tensor | None = None
        self._event: Any = None
        if mine.is_cuda:
            self._host = torch.empty((world_size, mine.numel()), dtype=mine.dtype, pin_memory=True)
            self._host.copy_(torch.stack(self._gathered), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def collect(self) -> torch.Tensor:
        """Every rank's vector, one row per rank, on the host (raises if the group broke)."""
        if self._event is not None:
            self._event.synchronize()
            assert self._host is not None
            return self._host
        return torch.stack(self._gathered)

    def completed(self) -> bool:
        """Whether `collect()` would return at once (GPU: the copy may still be in flight)."""
        return self._event.query() if self._event is not None else True

    def own_values(self) -> torch.Tensor:
        """This rank's vector alone, as a one-row table, on the host (its values never needed the
        group; on a GPU this reads the device, which only a failure path does)."""
        return self._mine.cpu().unsqueeze(0)


def post(host_values: list[float], device_values: dict[int, torch.Tensor], *, device: torch.device,
         world_size: int) -> PendingExchange:
    """Start the all-gather of one step's vector: `host_values` (numbers known on the host) with
    the slots in `device_values` replaced by those tensors' values, copied on their device."""
    host = torch.tensor(host_values, dtype=torch.float64)
    if device.type == "cpu":
        for slot, value in device_values.items():
            host[slot] = value.detach().to(torch.float64).reshape(())
        return PendingExchange(host, world_size)
    # From pinned memory (the caching host allocator's): a copy the host does not wait for.
    mine = host.pin_memory().to(device, non_blocking=True)
    for slot, value in device_values.items():
        mine[slot] = value.detach().to(device=device, dtype=torch.float64).reshape(())
    return PendingExchange(mine, world_size)

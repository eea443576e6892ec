"""The group's exchange of one step's values, posted at the step's end and read a step later.

Each rank's report() posts one all-gather of a fixed-size vector (loss, stop flag, preemption
flag, compute seconds, hash of the metric names, metric slots) and goes on training; the result
is read when the next step ends (or sooner where the caller needs it: see StepBoundary). Nothing
on the step's critical path waits for a peer or, on a GPU, for the device:

- CPU (gloo): an asynchronous all-gather on the default group; by the next report it has long
  completed on gloo's own threads, and `wait()` only collects it. Every rank posts its exchanges
  at the same points of its loop (after the step's backward, before the next forward), so the
  group's collectives are issued in one order on every rank, as gloo requires.
- GPU (NCCL): the vector is assembled on the device (the loss and tensor metrics are never read
  on the host at their step), all-gathered asynchronously, and copied to pinned host memory with
  a non-blocking copy behind an event. Reading it a step later waits for that event only: the
  device has long finished the previous step's work by then.

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
        self._work = dist.all_gather(self._gathered, mine, async_op=True)
        self._host: torch.Tensor | None = None
        self._event: Any = None
        if mine.is_cuda:
            # Orders the copy after the collective on the device; the host does not wait here.
            self._work.wait()
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
        self._work.wait()
        return torch.stack(self._gathered)

    def completed(self) -> bool:
        """Whether `collect()` would return at once (GPU: the copy may still be in flight)."""
        return self._event.query() if self._event is not None else self._work.is_completed()

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
    mine = host.to(device, non_blocking=True)
    for slot, value in device_values.items():
        mine[slot] = value.detach().to(device=device, dtype=torch.float64).reshape(())
    return PendingExchange(mine, world_size)

"""The group's exchange of one step's values, posted at the step's end, read at the next.

Each rank's report() posts one all-gather, into one tensor, of a fixed-size vector (loss, stop
flag, preemption flag, compute seconds, hash of the metric names, metric slots). The boundary
reads it when the next step ends (elastic._worker.step_boundary), so no step waits for the
others at its own end:

- CPU (gloo): the all-gather runs on gloo's threads while the next step computes.
- GPU (NCCL): the vector is assembled on the device (the loss and tensor metrics are never read
  on the host at their step), all-gathered on the group's stream like DDP's all-reduces, and
  copied to pinned host memory with a non-blocking copy, ordered after the all-gather
  (`work.wait()` on the device, not the host) and followed by an event. The host never waits
  for the device at the step: a wait at the next step's end, for a device still busy with the
  step before, holds the host at most one step ahead of the device, which keeps its queue full.
  A broken group's pending NCCL work is aborted with its communicator, like DDP's.

A gloo exchange still pending when its generation ends must not take the generation's teardown
down with it: `~ProcessGroupGloo` waits for its work queue to drain, and it runs wherever the
group's last reference drops. With an all-gather pending on a live peer that never posts it,
dropping the group blocked that thread for the whole collective timeout (a 3-process probe: 14.6
s of 15; the GIL is released meanwhile, so it was the training thread's next generation that
waited, and in 9a4fd0a's CI its peers' store timed out). So a pending gloo exchange that is let
go (the group broke, the loop failed) hands its work and a reference to its group to `_GRAVEYARD`,
whose thread drops them once the work has completed: failed by the cut of the group's
connections (elastic._worker.group_sockets: 0.03 s in the probe) or by the collective timeout.
The teardown then never waits on gloo's queue, on any thread that matters.

A pending exchange is resolved exactly once: `collect()` (the group's values) or `own_values()`
(this rank's, when the group broke before the exchange completed).
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist


class _Graveyard:
    """Gloo groups whose exchange was let go while still pending, each kept referenced until
    that work completes; then dropped on this thread, where ~ProcessGroupGloo finds its queue
    drained (see the module docstring).

    The process's exit waits for a drop in flight (`at_exit`, registered with atexit): torch runs
    ~ProcessGroupGloo with the GIL released, and a daemon thread that asks for the GIL back once
    the interpreter is finalizing is ended by pthread_exit, whose unwinding through that noexcept
    destructor calls std::terminate. A probe dropping a gloo group on a daemon thread as the
    process exited aborted 30 times of 30 ("terminate called without an active exception", exit
    code 134), as one rank of stop 24's CI did. After `at_exit` nothing more is dropped: what is
    still kept then goes with the process."""

    POLL_S = 0.1
    EXIT_WAIT_S = 5.0

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._kept: list[tuple[Any, Any]] = []      # (work, group)
        self._dropping = 0                          # completed, their references being dropped
        self._exiting = False
        self._reaper: threading.Thread | None = None

    def keep_if_pending(self, work: Any, group: Any) -> None:
        if work.is_completed():
            return
        with self._lock:
            self._kept.append((work, group))
            if self._reaper is None and not self._exiting:
                self._reaper = threading.Thread(target=self._reap, name="elastic-exchange-graveyard", daemon=True)
                self._reaper.start()

    def pending(self) -> int:
        """Groups still referenced here: kept, or being dropped."""
        with self._lock:
            return len(self._kept) + self._dropping

    def at_exit(self) -> None:
        """Wait (up to EXIT_WAIT_S) for a drop in flight, and start no other."""
        with self._lock:
            self._exiting = True
            self._lock.wait_for(lambda: self._dropping == 0, timeout=self.EXIT_WAIT_S)

    def _reap(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            with self._lock:
                if self._exiting:
                    return
                # One look at each work: one completing between two looks would otherwise be
                # dropped from the list, and so possibly inside this lock.
                completed = [work.is_completed() for work, _ in self._kept]
                done = [kept for kept, ended in zip(self._kept, completed, strict=True) if ended]
                self._kept = [kept for kept, ended in zip(self._kept, completed, strict=True) if not ended]
                self._dropping += len(done)
                emptied = not self._kept
                if emptied:
                    self._reaper = None      # the next keep starts another
            dropped = len(done)
            del done        # the completed ones' last references drop here, outside the lock
            with self._lock:
                self._dropping -= dropped
                self._lock.notify_all()
            if emptied:
                return


_GRAVEYARD = _Graveyard()
atexit.register(_GRAVEYARD.at_exit)


# The one-tensor all-gather: torch 2.13 names it all_gather_single and deprecates
# all_gather_into_tensor, the only name before it (torch 2.11, in the CUDA images the GPU suite
# ran on). Same arguments and semantics.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class PendingExchange:
    """One step's all-gather in flight, with this rank's own vector for a fallback."""

    def __init__(self, mine: torch.Tensor, world_size: int):
        self._mine = mine
        # One (world size x slots) tensor, gathered into in place: a list of one tensor per rank
        # (dist.all_gather), stacked, cost every rank 23 ms a step at 10,000 ranks with rank 0's
        # read of the compute times, 0.33 ms now (benchmarks/step_overhead.py).
        self._gathered = torch.empty((world_size, mine.numel()), dtype=mine.dtype, device=mine.device)
        # On gloo the work runs on gloo's threads. On NCCL it runs on the group's own stream,
        # which waits for the current one (so for `mine`); an async_op's caller orders its own
        # stream after the collective with work.wait(), which does not block the host (unless
        # TORCH_NCCL_BLOCKING_WAIT). Without it the copy below read `_gathered` before the
        # all-gather wrote it: on an H100, with each step's compute still queued, a record's
        # metric was not the value reported (tests/gpu/test_gpu_steady_state.py).
        work = _all_gather_single(self._gathered.view(-1), mine, async_op=True)
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._work: Any = None
        if mine.is_cuda:
            work.wait()
            self._host = torch.empty((world_size, mine.numel()), dtype=mine.dtype, pin_memory=True)
            self._host.copy_(self._gathered, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._work = work
            # Whatever lets this exchange go, its group outlives the work (the module docstring):
            # the finalizer holds the group while this object lives, the graveyard after.
            weakref.finalize(self, _GRAVEYARD.keep_if_pending, work, dist.group.WORLD).atexit = False

    def collect(self) -> torch.Tensor:
        """Every rank's vector, one row per rank, on the host (raises if the group broke)."""
        if self._event is not None:
            self._event.synchronize()
            assert self._host is not None
            return self._host
        self._work.wait()
        return self._gathered

    def completed(self) -> bool:
        """Whether `collect()` would return at once (GPU: the copy may still be in flight)."""
        return bool(self._event.query() if self._event is not None else self._work.is_completed())

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

"""A rank's own compute time per step, without the time it waits for its peers.

Straggler scoring (elastic._controller.stragglers) needs what this rank costs the group, and step time
cannot tell: in synchronous training every rank's step takes as long as the slowest rank's.

With DDP, this rank's backward launches every bucket's all-reduce as the bucket's gradients are
ready; waiting for the peers happens after that, in the reducer's final callback (which waits for
the buckets' all-reduces). So compute time is the time from the previous step boundary to the end
of this rank's backward graph: data, forward and backward, all local. `stamp_end_of_backward`
takes that stamp with one Python call per backward, not one per bucket: a tensor hook on the
wrapped model's output (its gradient is the first thing backward computes) queues an engine
callback, and the engine runs its final callbacks in the order queued, so ours runs before the
reducer's own (queued when the last bucket is launched), that is before any wait for a peer.
Compression hooks (bf16, PowerSGD; elastic._worker.wrap) run during backward: the compression
arithmetic of every bucket counts as compute, alike on every rank; their collectives do not.
Without the stamp (FSDP, a model that is not wrapped, an output the loss does not use) it falls
back to the time until the rank enters the step boundary; for FSDP that includes waits in its
all-gathers, which evens the ranks out: a slow FSDP rank goes unflagged rather than a healthy one
flagged.

The timer also marks the training thread's place for hang detection
(elastic._worker.thread_position): a step's compute begins at `start`, and at the end of a
backward whose gradients DDP syncs the rank begins to wait for its peers (SYNC). A backward that
skips the sync (a non-final micro-batch of gradient accumulation) waits for no one: only its
compute is stamped.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from elastic._protocol import ThreadPlace
from elastic._worker import thread_position


class StepTimer:
    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._compute_done: float | None = None
        # Found now, on the training thread: the end of backward may be stamped from autograd's.
        self._position = thread_position.current()

    def start(self) -> None:
        """At a step boundary, once the previous step is closed."""
        self._start = time.perf_counter()
        self._compute_done = None
        if self._position is not None:
            self._position.mark(ThreadPlace.COMPUTING)

    def mark_compute_done(self) -> None:
        self._compute_done = time.perf_counter()

    def mark_sync(self) -> None:
        """This rank's backward ended and DDP now waits for the peers' gradients."""
        if self._position is not None:
            self._position.mark(ThreadPlace.SYNC)

    def compute_s(self) -> float:
        end = self._compute_done if self._compute_done is not None else time.perf_counter()
        return max(0.0, end - self._start)


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor in a module's output (tensor, sequence, mapping, dataclass-like) that
    backward will reach."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        output = list(output.values())
    elif hasattr(output, "to_tuple"):       # ModelOutput-like containers
        output = output.to_tuple()
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


def stamp_end_of_backward(model: nn.Module, timer: StepTimer) -> None:
    """Stamp `timer` when a backward through `model`'s output ends on this rank (see the module
    docstring): a forward hook, one tensor hook and one engine callback per step."""
    queue_callback = torch.autograd.Variable._execution_engine.queue_callback

    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            # DDP decides at forward whether this backward syncs (accumulation turns it off).
            syncs = bool(getattr(module, "require_backward_grad_sync", False))

            def on_output_grad(grad: torch.Tensor) -> torch.Tensor:
                queue_callback(timer.mark_compute_done)
                if syncs:
                    queue_callback(timer.mark_sync)
                return grad
            tensor.register_hook(on_output_grad)

    model.register_forward_hook(after_forward)

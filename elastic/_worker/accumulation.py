"""Gradient accumulation for LRScalingConfig(mode="constant_global_batch").

The global batch G = base_world_size x per-rank batch B stays fixed at every world size W: each
rank runs accum = base_world_size / W micro-batches of B samples per optimizer step. The user's
loop is unchanged (one `backward(); step(); zero_grad(); report()` per micro-batch); on a
non-final micro-step this module skips the gradient sync (DDP `require_backward_grad_sync`,
FSDP2 `set_requires_gradient_sync`), turns the prepared optimizer's step()/zero_grad() into
no-ops and makes `ctx.report` return early. On the final micro-step the accumulated, synced
gradients are divided by accum before the real step, so the update is the mean over the same G
samples as at base_world_size: global micro-batch k is positions [seen + kB, seen + (k+1)B) at
any W, only the order of the sums differs.
"""
from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from elastic.config import CONSTANT_GLOBAL_BATCH
from elastic.errors import ElasticError

if TYPE_CHECKING:
    import torch
    from torch import nn

_HOLDER = "_elastic_accumulation"     # the optimizer's attribute: [its Accumulation, its real zero_grad]


def new_accumulation(rule: Any, world_size: int) -> Accumulation | None:
    """The generation's accumulation state under `rule` (an LRScalingConfig), None unless it holds
    the global batch constant."""
    if rule is None or rule.mode != CONSTANT_GLOBAL_BATCH:
        return None
    return Accumulation(accumulation_steps(rule.base_world_size, world_size))


def as_float(value: Any) -> float | None:
    """A reported metric (tensor or number) as a float."""
    if value is None:
        return None
    return float(value.detach()) if hasattr(value, "detach") else float(value)   # a tensor, or a number


def accumulation_steps(base_world_size: int, world_size: int) -> int:
    """Micro-batches per rank per optimizer step at `world_size`."""
    if base_world_size % world_size:
        raise ElasticError(f"world size {world_size} does not divide LRScalingConfig.base_world_size="
                           f"{base_world_size}; the configuration check should have refused this")
    return base_world_size // world_size


def rank_positions(samples_seen: int, global_batch: int, world_size: int, rank: int) -> range:
    """Global sample positions rank `rank` reads in the step that starts after `samples_seen`."""
    share = global_batch // world_size
    start = samples_seen + rank * share
    return range(start, start + share)


class Accumulation:
    """One generation's micro-step state on one rank (accum = 1 means no accumulation)."""

    def __init__(self, steps: int = 1):
        self.steps = steps
        self.micro = 0                 # index of the micro-batch being processed in this step
        self._reported = 0             # micro-steps of this step whose report() was called
        self._loss_sum: float | torch.Tensor = 0.0   # a tensor loss stays on its device (no read per micro-batch)
        self.stepped = False           # the real optimizer step of this step has run
        self._clear_grads: list[Any] = []   # prepared optimizers' real zero_grad

    @property
    def final(self) -> bool:
        return self.micro == self.steps - 1

    def begin_micro(self, micro: int, model: nn.Module | None) -> None:
        """Before micro-batch `micro` is yielded: sync gradients only in its final backward."""
        self.micro = micro
        if micro == 0:
            self._reported, self._loss_sum, self.stepped = 0, 0.0, False
            if self.steps > 1:
                # Cleared here rather than by the user's zero_grad, so that both loop orders
                # (zero_grad after step, or before backward) accumulate exactly this step's grads.
                for clear in self._clear_grads:
                    clear(set_to_none=True)
        if self.steps > 1 and model is not None:
            set_gradient_sync(model, self.final)

    def reported(self) -> int:
        return self._reported

    def defer_report(self, loss: Any) -> bool:
        """report() on a micro-step (`loss`: as reported, a tensor, a number or None): True when it
        must return at once (not the final micro-step). A tensor is summed where it lives: on a
        GPU, reading it here would wait for the device at every micro-batch."""
        self._reported += 1
        if hasattr(loss, "detach"):
            self._loss_sum = loss.detach().reshape(()).double() + self._loss_sum
        elif loss is not None:
            self._loss_sum += float(loss)
        return not self.final

    def mean_loss(self) -> float | torch.Tensor:
        """Mean of this step's micro-batch losses (call after the final defer_report); a tensor
        when the losses were."""
        return self._loss_sum / self.steps

    def scale_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Synced gradients are sums over `steps` micro-batches: make them the mean."""
        if self.steps == 1:
            return
        import torch
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self.steps)


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """DDP's no_sync without a context manager (the sync decision is made per micro-batch)."""
    wrapped: Any = model        # the switches are the wrappers', not nn.Module's: looked up by name
    if hasattr(wrapped, "set_requires_gradient_sync"):          # FSDP2 fully_shard
        wrapped.set_requires_gradient_sync(sync)
    elif hasattr(wrapped, "require_backward_grad_sync"):        # DistributedDataParallel
        wrapped.require_backward_grad_sync = sync


def wrap_optimizer(optimizer: torch.optim.Optimizer, accumulation: Accumulation) -> None:
    """Make `optimizer.step()`/`zero_grad()` no-ops except on the final micro-step, where step()
    first averages the accumulated gradients. Patched on the instance (identity, isinstance and
    state_dict unchanged) as bound methods: torch's LR schedulers wrap `optimizer.step` through
    its `__func__`, so a plain function there made a scheduler built after this crash
    ("'function' object has no attribute '__func__'"). The schedulers themselves step on real
    optimizer steps only (`hold_schedulers`). Preparing the same optimizer again only points it
    at `accumulation`."""
    holder: list[Any] | None = optimizer.__dict__.get(_HOLDER)
    if holder is not None:
        holder[0] = accumulation
        accumulation._clear_grads.append(holder[1])
        return
    holder = [accumulation, optimizer.zero_grad]
    real_step, real_zero_grad = optimizer.step, optimizer.zero_grad
    accumulation._clear_grads.append(real_zero_grad)

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        acc = holder[0]
        if not acc.final:
            return None
        acc.scale_gradients(p for group in self.param_groups for p in group["params"])
        acc.stepped = True
        return real_step(*args, **kwargs)

    def zero_grad(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        acc = holder[0]
        # With accumulation, only a zero_grad after the real step frees memory early; the
        # gradients of this step's micro-batches must survive until then.
        if acc.steps == 1 or acc.stepped:
            real_zero_grad(*args, **kwargs)

    if getattr(real_step, "_wrapped_by_lr_sched", False):
        # A scheduler built before wrapped the step (to see that it ran): it still does, inside
        # this one, and must not take this one for a step patched behind its back (its warning).
        step._wrapped_by_lr_sched = True    # type: ignore[attr-defined]
    optimizer.__dict__[_HOLDER] = holder
    # Patched on the instance on purpose (see the docstring): mypy forbids assigning to a method.
    optimizer.step = types.MethodType(step, optimizer)              # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)    # type: ignore[method-assign]
    hold_schedulers()


def hold_schedulers() -> None:
    """Make torch's LR schedulers (`LRScheduler`, `ReduceLROnPlateau`) step only on a real
    optimizer step of an optimizer this module wrapped: the loop body runs per micro-batch and
    calls `scheduler.step()` each time, which would run warmup and decay `accum` times too fast.
    An LRScheduler's first step, at its construction (`_step_count` 0), always runs. Once per
    process, on the classes; a subclass that overrides `step` with its own logic is not held."""
    from torch.optim import lr_scheduler
    for cls in (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau):
        original = cls.__dict__["step"]
        if getattr(original, "held_between_micro_steps", False):
            continue

        def step(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            holder = getattr(getattr(self, "optimizer", None), "__dict__", {}).get(_HOLDER)
            if holder is not None and not holder[0].final and getattr(self, "_step_count", 1) > 0:
                return None
            return _original(self, *args, **kwargs)

        functools.update_wrapper(step, original)
        step.held_between_micro_steps = True    # type: ignore[attr-defined]
        cls.step = step    # type: ignore[method-assign]

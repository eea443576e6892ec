"""Mixed precision for the user's loop: `ctx.autocast()`, `ctx.backward(loss)` and, with fp16,
the optimizer's step going through a GradScaler.

bf16 needs no loss scaling (its exponent range is fp32's), so with "fp32" and "bf16" the loop of
ARCHITECTURE.md works unchanged (`loss.backward(); opt.step()`), and `ctx.backward(loss)` is
just `loss.backward()`. fp16 underflows small gradients without scaling: the loss is scaled in
`ctx.backward`, and the prepared optimizer's `step()` unscales, skips the step on inf/nan and
updates the scale (`scaler.step` + `scaler.update`), so `opt.step()` stays the loop's call.
A plain `loss.backward()` under fp16 is caught at `opt.step()` with an error saying what to change.

With FSDP, FSDP2's MixedPrecisionPolicy casts parameters per module instead (see elastic._worker.wrap),
so `ctx.autocast()` is a no-op there. The scaler's state travels in warm restores and checkpoints.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from elastic._worker.wrap import low_precision_dtype
from elastic.errors import ConfigError


class Precision:
    """One generation's precision handling; the GradScaler itself outlives generations (Carry)."""

    def __init__(self, precision: str, strategy: str, device: torch.device, scaler: Any) -> None:
        self.dtype = low_precision_dtype(precision)
        self.precision, self.strategy, self.device, self.scaler = precision, strategy, device, scaler
        self._scaled_backward = False
        self._in_scaler = False
        self._unscaled: set[int] = set()     # optimizers whose gradients were unscaled this step

    @staticmethod
    def new_scaler(precision: str, device: torch.device) -> Any:
        return torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None or self.strategy in ("fsdp", "hsdp"):   # FSDP2 casts (MixedPrecisionPolicy)
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is None:
            loss.backward()
            return
        self.scaler.scale(loss).backward()
        self._scaled_backward = True

    def unscale(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """fp16: the gradients back to their true scale before they are clipped
        (GradScaler.unscale_, which its step then skips; once per optimizer and step)."""
        if self.scaler is None or not self._scaled_backward:
            return
        for optimizer in optimizers:
            if id(optimizer) not in self._unscaled:
                self.scaler.unscale_(optimizer)
                self._unscaled.add(id(optimizer))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """With fp16, route `optimizer.step()` through the scaler (an instance attribute, so the
        optimizer stays the same object for state dicts, checkpoints and LR groups)."""
        if self.scaler is None:
            return
        original = optimizer.__dict__.get("_elastic_unscaled_step") or optimizer.step
        optimizer.__dict__["_elastic_unscaled_step"] = original
        scaler = self.scaler

        def step(*args, **kwargs):
            if self._in_scaler:            # scaler.step calls optimizer.step once the grads are finite
                return original(*args, **kwargs)
            if not self._scaled_backward:
                raise ConfigError("ScalingConfig.precision='fp16' scales the loss: call ctx.backward(loss) "
                                  "instead of loss.backward() before optimizer.step()")
            self._in_scaler = True
            try:
                result = scaler.step(optimizer, *args, **kwargs)
                scaler.update()
            finally:
                self._in_scaler = self._scaled_backward = False
                self._unscaled.clear()
            return result

        optimizer.step = step      # type: ignore[method-assign]  # an instance attribute on purpose (see above)

    def state(self) -> dict[str, Any]:
        """Plain values (warm broadcasts and checkpoint extras)."""
        return {"grad_scaler": dict(self.scaler.state_dict())} if self.scaler is not None else {}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(dict(state["grad_scaler"]))

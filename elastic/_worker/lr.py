"""The learning-rate rule across rescales (Goyal et al. 2017): a pure function of the step and
the world-size history, so it survives restores and resumes.

lr(step) = base_lr x scale(step) x schedule(step), where scale follows global_batch /
base_global_batch = world_size / base_world_size. After a rescale the scale ramps linearly from
where it was to the new target over `rescale_warmup_steps`; a drop applies at once. The initial
warmup is a function of the global step and is never restarted.

In mode "constant_global_batch" the global batch does not change with the world size (gradient
accumulation keeps it, see elastic._worker.accumulation), so the scale is 1: lr = base_lr x schedule(step).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def schedule_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Warmup then `schedule` ("constant" or "cosine" decay to min_lr_ratio at total_steps)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def rule_lr(rule: Any, *, base_lr: float, ramp: ScaleRamp, step: int, total_steps: int) -> float:
    """The LR of `step` (0-based) under `rule` (an LRScalingConfig)."""
    scale = ramp.scale(step, rule.rescale_warmup_steps) if rule.mode == "linear" else 1.0
    return base_lr * scale * schedule_factor(step, total_steps=total_steps, warmup_steps=rule.warmup_steps,
                                             schedule=rule.schedule, min_lr_ratio=rule.min_lr_ratio)


@dataclass
class ScaleRamp:
    """Where the batch-size scale is going: from `start` at step `since` to `target`."""

    world_size: int          # world size the target belongs to
    target: float
    start: float
    since: int

    def scale(self, step: int, ramp_steps: int) -> float:
        if ramp_steps <= 0 or self.target <= self.start or step >= self.since + ramp_steps:
            return self.target
        done = (step - self.since + 1) / ramp_steps
        return self.start + (self.target - self.start) * done

    def rescaled(self, step: int, world_size: int, base_world_size: int, ramp_steps: int) -> ScaleRamp:
        """The ramp after the world size becomes `world_size` at `step` (unchanged if it did not)."""
        if world_size == self.world_size:
            return self
        return ScaleRamp(world_size, world_size / base_world_size, self.scale(step - 1, ramp_steps), step)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "target": self.target, "start": self.start, "since": self.since}

    def to_state(self, base_lr: float | None) -> dict[str, Any]:
        """The rule's state as plain values (warm broadcasts and checkpoints)."""
        return {"lr_base": float(base_lr or 0.0), **{f"lr_{k}": v for k, v in self.to_dict().items()}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ScaleRamp:
        return cls(world_size=int(state["lr_world_size"]), target=float(state["lr_target"]),
                   start=float(state["lr_start"]), since=int(state["lr_since"]))

    @classmethod
    def initial(cls, world_size: int, base_world_size: int) -> ScaleRamp:
        scale = world_size / base_world_size
        return cls(world_size, scale, scale, 0)

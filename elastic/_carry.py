"""What a worker keeps across generations (`Carry`): with `RunSpec`, what `TrainContext` works on
apart from the per-generation context."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic._lr import ScaleRamp
from elastic._protocol import StepRecord
from elastic._state import DATA_ORDER_START

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass
class Carry:
    """Per-worker state that outlives a generation."""

    step: int = 0
    samples_seen: int = 0
    data_order: str = DATA_ORDER_START        # chained hash of every consumed sample id, in order
    model: nn.Module | None = None            # unwrapped module of the last generation (warm source)
    optimizer: torch.optim.Optimizer | None = None
    checkpoints: Any = None                    # checkpointing.CheckpointManager, created lazily
    last_saved_step: int | None = None
    unconfirmed_save: int | None = None       # step of the latest save issued here, until its commit is seen
    save_started: dict[int, float] = field(default_factory=dict)   # step -> wall time its save began
    exported_commit: int | None = None         # newest commit exported to Ray metrics
    resumed_from: int | None = None
    warm_capable: bool = False                 # carry.model holds the full state (DDP)
    pending_samples: int = 0
    records: list[StepRecord] = field(default_factory=list)   # completed steps not yet polled
    records_lock: threading.Lock = field(default_factory=threading.Lock)   # the poll drains records
    news: threading.Event = field(default_factory=threading.Event)          # wakes a held poll
    load_fallbacks: list[dict] = field(default_factory=list)   # checkpoints skipped as corrupt
    restored: tuple[int, int] | None = None                    # (generation, step) of the last restore
    base_lr: float | None = None                               # LR rule: LR at base_world_size
    lr_ramp: ScaleRamp | None = None                           # LR rule: batch-size scale and its ramp
    grad_scaler: Any = None                                    # fp16: torch.amp.GradScaler

"""Configuration of an elastic run: frozen, keyword-only dataclasses checked on construction.

`None` means unlimited. Each check says which field to change and how.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from elastic.errors import ConfigError, StorageConfigError

STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
GRAD_COMPRESSIONS = (None, "bf16", "powersgd")
STORAGE_SCHEMES = ("file", "memory", "s3", "")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """How many workers, on what hardware, with which parallel strategy."""

    min_workers: int = 1
    """Fewest workers the run may continue with; below this it waits for replacements."""
    max_workers: int | None = None
    """Most workers the run grows to when capacity exists; None means no limit (grow while the
    cluster has room)."""
    startup_wait_s: float = 10.0
    """At start, how long to wait for max_workers to be ready before starting with fewer (at
    least min_workers); the rest join by a warm scale-up once ready. Raise it where every run
    must begin at full size (a slow image pull, a test that checks the starting world size)."""
    spare_workers: int = 0
    """Hot spares: workers started beyond max_workers, imported and idle, so that a lost member
    is replaced at once instead of after a new worker's start (seconds of imports, or a new
    node). Each reserves resources_per_worker. Needs max_workers."""
    use_gpu: bool = False
    """One GPU per worker and NCCL; otherwise CPU and gloo."""
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources reserved for each worker (its placement-group bundle)."""
    strategy: str = "ddp"
    """"ddp" (replicated; warm recovery from any survivor) or "fsdp" (FSDP2 fully_shard)."""
    precision: str = "fp32"
    """"fp32"; "bf16": autocast to bfloat16 around `ctx.autocast()` (CPU and GPU; FSDP casts
    parameters with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) instead); "fp16":
    float16 with a GradScaler, GPU only: the loop calls `ctx.backward(loss)`."""
    grad_compression: str | None = None
    """DDP gradient compression through a communication hook: None, "bf16" (half the bytes) or
    "powersgd" (low-rank, with error feedback; reset after every rescale)."""
    powersgd_rank: int = 1
    """PowerSGD matrix approximation rank: higher sends more and approximates better."""
    powersgd_warmup_steps: int = 10
    """Steps of plain all-reduce before PowerSGD compresses, from the start and again after every
    rescale (its error feedback restarts from zero); at least 2 (DDP rebuilds its buckets after
    the first step)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them to backward
    (ZeRO-2-like: less communication, more memory)."""
    fsdp_cpu_offload: bool = False
    """FSDP2: keep sharded parameters, gradients and optimizer state in host memory
    (CPUOffloadPolicy); the optimizer step runs on the CPU."""

    def __post_init__(self) -> None:
        _require(isinstance(self.min_workers, int) and self.min_workers >= 1,
                 f"ScalingConfig.min_workers must be an int >= 1, got {self.min_workers!r}")
        _require(self.max_workers is None or (isinstance(self.max_workers, int) and self.max_workers >= self.min_workers),
                 f"ScalingConfig.max_workers ({self.max_workers!r}) must be an int >= "
                 f"min_workers ({self.min_workers}); raise max_workers or lower min_workers")
        _require(isinstance(self.spare_workers, int) and self.spare_workers >= 0,
                 f"ScalingConfig.spare_workers must be an int >= 0, got {self.spare_workers!r}")
        _require(self.spare_workers == 0 or self.max_workers is not None,
                 "ScalingConfig.spare_workers needs max_workers: with no maximum every placed worker "
                 "already joins the run")
        _require(isinstance(self.startup_wait_s, (int, float)) and self.startup_wait_s >= 0,
                 f"ScalingConfig.startup_wait_s must be a number of seconds >= 0, got {self.startup_wait_s!r}")
        _require(self.strategy in STRATEGIES,
                 f"ScalingConfig.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        _require(all(v >= 0 for v in self.resources_per_worker.values()),
                 f"ScalingConfig.resources_per_worker has a negative amount: {self.resources_per_worker}")
        object.__setattr__(self, "resources_per_worker", dict(self.resources_per_worker))
        self._check_precision_and_memory()

    def _check_precision_and_memory(self) -> None:
        _require(self.precision in PRECISIONS,
                 f"ScalingConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        _require(self.precision != "fp16" or self.use_gpu,
                 "ScalingConfig.precision='fp16' needs use_gpu=True (a GradScaler on CPU is not supported); "
                 "use precision='bf16' on CPU")
        _require(self.grad_compression in GRAD_COMPRESSIONS,
                 f"ScalingConfig.grad_compression must be one of {GRAD_COMPRESSIONS}, got {self.grad_compression!r}")
        _require(self.grad_compression is None or self.strategy == "ddp",
                 f"ScalingConfig.grad_compression={self.grad_compression!r} works through DDP communication "
                 f"hooks; with strategy='fsdp' set grad_compression=None (FSDP reduces in reduce_dtype)")
        _require(isinstance(self.powersgd_rank, int) and self.powersgd_rank >= 1,
                 f"ScalingConfig.powersgd_rank must be an int >= 1, got {self.powersgd_rank!r}")
        _require(isinstance(self.powersgd_warmup_steps, int) and self.powersgd_warmup_steps >= 2,
                 f"ScalingConfig.powersgd_warmup_steps must be an int >= 2 (DDP rebuilds buckets after "
                 f"its first step), got {self.powersgd_warmup_steps!r}")
        _require(self.strategy == "fsdp" or (self.fsdp_reshard_after_forward and not self.fsdp_cpu_offload),
                 "ScalingConfig.fsdp_reshard_after_forward / fsdp_cpu_offload apply to strategy='fsdp' only; "
                 "set strategy='fsdp' or leave them at their defaults")

    @property
    def cpus_per_worker(self) -> float:
        return float(self.resources_per_worker.get("CPU", 1.0))


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often the run commits sharded checkpoints."""

    storage: str
    """fsspec URL or local path: the run's home (checkpoints/, status.json, summary.json)."""
    every_n_steps: int | None = None
    """Commit a checkpoint every this many steps; None means only at the end."""
    keep: int | None = 3
    """How many committed checkpoints to retain; None keeps all."""
    async_save: bool = True
    """Stage state in host memory at the step boundary and upload in the background."""
    max_consecutive_failures: int = 3
    """Failed saves in a row before the run fails with a CheckpointError."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Extra fsspec options (for s3: endpoint_url, key, secret); AWS_* variables also work."""

    def __post_init__(self) -> None:
        _require(isinstance(self.storage, str) and self.storage.strip() != "",
                 "CheckpointConfig.storage must be a non-empty URL or path")
        scheme = self.storage.split("://", 1)[0] if "://" in self.storage else ""
        if scheme not in STORAGE_SCHEMES:
            raise StorageConfigError(
                f"CheckpointConfig.storage: unsupported URL scheme {scheme!r} in {self.storage!r}; "
                f"use a local path, file://, memory:// or s3://")
        _require(self.every_n_steps is None or (isinstance(self.every_n_steps, int) and self.every_n_steps >= 1),
                 f"CheckpointConfig.every_n_steps must be >= 1 or None, got {self.every_n_steps!r}")
        _require(self.keep is None or (isinstance(self.keep, int) and self.keep >= 1),
                 f"CheckpointConfig.keep must be >= 1 or None, got {self.keep!r}")
        _require(self.max_consecutive_failures >= 1,
                 "CheckpointConfig.max_consecutive_failures must be >= 1")


NONFINITE_LOSS_ACTIONS = ("fail", "ignore")


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """How failures are detected and how many the run tolerates."""

    max_failures: int | None = 20
    """Infrastructure failures tolerated before the run fails; None is unlimited. User-code errors fail at once."""
    heartbeat_interval_s: float = 0.2
    """How often the controller looks at its workers (and re-polls one that answered). While the
    run trains, a worker holds a poll until something happens, up to 1 s (at most a fifth of
    heartbeat_timeout_s)."""
    heartbeat_timeout_s: float = 10.0
    """A worker that does not answer a poll for this long is declared hung and replaced.
    On a loaded machine raise it to avoid false alarms; lower it for faster hang detection."""
    collective_timeout_s: float = 60.0
    """Process-group timeout: the longest a rank waits in one collective before giving up."""
    rendezvous_timeout_s: float = 120.0
    """Longest wait to place `min_workers` and form a process group."""
    straggler_window: int = 20
    """Steps over which a rank's compute time is compared with the others' (median of the ratios)."""
    straggler_threshold: float | None = 1.35
    """A rank whose compute takes this many times the other ranks' median over the window is
    flagged (summary.json `stragglers`); the ScalingPolicy decides whether to evict it. None
    turns straggler scoring off. The default leaves room for the noise of 4 CPU workers sharing
    2 loaded cores (window medians up to 1.3 seen in clean runs); on GPUs it can go lower."""

    straggler_min_excess_s: float = 0.02
    """A flagged rank must also cost the group at least this many seconds of compute per step
    (median over the window, its time minus the others'): a high ratio on a few milliseconds of
    compute is scheduling noise, not worth a recovery. 0 flags on the ratio alone."""

    on_nonfinite_loss: str = "fail"
    """What a step whose loss (mean over ranks) is NaN or infinite does: "fail" ends the run with
    a NonFiniteLossError naming the step; "ignore" trains on. Either way no checkpoint is
    committed from such a step, so retention never deletes the last good one for it."""

    step_timeout_s: float | str | None = "auto"
    """Longest time without a completed step (or ctx.log) while the run trains before every rank
    is declared hung and replaced: catches a training thread stuck outside any collective (a
    dead data service, a deadlock), which no heartbeat sees. "auto": 100 smoothed step times,
    at least 600 s (an evaluation between steps counts against it); None turns it off."""

    def step_timeout(self, step_s: float) -> float | None:
        """The bound in force, given the smoothed step time (0 before any step)."""
        if self.step_timeout_s == "auto":
            return max(600.0, 100.0 * step_s)
        return self.step_timeout_s   # type: ignore[return-value]

    @property
    def poll_hold_s(self) -> float:
        """How long a worker may hold a poll while the run trains (answering at once when
        something happens): 1 s, and at most a fifth of heartbeat_timeout_s, so a healthy
        worker's silence stays far from the timeout."""
        return min(1.0, self.heartbeat_timeout_s / 5)

    def __post_init__(self) -> None:
        _require(self.max_failures is None or (isinstance(self.max_failures, int) and self.max_failures >= 0),
                 f"FailureConfig.max_failures must be >= 0 or None, got {self.max_failures!r}")
        _require(self.heartbeat_interval_s > 0, "FailureConfig.heartbeat_interval_s must be > 0")
        _require(self.heartbeat_timeout_s > self.heartbeat_interval_s,
                 f"FailureConfig.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                 f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        _require(self.collective_timeout_s > 0, "FailureConfig.collective_timeout_s must be > 0")
        _require(self.rendezvous_timeout_s > 0, "FailureConfig.rendezvous_timeout_s must be > 0")
        _require(isinstance(self.straggler_window, int) and self.straggler_window >= 3,
                 f"FailureConfig.straggler_window must be an int >= 3, got {self.straggler_window!r}")
        _require(self.straggler_min_excess_s >= 0,
                 f"FailureConfig.straggler_min_excess_s must be >= 0 seconds, got {self.straggler_min_excess_s!r}")
        _require(self.on_nonfinite_loss in NONFINITE_LOSS_ACTIONS,
                 f"FailureConfig.on_nonfinite_loss must be one of {NONFINITE_LOSS_ACTIONS}, "
                 f"got {self.on_nonfinite_loss!r}")
        _require(self.step_timeout_s is None or self.step_timeout_s == "auto" or (
            isinstance(self.step_timeout_s, (int, float)) and not isinstance(self.step_timeout_s, bool)
            and 0 < self.step_timeout_s < float("inf")),
                 f"FailureConfig.step_timeout_s must be a finite number of seconds > 0, \"auto\" or None "
                 f"(off), got {self.step_timeout_s!r}")
        _require(self.straggler_threshold is None or self.straggler_threshold > 1.0,
                 f"FailureConfig.straggler_threshold must be > 1.0 (a ratio to the other ranks) or None "
                 f"to turn scoring off, got {self.straggler_threshold!r}")


LR_MODES = ("linear", "constant_global_batch")
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True, kw_only=True)
class LRScalingConfig:
    """The LR across rescales: "linear" (lr follows the global batch, with warmup and a ramp after
    rescales) or "constant_global_batch" (the global batch is kept by gradient accumulation; the
    LR follows only the schedule)."""

    base_world_size: int
    """World size at which `base_lr` is right (base global batch = base_world_size x per-rank batch).
    In constant_global_batch mode the global batch is always this many per-rank batches, so it must
    be divisible by every world size in [min_workers, max_workers]."""
    base_lr: float | None = None
    """The LR at `base_world_size`; None takes the optimizer's initial LR."""
    warmup_steps: int = 0
    """Initial linear warmup, by global step (never restarted by a rescale or resume)."""
    rescale_warmup_steps: int = 0
    """After a rescale that raises the LR, ramp to it over this many steps; a drop applies at once
    (linear mode only: in constant_global_batch mode the LR never changes on a rescale)."""
    mode: str = "linear"
    """"linear": lr = base_lr x global_batch / base_global_batch x schedule(step).
    "constant_global_batch": each rank accumulates base_world_size / world_size micro-batches per
    step; lr = base_lr x schedule(step)."""
    schedule: str = "cosine"
    """"constant" or "cosine" (decay to min_lr_ratio x at total_steps), after the warmup."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay, as a share of the peak LR."""

    def __post_init__(self) -> None:
        _require(isinstance(self.base_world_size, int) and self.base_world_size >= 1,
                 f"LRScalingConfig.base_world_size must be an int >= 1, got {self.base_world_size!r}")
        _require(self.base_lr is None or self.base_lr > 0,
                 f"LRScalingConfig.base_lr must be > 0 (or None for the optimizer's LR), got {self.base_lr!r}")
        _require(self.warmup_steps >= 0 and self.rescale_warmup_steps >= 0,
                 "LRScalingConfig.warmup_steps and rescale_warmup_steps must be >= 0")
        _require(self.mode in LR_MODES, f"LRScalingConfig.mode must be one of {LR_MODES}, got {self.mode!r}")
        _require(self.mode == "linear" or self.rescale_warmup_steps == 0,
                 "LRScalingConfig.rescale_warmup_steps has no effect in mode 'constant_global_batch' (the LR does "
                 "not change on a rescale); leave it 0 or use mode 'linear'")
        _require(self.schedule in LR_SCHEDULES,
                 f"LRScalingConfig.schedule must be one of {LR_SCHEDULES}, got {self.schedule!r}")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "LRScalingConfig.min_lr_ratio must be within [0, 1]")


def to_jsonable(config: Any) -> Any:
    """The effective configuration as plain JSON (for summary.json)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, dict):
        return {str(k): to_jsonable(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_jsonable(v) for v in config]
    if isinstance(config, (str, int, float, bool)) or config is None:
        return config
    return repr(config)

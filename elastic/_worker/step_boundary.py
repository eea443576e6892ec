"""The step boundary on one rank, for one generation: what happens between two steps.

The loader opens a step (`begin_step`: the step's sample ids and its learning rate); the
context's `report` closes it (`end_step`: the step is counted, every rank's metrics and flags
are shared in one all-gather, and the step's record waits in the outbox for the controller).
The loader sees only this object, through elastic._data's `LoaderSide` protocol; the user sees
TrainContext, which owns the checkpoint rules around the boundary.
"""
from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from elastic._accumulation import Accumulation, as_float, new_accumulation
from elastic._determinism import chain_sample_ids, mix_seed
from elastic._lr import ScaleRamp, rule_lr
from elastic._protocol import GenerationPlan, RunSpec, StepRecord
from elastic._worker.state import WorkerState
from elastic._worker.step_timer import StepTimer
from elastic.errors import NonFiniteLossError, StateError

if TYPE_CHECKING:
    from torch import nn

MAX_METRICS = 32   # numeric report() keywords besides loss: fixed slots of the per-step all-gather
# metrics.jsonl's own keys: a report() keyword may not take their place (loss and lr may be given).
RESERVED_METRICS = frozenset({"step", "world_size", "time", "global_batch", "accum_steps", "samples_seen",
                              "kind", "generation"})
_HEADER = 5        # loss, stop flag, preemption flag, compute seconds, hash of the metric names


class StepOutcome(NamedTuple):
    """What the group decided at a step's all-gather: leave the loop (a rescale), commit first
    (a rank got a preemption notice)."""

    stop: bool
    preempted: bool


class StepBoundary:
    """One generation's step accounting on one rank."""

    def __init__(self, *, plan: GenerationPlan, spec: RunSpec, worker: WorkerState, device: torch.device,
                 stop_requested: threading.Event, preempted: threading.Event):
        self._plan, self._spec, self._worker = plan, spec, worker
        self.device = device
        self._comm_device = device if spec.use_gpu else torch.device("cpu")
        self._stop_requested, self._preempted = stop_requested, preempted
        self.accumulation: Accumulation | None = new_accumulation(spec.lr, plan.world_size)
        self.timer = StepTimer()
        self.sync_model: nn.Module | None = None    # first prepared model: accumulation toggles its gradient sync
        self.lr_optimizer: torch.optim.Optimizer | None = None   # the first prepared: the LR rule acts on it
        self.group_ratios: list[float] = []         # its groups' LR ratios to its first group
        self._global_batch = 0
        self._step_ids: list[int] = []               # sample ids the whole group reads at this step
        self._first_step_announced = False

    # ---- what the loader reads (elastic._data.LoaderSide) ---------------------------
    @property
    def rank(self) -> int:
        return self._plan.rank

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    @property
    def total_steps(self) -> int:
        return self._spec.total_steps

    @property
    def seed(self) -> int:
        return self._spec.seed

    @property
    def step(self) -> int:
        return self._worker.progress.step

    @property
    def samples_seen(self) -> int:
        return self._worker.progress.samples_seen

    @property
    def accum_steps(self) -> int:
        return self.accumulation.steps if self.accumulation is not None else 1

    def begin_step(self, global_batch: int, sample_ids: list[int]) -> None:
        """The loader is about to yield a step's batch of the group's `sample_ids`."""
        self._global_batch = global_batch
        self._step_ids = sample_ids
        self._worker.progress.pending_samples = global_batch
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Set this step's LR from the rule: a function of the step and the world-size history."""
        rule, progress = self._spec.lr, self._worker.progress
        if rule is None or self.lr_optimizer is None or progress.base_lr is None or not self.group_ratios:
            return
        step = progress.step
        ramp = progress.lr_ramp or ScaleRamp.initial(self.world_size, rule.base_world_size)
        progress.lr_ramp = ramp.rescaled(step, self.world_size, rule.base_world_size, rule.rescale_warmup_steps)
        lr = rule_lr(rule, base_lr=progress.base_lr, ramp=progress.lr_ramp, step=step, total_steps=self.total_steps)
        # A group added after prepare_optimizer() has no ratio: it keeps the LR it was given.
        for group, ratio in zip(self.lr_optimizer.param_groups, self.group_ratios, strict=False):
            group["lr"] = lr * ratio

    # ---- what report() and log() do --------------------------------------------------
    def end_step(self, metrics: dict[str, Any]) -> StepOutcome | None:
        """Count the step, share the metrics, keep the record. None: a non-final micro-batch
        (gradient accumulation), which only notes its loss."""
        accumulation = self.accumulation
        if accumulation is not None and accumulation.defer_report(as_float(metrics.get("loss"))):
            return None
        names, values = numeric_metrics(metrics, skip=frozenset({"loss", "lr"}))
        progress = self._worker.progress
        # The optimizer step has run: the in-memory state is now the state after this step.
        progress.step += 1
        progress.samples_seen += progress.pending_samples
        progress.pending_samples = 0
        # The step's samples count as consumed with the step itself, before the collective below:
        # if it fails, the state that survives has this step, so its hash must have its samples.
        if self._step_ids:
            progress.data_order = chain_sample_ids(progress.data_order, self._step_ids)
            self._step_ids = []
        lr = as_float(metrics["lr"]) if "lr" in metrics else \
            (self.lr_optimizer.param_groups[0]["lr"] if self.lr_optimizer is not None else None)
        loss = metrics.get("loss")
        loss_value = accumulation.mean_loss() if accumulation is not None else (as_float(loss) or 0.0)
        # One small all-gather per step carries every rank's loss, rescale flag, preemption
        # flag, compute time and metrics, so every rank leaves the loop at the same step and every
        # rank can record the means and the ranks' compute times (straggler scoring). Fixed size
        # (MAX_METRICS slots), whatever the names: ranks that disagree are caught by the names' hash.
        mine = torch.zeros(_HEADER + MAX_METRICS, dtype=torch.float64)
        mine[:_HEADER] = torch.tensor([loss_value, float(self._stop_requested.is_set()),
                                       float(self._preempted.is_set()), self.timer.compute_s(),
                                       float(mix_seed("metrics", names) & ((1 << 52) - 1))], dtype=torch.float64)
        mine[_HEADER:_HEADER + len(values)] = torch.tensor(values, dtype=torch.float64)
        mine = mine.to(self._comm_device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, mine)
        except BaseException:
            # The update is applied: this state may be the one the group restores (warm), so the
            # step keeps a record, with this rank's own values (the others' never arrived).
            self._keep_record(dict(zip(names, values, strict=True)), lr, loss_value if loss is not None else None, ())
            raise
        shared = torch.stack(gathered).cpu()
        if bool((shared[:, 4] != shared[0, 4]).any()):
            raise StateError(f"ctx.report() at step {self.step}: the ranks reported different metric names "
                             f"(rank {self.rank}: {list(names)}); report the same names on every rank, and "
                             f"rank-local values through ctx.log()")
        means = shared[:, _HEADER:_HEADER + len(names)].mean(dim=0).tolist()
        # Every rank keeps the record (same all-gathered values): if rank 0 dies before the
        # controller polls it, a survivor still has the step.
        mean_loss = float(shared[:, 0].sum()) / self.world_size if loss is not None else None
        self._keep_record(dict(zip(names, means, strict=True)), lr, mean_loss,
                          tuple(round(float(c), 6) for c in shared[:, 3]))
        if mean_loss is not None and not math.isfinite(mean_loss):
            self._worker.checkpoints.nonfinite_step = progress.step
            if self._spec.on_nonfinite_loss == "fail":
                # Every rank raises the same error at the same step (the values are all-gathered).
                raise NonFiniteLossError(
                    f"the loss of step {progress.step} is {mean_loss} (mean over {self.world_size} ranks); no "
                    f"checkpoint was committed from it. Lower the learning rate, clip gradients or check the "
                    f"data; FailureConfig.on_nonfinite_loss='ignore' trains on")
        return StepOutcome(stop=bool(shared[:, 1].max() > 0), preempted=bool(shared[:, 2].max() > 0))

    def log(self, metrics: dict[str, Any]) -> None:
        """Metrics at the current step, counting no step: this rank's record only."""
        names, values = numeric_metrics(metrics, reserved=RESERVED_METRICS | {"loss", "lr"})
        progress = self._worker.progress
        self._worker.outbox.put(StepRecord(
            step=progress.step, loss=None, world_size=self.world_size, time=time.time(),
            samples_seen=progress.samples_seen, global_batch=self._global_batch,
            metrics=dict(zip(names, values, strict=True)), generation=self._plan.generation, kind="log"))

    def _keep_record(self, metrics: dict[str, float], lr: float | None, loss: float | None,
                     compute_s: tuple[float, ...]) -> None:
        progress = self._worker.progress
        if lr is not None:
            metrics = {**metrics, "lr": lr}
        self._worker.outbox.put(StepRecord(
            step=progress.step, loss=loss, world_size=self.world_size, time=time.time(),
            samples_seen=progress.samples_seen, global_batch=self._global_batch, metrics=metrics,
            compute_s=compute_s, data_order=progress.data_order, generation=self._plan.generation,
            accum_steps=self.accum_steps))
        if not self._first_step_announced:
            # The generation's first step ends a recovery: the controller hears it at once,
            # not when the held poll would have come back anyway.
            self._first_step_announced = True
            self._worker.outbox.news.set()


def numeric_metrics(metrics: dict[str, Any], *, skip: frozenset[str] = frozenset(),
                    reserved: frozenset[str] = RESERVED_METRICS) -> tuple[tuple[str, ...], list[float]]:
    """The numeric keywords (numbers, one-element tensors) by sorted name, and their values;
    `skip`: names handled apart (report's loss and lr); `reserved`: names refused."""
    clash = sorted(set(metrics) & reserved)
    if clash:
        raise StateError(f"metric names {clash} are metrics.jsonl's own; rename them")
    names: list[str] = []
    for name, value in metrics.items():
        if name in skip or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            names.append(name)
        elif isinstance(value, torch.Tensor):
            raise StateError(f"metric {name!r} is a tensor of {value.numel()} elements; report a number or a "
                             f"one-element tensor")
    names.sort()
    if len(names) > MAX_METRICS:
        raise StateError(f"{len(names)} metrics in one call; at most {MAX_METRICS} besides loss and lr "
                         f"(split them over report() and ctx.log())")
    return tuple(names), [float(as_float(metrics[n]) or 0.0) for n in names]

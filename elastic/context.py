"""TrainContext: what the user's train_loop sees on each rank, for one generation.

A generation is one formation of the process group. When the controller rescales, the loop is
unwound at a step boundary (`report`) and re-entered with a new context; the state that must
survive (step counters, the last model and optimizer for warm recovery, the checkpoint manager)
lives in the worker's `Carry` (elastic/_carry.py).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from elastic import _checkpoint_io, _wrap
from elastic._accumulation import as_float, new_accumulation, wrap_optimizer
from elastic._carry import Carry
from elastic._data import ElasticLoader
from elastic._protocol import GenerationPlan, RunSpec, StepRecord
from elastic._lr import ScaleRamp, rule_lr
from elastic._precision import Precision
from elastic._state import DATA_ORDER_START, broadcast_state, chain_sample_ids, mix_seed, state_sha256
from elastic._step_timer import StepTimer
from elastic.config import ScalingConfig
from elastic.errors import ConfigError, ElasticError

log = logging.getLogger("elastic.context")

RECORDS_KEPT = 10_000   # step records a rank holds until polled (bounded if the controller stalls)


class RescaleInterrupt(BaseException):
    """Unwinds the user's loop at a step boundary when the controller re-forms the group.

    A BaseException, so a user's `except Exception` does not swallow it.
    """


class TrainContext:
    """Per-rank handle given to `train_loop(ctx)`; re-created after every rescale."""

    def __init__(self, *, plan: GenerationPlan, spec: RunSpec, carry: Carry, loop_config: Any,
                 stop_requested: threading.Event, preempted: threading.Event, device: torch.device):
        self._plan = plan
        self._spec = spec
        self._loop_config = loop_config
        self._carry = carry
        self._stop_requested = stop_requested
        self._preempted = preempted
        self.device = device
        self._comm_device = device if spec.use_gpu else torch.device("cpu")
        self._group_ratios: list[float] = []
        self._model: nn.Module | None = None       # as returned to the user (wrapped)
        self._raw_model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._global_batch = 0
        self._timer = StepTimer()
        self._first_step_announced = False
        self._step_ids: list[int] = []             # sample ids the whole group reads at this step
        self._scaling = spec.scaling or ScalingConfig(strategy=spec.strategy, use_gpu=spec.use_gpu)
        if carry.grad_scaler is None:
            carry.grad_scaler = Precision.new_scaler(self._scaling.precision, device)
        self._precision = Precision(self._scaling.precision, spec.strategy, device, carry.grad_scaler)
        self._compression: _wrap.PowerSGDCompression | None = None
        self._accumulation = new_accumulation(spec.lr, plan.world_size)   # constant_global_batch mode

    # ---- identity -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._plan.rank

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    @property
    def generation(self) -> int:
        return self._plan.generation

    @property
    def step(self) -> int:
        """Steps completed so far (the step about to run, 0-based)."""
        return self._carry.step

    @property
    def samples_seen(self) -> int:
        return self._carry.samples_seen

    @property
    def accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step (1 unless the global batch is held constant)."""
        return self._accumulation.steps if self._accumulation is not None else 1

    @property
    def total_steps(self) -> int:
        return self._spec.total_steps

    @property
    def seed(self) -> int:
        return self._spec.seed

    @property
    def config(self) -> Any:
        """The `train_loop_config` passed to ElasticTrainer."""
        return self._loop_config

    # ---- preparation ----------------------------------------------------------------
    def prepare_model(self, model: nn.Module, *, shard_modules: list[nn.Module] | None = None) -> nn.Module:
        """Move the model to this rank's device and wrap it: DDP (with the gradient compression
        hook of ScalingConfig), or FSDP2 `fully_shard` (with its precision and memory options).

        With FSDP, each module in `shard_modules` (default: every child of every ModuleList,
        i.e. the transformer blocks) becomes its own shard unit, then the root.
        """
        model = model.to(self.device)
        self._raw_model = model
        # The same PowerSGD seed on every rank: its random projections must match across ranks.
        self._model, self._compression = _wrap.wrap_model(
            model, device=self.device, world_size=self.world_size, scaling=self._scaling, timer=self._timer,
            seed=mix_seed(self.seed, "powersgd"), shard_modules=shard_modules)
        return self._model

    def autocast(self):
        """Around forward and loss: autocast to ScalingConfig.precision (see elastic._precision)."""
        return self._precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled by the GradScaler under fp16 (required there)."""
        self._precision.backward(loss)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register the optimizer so its state is restored, broadcast and checkpointed."""
        self._optimizer = optimizer
        self._precision.prepare_optimizer(optimizer)
        rule = self._spec.lr
        if rule is not None:
            first = optimizer.param_groups[0]["lr"]
            if rule.base_lr is None and not first > 0:
                raise ConfigError(f"the optimizer's lr is the base LR (LRScalingConfig.base_lr is None) and must "
                                  f"be > 0, got {first!r}; set it or LRScalingConfig.base_lr")
            # Groups keep their LR ratios to the first group; the rule sets the first.
            self._group_ratios = [g["lr"] / first if first else 1.0 for g in optimizer.param_groups]
            if self._carry.base_lr is None:
                self._carry.base_lr = rule.base_lr if rule.base_lr is not None else first
        if self._accumulation is not None:
            wrap_optimizer(optimizer, self._accumulation)
        return optimizer

    def prepare_data(self, dataset: Any, batch_size: int, *, shuffle: bool = True,
                     collate_fn: Callable[[list[Any]], Any] | None = None, **loader_options: Any) -> ElasticLoader:
        """A loader of this rank's batches from the current step to `total_steps`.

        `loader_options` (num_workers, pin_memory, prefetch_factor, ...) go to the torch
        DataLoader that builds the batches; see ElasticLoader."""
        return ElasticLoader(self, dataset, batch_size, shuffle=shuffle, collate_fn=collate_fn, **loader_options)

    # ---- state ----------------------------------------------------------------------
    def restore(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Load the latest state into `model`/`optimizer` (defaults: the prepared ones).

        Warm: broadcast from the survivor the controller chose. Checkpoint: the newest committed
        checkpoint, resharded to this world size. Fresh: nothing to load. Returns the step.
        """
        model = self._raw_model if model is None or model is self._model else model
        optimizer = optimizer or self._optimizer
        plan = self._plan.restore
        carry = self._carry
        if plan.kind == "broadcast":
            self._restore_warm(model, optimizer, plan.source_rank)
        elif plan.kind == "checkpoint":
            self._restore_checkpoint(self._model if model is self._raw_model else model, optimizer)
        else:
            # Nothing to load (e.g. FSDP lost a rank before its first commit): every rank starts
            # over from step 0, a survivor's counters included, or the ranks would disagree.
            carry.step, carry.samples_seen, carry.data_order = 0, 0, DATA_ORDER_START
            carry.pending_samples, carry.last_saved_step = 0, None
        carry.model, carry.optimizer = model, optimizer
        carry.warm_capable = self._spec.strategy == "ddp" and model is not None
        carry.restored = (self.generation, carry.step)
        with carry.records_lock:
            # Steps past the restored one were lost with the failure: never report them.
            carry.records = [r for r in carry.records if r.step <= carry.step]
        log.info("rank %d generation %d restored (%s) at step %d",
                 self.rank, self.generation, plan.kind, carry.step)
        return carry.step

    def _restore_warm(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None, src: int | None) -> None:
        carry = self._carry
        state = None
        if self.rank == src:
            if carry.model is None:
                raise ElasticError(f"rank {src} was chosen as warm source but holds no state")
            state = {"model": carry.model.state_dict(),
                     "optim": carry.optimizer.state_dict() if carry.optimizer is not None else None,
                     "step": carry.step, "samples_seen": carry.samples_seen, "data_order": carry.data_order,
                     "lr": self._lr_state(), "precision": self._precision.state()}
        state = broadcast_state(state, src, self._comm_device)
        self._set_lr_state(state["lr"])
        self._precision.load_state(state["precision"])
        if model is not None:
            model.load_state_dict(state["model"])
        if optimizer is not None and state["optim"] is not None:
            optimizer.load_state_dict(state["optim"])
        carry.step, carry.samples_seen = int(state["step"]), int(state["samples_seen"])
        carry.data_order = str(state["data_order"])

    def _restore_checkpoint(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        carry = self._carry
        extra = {"step": 0, "samples_seen": 0, "data_order": DATA_ORDER_START, **self._lr_state(),
                 **self._precision.state()}
        state, loaded = _wrap.load_with_compression_state(
            self._checkpoints(), self._compression, self.rank, self.world_size, self._comm_device,
            lambda with_keys: _checkpoint_io.build_state(model, optimizer, {**extra, **with_keys}))
        if loaded is None:
            log.warning("rank %d: no committed checkpoint under %s; starting fresh", self.rank, self._spec.storage)
            carry.step, carry.samples_seen, carry.data_order = 0, 0, DATA_ORDER_START
            return
        _checkpoint_io.apply_state(model, optimizer, state)
        carry.load_fallbacks.extend(dict(s) for s in loaded.skipped)
        self._set_lr_state(state["extra"])
        self._precision.load_state(state["extra"])
        carry.step = int(state["extra"]["step"])
        carry.samples_seen = int(state["extra"]["samples_seen"])
        carry.data_order = str(state["extra"]["data_order"])
        carry.last_saved_step = carry.step
        if self.generation == 0 and carry.resumed_from is None:
            carry.resumed_from = carry.step

    def _checkpoints(self):
        return _checkpoint_io.open_manager(self._carry, self._spec)

    def save_checkpoint(self, *, wait: bool = False) -> None:
        """Collective: commit a checkpoint of the current step (async unless `wait`)."""
        carry = self._carry
        state = _checkpoint_io.build_state(self._model, self._optimizer,
                                           {"step": carry.step, "samples_seen": carry.samples_seen,
                                            "data_order": carry.data_order, "world_size": self.world_size,
                                            **self._lr_state(), **self._precision.state(),
                                            **_wrap.compression_extra(self._compression, self.rank)})
        manager = self._checkpoints()
        carry.save_started[carry.step] = time.time()
        manager.save(carry.step, state, generation=self.generation)
        carry.last_saved_step = carry.unconfirmed_save = carry.step
        if wait:
            manager.wait()
        self._export_commit()

    def _export_commit(self) -> None:
        """Rank 0: checkpoint seconds and bytes of a commit it has learnt of, to Ray metrics."""
        carry = self._carry
        commit = carry.checkpoints.last_commit if carry.checkpoints is not None else None
        if self.rank != 0 or commit is None or commit.step == carry.exported_commit:
            return
        carry.exported_commit = commit.step
        started = carry.save_started.pop(commit.step, commit.committed_at)
        carry.save_started = {s: t for s, t in carry.save_started.items() if s > commit.step}
        try:
            from elastic._ray_metrics import checkpoint_committed
            checkpoint_committed(self._spec.storage, commit.committed_at - started, commit.total_bytes)
        except Exception:   # noqa: BLE001 - metrics are best effort; never fail a step for them
            log.debug("exporting checkpoint metrics failed", exc_info=True)

    # ---- step boundary --------------------------------------------------------------
    def _begin_step(self, global_batch: int, sample_ids: list[int]) -> None:
        self._global_batch = global_batch
        self._step_ids = sample_ids
        self._carry.pending_samples = global_batch
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Set this step's LR from the rule: a function of the step and the world-size history."""
        rule, carry = self._spec.lr, self._carry
        if rule is None or self._optimizer is None or carry.base_lr is None:
            return
        step = carry.step
        ramp = carry.lr_ramp or ScaleRamp.initial(self.world_size, rule.base_world_size)
        carry.lr_ramp = ramp.rescaled(step, self.world_size, rule.base_world_size, rule.rescale_warmup_steps)
        lr = rule_lr(rule, base_lr=carry.base_lr, ramp=carry.lr_ramp, step=step, total_steps=self.total_steps)
        for group, ratio in zip(self._optimizer.param_groups, self._group_ratios):
            group["lr"] = lr * ratio

    def _lr_state(self) -> dict[str, Any]:
        """The LR rule's state, as plain values (travels in warm broadcasts and checkpoints)."""
        if self._spec.lr is None:
            return {}
        ramp = self._carry.lr_ramp or ScaleRamp.initial(self.world_size, self._spec.lr.base_world_size)
        return ramp.to_state(self._carry.base_lr)

    def _set_lr_state(self, state: dict[str, Any]) -> None:
        if self._spec.lr is None or "lr_base" not in state:
            return
        self._carry.base_lr, self._carry.lr_ramp = float(state["lr_base"]), ScaleRamp.from_state(state)

    def report(self, **metrics: Any) -> None:
        """End of a step: count it, share the loss, checkpoint when due, unwind on rescale.

        Call it once per batch, after `optimizer.step()`, with no collective in between. With
        gradient accumulation a non-final micro-batch's report only notes its loss.
        """
        accumulation = self._accumulation
        if accumulation is not None and accumulation.defer_report(as_float(metrics.get("loss"))):
            return
        carry = self._carry
        # The optimizer step has run: the in-memory state is now the state after this step.
        carry.step += 1
        carry.samples_seen += carry.pending_samples
        carry.pending_samples = 0
        # The step's samples count as consumed with the step itself, before the collective below:
        # if it fails, the state that survives has this step, so its hash must have its samples.
        if self._step_ids:
            carry.data_order = chain_sample_ids(carry.data_order, self._step_ids)
            self._step_ids = []
        if carry.model is None and self._raw_model is not None:
            carry.model, carry.optimizer = self._raw_model, self._optimizer
            carry.warm_capable = self._spec.strategy == "ddp"
        if self._optimizer is not None:
            metrics.setdefault("lr", self._optimizer.param_groups[0]["lr"])
        loss = metrics.get("loss")
        loss_value = accumulation.mean_loss() if accumulation is not None else (as_float(loss) or 0.0)
        # One small all-gather per step carries every rank's loss, rescale flag, preemption
        # flag and compute time, so every rank leaves the loop at the same step and every rank can
        # record the mean loss and the ranks' compute times (straggler scoring).
        mine = torch.tensor([loss_value, float(self._stop_requested.is_set()), float(self._preempted.is_set()),
                             self._timer.compute_s()], dtype=torch.float64, device=self._comm_device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, mine)
        except BaseException:
            # The update is applied: this state may be the one the group restores (warm), so the
            # step keeps a record, with this rank's own loss (the others' never arrived).
            self._keep_record(metrics, loss_value if loss is not None else None, ())
            raise
        shared = torch.stack(gathered).cpu()
        stop, preempted = bool(shared[:, 1].max() > 0), bool(shared[:, 2].max() > 0)
        # Every rank keeps the record (same all-gathered values): if rank 0 dies before the
        # controller polls it, a survivor still has the step.
        self._keep_record(metrics, float(shared[:, 0].sum()) / self.world_size if loss is not None else None,
                          tuple(round(float(c), 6) for c in shared[:, 3]))
        every = self._spec.checkpoint_every
        if every is not None and carry.step % every == 0 and carry.step < self.total_steps:
            self.save_checkpoint()
        if preempted and carry.last_saved_step != carry.step:
            # A rank got its preemption notice: commit this step before it leaves.
            self.save_checkpoint(wait=True)
        if stop or preempted:
            if not carry.warm_capable and carry.last_saved_step != carry.step:
                # FSDP shards cannot be re-broadcast after the group changes: commit them first.
                self.save_checkpoint(wait=True)
            raise RescaleInterrupt()
        self._timer.start()

    def log(self, **metrics: Any) -> None:
        """Record metrics at the current step without counting a step (validation, eval).

        Local to this rank, no collective: call it on one rank, or on every rank with the same
        values (the lowest rank's record of a step is the one kept). Numeric values only."""
        carry = self._carry
        values = {k: as_float(v) for k, v in metrics.items()
                  if isinstance(v, (int, float)) or hasattr(v, "detach")}
        record = StepRecord(step=carry.step, loss=None, world_size=self.world_size, time=time.time(),
                            samples_seen=carry.samples_seen, global_batch=self._global_batch,
                            metrics=values, generation=self.generation, kind="log")
        with carry.records_lock:
            carry.records.append(record)
            del carry.records[:-RECORDS_KEPT]

    def _keep_record(self, metrics: dict[str, Any], loss: float | None, compute_s: tuple[float, ...]) -> None:
        carry = self._carry
        extra = {k: float(v) for k, v in metrics.items() if k != "loss" and isinstance(v, (int, float))}
        record = StepRecord(step=carry.step, loss=loss, world_size=self.world_size, time=time.time(),
                            samples_seen=carry.samples_seen, global_batch=self._global_batch, metrics=extra,
                            compute_s=compute_s, data_order=carry.data_order, generation=self.generation,
                            accum_steps=self.accum_steps)
        with carry.records_lock:
            carry.records.append(record)
            del carry.records[:-RECORDS_KEPT]
        if not self._first_step_announced:
            # The generation's first step ends a recovery: the controller hears it at once,
            # not when the held poll would have come back anyway.
            self._first_step_announced = True
            carry.news.set()

    def _confirm_final_commit(self) -> None:
        """A run is finished only once its final state is committed. Every rank learns the
        commit's outcome from rank 0 (checkpointing broadcasts it): if rank 0 was lost mid-commit
        or storage refused it, this rank reports that failure instead of a finish, and the run
        recovers and commits the final step again."""
        carry = self._carry
        if carry.unconfirmed_save != carry.step:
            return
        commit = carry.checkpoints.last_commit
        if commit is None or commit.step != carry.step:
            carry.last_saved_step = commit.step if commit is not None else None
            from checkpointing import CheckpointError
            raise carry.checkpoints.last_error or CheckpointError(
                f"the final checkpoint of step {carry.step} was not committed", url=self._spec.storage)
        carry.unconfirmed_save = None

    def _finish(self) -> str | None:
        """After the loop: commit the final state and hash the full model (collective)."""
        carry = self._carry
        if self._model is not None and carry.last_saved_step != carry.step:
            self.save_checkpoint(wait=True)
        if carry.checkpoints is not None:
            carry.checkpoints.wait()
            self._export_commit()
            self._confirm_final_commit()
        if self._model is None:
            return None
        full = _checkpoint_io.full_model_state(self._model) if self._spec.strategy == "fsdp" \
            else self._raw_model.state_dict()
        return state_sha256(full) if self.rank == 0 else None

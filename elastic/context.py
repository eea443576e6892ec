"""TrainContext: what the user's train_loop sees on each rank, for one generation.

A generation is one formation of the process group. When the controller rescales, the loop is
unwound at a step boundary (`report`) and re-entered with a new context; what must survive lives
in the worker's `WorkerState` (elastic/_worker_state.py), and what the loop hands to
`restore(...)` becomes the generation's `TrainState` (elastic/_train_state.py), the one object
that warm broadcasts and checkpoints both save and load.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from elastic import _checkpoint_io, _wrap
from elastic._accumulation import as_float, new_accumulation, wrap_optimizer
from elastic._data import ElasticLoader
from elastic._lr import ScaleRamp, rule_lr
from elastic._precision import Precision
from elastic._protocol import GenerationPlan, RunSpec, StepRecord
from elastic._state import broadcast_state, chain_sample_ids, mix_seed, state_sha256
from elastic._step_timer import StepTimer
from elastic._train_state import TrainState
from elastic._worker_state import WorkerState
from elastic.config import ScalingConfig
from elastic.errors import ConfigError, ElasticError, NonFiniteLossError, RestoreRequiredError, StateError

log = logging.getLogger("elastic.context")

MAX_METRICS = 32   # numeric report() keywords besides loss: fixed slots of the per-step all-gather
# metrics.jsonl's own keys: a report() keyword may not take their place (loss and lr may be given).
RESERVED_METRICS = frozenset({"step", "world_size", "time", "global_batch", "accum_steps", "samples_seen",
                              "kind", "generation"})
_HEADER = 5        # loss, stop flag, preemption flag, compute seconds, hash of the metric names


class RescaleInterrupt(BaseException):
    """Unwinds the user's loop at a step boundary when the controller re-forms the group.

    A BaseException, so a user's `except Exception` does not swallow it.
    """


class TrainContext:
    """Per-rank handle given to `train_loop(ctx)`; re-created after every rescale."""

    def __init__(self, *, plan: GenerationPlan, spec: RunSpec, worker: WorkerState, loop_config: Any,
                 stop_requested: threading.Event, preempted: threading.Event, device: torch.device):
        self._plan = plan
        self._spec = spec
        self._loop_config = loop_config
        self._worker = worker
        self._stop_requested = stop_requested
        self._preempted = preempted
        self.device = device
        self._comm_device = device if spec.use_gpu else torch.device("cpu")
        self._group_ratios: list[float] = []
        self._models: list[tuple[nn.Module, nn.Module]] = []   # (as returned to the user, unwrapped)
        self._optimizers: list[torch.optim.Optimizer] = []
        self._state: TrainState | None = None                   # set by restore()
        self._global_batch = 0
        self._timer = StepTimer()
        self._first_step_announced = False
        self._step_ids: list[int] = []             # sample ids the whole group reads at this step
        self._scaling = spec.scaling or ScalingConfig(strategy=spec.strategy, use_gpu=spec.use_gpu)
        if worker.grad_scaler is None:
            worker.grad_scaler = Precision.new_scaler(self._scaling.precision, device)
        self._precision = Precision(self._scaling.precision, spec.strategy, device, worker.grad_scaler)
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
    def local_rank(self) -> int:
        """This rank's index among the group's ranks on its node (torchrun's LOCAL_RANK)."""
        return self._plan.local_rank

    @property
    def local_world_size(self) -> int:
        """Ranks of the group on this rank's node (torchrun's LOCAL_WORLD_SIZE)."""
        return self._plan.local_world_size

    @property
    def node_rank(self) -> int:
        """Index of this rank's node among the group's nodes, in rank order (torchrun's GROUP_RANK)."""
        return self._plan.node_rank

    @property
    def generation(self) -> int:
        return self._plan.generation

    @property
    def step(self) -> int:
        """Steps completed so far (the step about to run, 0-based)."""
        return self._worker.progress.step

    @property
    def samples_seen(self) -> int:
        return self._worker.progress.samples_seen

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

    @property
    def _model(self) -> nn.Module | None:
        """The first prepared model as the user holds it (gradient accumulation toggles its sync)."""
        return self._models[0][0] if self._models else None

    # ---- preparation ----------------------------------------------------------------
    def prepare_model(self, model: nn.Module, *, shard_modules: list[nn.Module] | None = None) -> nn.Module:
        """Move the model to this rank's device and wrap it: DDP (with the gradient compression
        hook of ScalingConfig), or FSDP2 `fully_shard` (with its precision and memory options).

        With FSDP, each module in `shard_modules` (default: every child of every ModuleList,
        i.e. the transformer blocks) becomes its own shard unit, then the root. Several models
        may be prepared (GAN, teacher/student); hand each to `restore` under a name of its own.
        Models that are not trained across ranks (an EMA copy) need no preparing: move them to
        `ctx.device` and hand them to `restore`.
        """
        model = model.to(self.device)
        # The same PowerSGD seed on every rank: its random projections must match across ranks.
        wrapped, compression = _wrap.wrap_model(
            model, device=self.device, world_size=self.world_size, scaling=self._scaling, timer=self._timer,
            seed=mix_seed(self.seed, "powersgd", len(self._models)), shard_modules=shard_modules)
        self._models.append((wrapped, model))
        # Checkpoints carry one PowerSGD state per rank: the first compressed model's.
        self._compression = self._compression or compression
        return wrapped

    def autocast(self):
        """Around forward and loss: autocast to ScalingConfig.precision (see elastic._precision)."""
        return self._precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled by the GradScaler under fp16 (required there)."""
        self._precision.backward(loss)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register the optimizer: the LR rule and gradient accumulation act on it (the first one
        prepared carries the LR rule). Hand it to `restore` so its state survives."""
        self._optimizers.append(optimizer)
        self._precision.prepare_optimizer(optimizer)
        rule = self._spec.lr
        if rule is not None and len(self._optimizers) == 1:
            first = optimizer.param_groups[0]["lr"]
            if rule.base_lr is None and not first > 0:
                raise ConfigError(f"the optimizer's lr is the base LR (LRScalingConfig.base_lr is None) and must "
                                  f"be > 0, got {first!r}; set it or LRScalingConfig.base_lr")
            # Groups keep their LR ratios to the first group; the rule sets the first.
            self._group_ratios = [g["lr"] / first if first else 1.0 for g in optimizer.param_groups]
            progress = self._worker.progress
            if progress.base_lr is None:
                progress.base_lr = rule.base_lr if rule.base_lr is not None else first
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
    def restore(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                **more: Any) -> int:
        """Load the latest state into the objects given, by name; call it once per generation,
        after preparing and before the first `report()`. Returns the step to continue from.

        `model` and `optimizer` default to the prepared ones when only one of each was
        prepared. Every other keyword is a module, an optimizer, or any object with
        `state_dict()`/`load_state_dict()` (an LR scheduler, an EMA, a GradScaler, your own
        counters): all of them survive rescales and resumes, under these names. FSDP models
        stay sharded; other objects are replicated (each rank holds the same state).

        Warm: broadcast from the survivor the controller chose. Checkpoint: the newest committed
        checkpoint, resharded to this world size. Fresh: nothing to load.
        """
        state = TrainState(self._named_objects(model, optimizer, more), progress=self._worker.progress,
                           precision=self._precision)
        self._ensure_lr_ramp()
        plan, worker = self._plan.restore, self._worker
        if plan.kind == "broadcast":
            self._restore_warm(state, plan.source_rank)
        elif plan.kind == "checkpoint":
            self._restore_checkpoint(state)
        else:
            # Nothing to load (e.g. FSDP lost a rank before its first commit): every rank starts
            # over from step 0, a survivor's counters included, or the ranks would disagree.
            worker.progress.reset()
            self._ensure_lr_ramp()
            worker.checkpoints.last_saved_step = None
        self._state = state
        worker.warm.state = state
        worker.warm.capable = self._spec.strategy == "ddp" and bool(state.modules())
        worker.warm.restored = (self.generation, self.step)
        worker.outbox.drop_after(self.step)
        log.info("rank %d generation %d restored %s (%s) at step %d",
                 self.rank, self.generation, sorted(state.objects), plan.kind, self.step)
        return self.step

    def _named_objects(self, model: Any, optimizer: Any, more: dict[str, Any]) -> dict[str, Any]:
        """restore()'s keywords by name, modules unwrapped; every prepared object must be among them."""
        def default(given: Any, prepared: list[Any], name: str) -> Any:
            if given is not None or len(prepared) <= 1:
                return given if given is not None else (prepared[0] if prepared else None)
            raise StateError(f"{len(prepared)} {name}s were prepared: name each one, e.g. "
                             f"ctx.restore(model=..., optimizer=..., {name}2=...)")
        unwrapped = {id(wrapped): raw for wrapped, raw in self._models}
        objects = {"model": default(model, [raw for _, raw in self._models], "model"),
                   "optimizer": default(optimizer, self._optimizers, "optimizer"), **more}
        objects = {n: unwrapped.get(id(o), o) for n, o in objects.items() if o is not None}
        seen: dict[int, str] = {}
        for name, obj in objects.items():
            if id(obj) in seen:
                raise StateError(f"ctx.restore got the same object as {seen[id(obj)]!r} and {name!r}; pass it once")
            seen[id(obj)] = name
        lost = [f"model #{i}" for i, (_, raw) in enumerate(self._models) if id(raw) not in seen]
        lost += [f"optimizer #{i}" for i, o in enumerate(self._optimizers) if id(o) not in seen]
        if lost:
            raise StateError(f"{', '.join(lost)} (in the order prepared) were prepared but not handed to "
                             f"ctx.restore: their state would be lost at the next rescale; pass them by name, "
                             f"e.g. ctx.restore(model=model, optimizer=opt, teacher=teacher)")
        return objects

    def _restore_warm(self, state: TrainState, src: int | None) -> None:
        payload = None
        if self.rank == src:
            source = self._worker.warm
            if not source.available:
                raise ElasticError(f"rank {src} was chosen as warm source but holds no state")
            payload = source.state.state_dict()
        payload = broadcast_state(payload, src, self._comm_device)
        state.load_state_dict(payload, source=f"the in-memory state of rank {src}")

    def _restore_checkpoint(self, state: TrainState) -> None:
        session = self._worker.checkpoints
        loaded_state, loaded = _wrap.load_with_compression_state(
            self._checkpoints(), self._compression, self.rank, self.world_size, self._comm_device,
            lambda with_keys: state.state_dict(extra=with_keys))
        if loaded is None:
            log.warning("rank %d: no committed checkpoint under %s; starting fresh", self.rank, self._spec.storage)
            self._worker.progress.reset()
            self._ensure_lr_ramp()
            return
        state.load_state_dict(loaded_state, source=f"checkpoint step {loaded.step} at {loaded.path}")
        session.load_fallbacks.extend(dict(s) for s in loaded.skipped)
        session.last_saved_step = self.step
        if self.generation == 0 and session.resumed_from is None:
            session.resumed_from = self.step

    def _ensure_lr_ramp(self) -> None:
        """The LR rule's state exists before anything is saved or loaded, so a checkpoint always
        holds it and a load always asks for it."""
        progress, rule = self._worker.progress, self._spec.lr
        if rule is not None and progress.lr_ramp is None:
            progress.lr_ramp = ScaleRamp.initial(self.world_size, rule.base_world_size)

    def _checkpoints(self):
        return _checkpoint_io.open_manager(self._worker.checkpoints, self._spec)

    def _require_state(self, where: str) -> TrainState:
        if self._state is None:
            raise RestoreRequiredError(
                f"{where} before ctx.restore() in generation {self.generation} (rank {self.rank}): call "
                f"ctx.restore(model=..., optimizer=..., ...) once per generation, after preparing and before "
                f"the first step; without it a resume or a rescale would retrain from step 0")
        return self._state

    def save_checkpoint(self, *, wait: bool = False) -> None:
        """Collective: commit a checkpoint of the current step (async unless `wait`)."""
        state = self._require_state("ctx.save_checkpoint()")
        session, step = self._worker.checkpoints, self.step
        if session.nonfinite_step == step:
            # A state trained into a NaN/inf loss must never replace the last good checkpoint.
            log.warning("rank %d: no checkpoint of step %d, whose loss was not finite", self.rank, step)
            return
        payload = state.state_dict(extra={"world_size": self.world_size,
                                          **_wrap.compression_extra(self._compression, self.rank)})
        manager = self._checkpoints()
        session.save_started[step] = time.time()
        manager.save(step, payload, generation=self.generation)
        session.last_saved_step = session.unconfirmed_save = step
        if wait:
            manager.wait()
        self._export_commit()

    def _commit_before_leaving(self) -> None:
        """Commit this step and make sure it is committed: the group is about to change and this
        state will not be in memory to retry with. A failed commit is raised, not left behind
        unseen (the recovery then counts the steps it loses)."""
        session, step = self._worker.checkpoints, self.step
        self.save_checkpoint(wait=True)
        commit = session.manager.last_commit if session.manager is not None else None
        if session.nonfinite_step != step and (commit is None or commit.step != step):
            from checkpointing import CheckpointError
            error = session.manager.last_error if session.manager is not None else None
            session.last_saved_step = commit.step if commit is not None else None
            raise CheckpointError(f"the checkpoint of step {step}, taken before the group changes, was not "
                                  f"committed: {error}", url=self._spec.storage) from error

    def _export_commit(self) -> None:
        """Rank 0: checkpoint seconds and bytes of a commit it has learnt of, to Ray metrics."""
        session = self._worker.checkpoints
        commit = session.manager.last_commit if session.manager is not None else None
        if self.rank != 0 or commit is None or commit.step == session.exported_commit:
            return
        session.exported_commit = commit.step
        started = session.save_started.pop(commit.step, commit.committed_at)
        session.save_started = {s: t for s, t in session.save_started.items() if s > commit.step}
        try:
            from elastic._ray_metrics import checkpoint_committed
            checkpoint_committed(self._spec.storage, commit.committed_at - started, commit.total_bytes)
        except Exception:   # noqa: BLE001 - metrics are best effort; never fail a step for them
            log.debug("exporting checkpoint metrics failed", exc_info=True)

    # ---- step boundary --------------------------------------------------------------
    def _begin_step(self, global_batch: int, sample_ids: list[int]) -> None:
        self._global_batch = global_batch
        self._step_ids = sample_ids
        self._worker.progress.pending_samples = global_batch
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Set this step's LR from the rule: a function of the step and the world-size history."""
        rule, progress = self._spec.lr, self._worker.progress
        if rule is None or not self._optimizers or progress.base_lr is None:
            return
        step = progress.step
        ramp = progress.lr_ramp or ScaleRamp.initial(self.world_size, rule.base_world_size)
        progress.lr_ramp = ramp.rescaled(step, self.world_size, rule.base_world_size, rule.rescale_warmup_steps)
        lr = rule_lr(rule, base_lr=progress.base_lr, ramp=progress.lr_ramp, step=step, total_steps=self.total_steps)
        for group, ratio in zip(self._optimizers[0].param_groups, self._group_ratios):
            group["lr"] = lr * ratio

    def report(self, **metrics: Any) -> None:
        """End of a step: count it, share the metrics, checkpoint when due, unwind on rescale.

        Call it once per batch, after `optimizer.step()`, with no collective in between. Every
        numeric keyword (a number or a one-element tensor) reaches metrics.jsonl as the mean over
        ranks (`loss` included; `lr` as this rank has it). For a sum or a max, reduce it yourself
        first (`dist.all_reduce(t, op=SUM)`): every rank then reports the same value. Every rank
        must report the same names. With gradient accumulation a non-final micro-batch's report
        only notes its loss.
        """
        self._require_state("ctx.report()")
        accumulation = self._accumulation
        if accumulation is not None and accumulation.defer_report(as_float(metrics.get("loss"))):
            return
        names, values = _numeric_metrics(metrics, skip=frozenset({"loss", "lr"}))
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
            (self._optimizers[0].param_groups[0]["lr"] if self._optimizers else None)
        loss = metrics.get("loss")
        loss_value = accumulation.mean_loss() if accumulation is not None else (as_float(loss) or 0.0)
        # One small all-gather per step carries every rank's loss, rescale flag, preemption
        # flag, compute time and metrics, so every rank leaves the loop at the same step and every
        # rank can record the means and the ranks' compute times (straggler scoring). Fixed size
        # (MAX_METRICS slots), whatever the names: ranks that disagree are caught by the names' hash.
        mine = torch.zeros(_HEADER + MAX_METRICS, dtype=torch.float64)
        mine[:_HEADER] = torch.tensor([loss_value, float(self._stop_requested.is_set()),
                                       float(self._preempted.is_set()), self._timer.compute_s(),
                                       float(mix_seed("metrics", names) & ((1 << 52) - 1))], dtype=torch.float64)
        mine[_HEADER:_HEADER + len(values)] = torch.tensor(values, dtype=torch.float64)
        mine = mine.to(self._comm_device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, mine)
        except BaseException:
            # The update is applied: this state may be the one the group restores (warm), so the
            # step keeps a record, with this rank's own values (the others' never arrived).
            self._keep_record(dict(zip(names, values)), lr, loss_value if loss is not None else None, ())
            raise
        shared = torch.stack(gathered).cpu()
        if bool((shared[:, 4] != shared[0, 4]).any()):
            raise StateError(f"ctx.report() at step {self.step}: the ranks reported different metric names "
                             f"(rank {self.rank}: {list(names)}); report the same names on every rank, and "
                             f"rank-local values through ctx.log()")
        means = shared[:, _HEADER:_HEADER + len(names)].mean(dim=0).tolist()
        stop, preempted = bool(shared[:, 1].max() > 0), bool(shared[:, 2].max() > 0)
        # Every rank keeps the record (same all-gathered values): if rank 0 dies before the
        # controller polls it, a survivor still has the step.
        mean_loss = float(shared[:, 0].sum()) / self.world_size if loss is not None else None
        self._keep_record(dict(zip(names, means)), lr, mean_loss, tuple(round(float(c), 6) for c in shared[:, 3]))
        session = self._worker.checkpoints
        if mean_loss is not None and not math.isfinite(mean_loss):
            session.nonfinite_step = progress.step
            if self._spec.on_nonfinite_loss == "fail":
                # Every rank raises the same error at the same step (the values are all-gathered).
                raise NonFiniteLossError(
                    f"the loss of step {progress.step} is {mean_loss} (mean over {self.world_size} ranks); no "
                    f"checkpoint was committed from it. Lower the learning rate, clip gradients or check the "
                    f"data; FailureConfig.on_nonfinite_loss='ignore' trains on")
        every = self._spec.checkpoint_every
        if every is not None and progress.step % every == 0 and progress.step < self.total_steps:
            self.save_checkpoint()
        if preempted and session.last_saved_step != progress.step:
            # A rank got its preemption notice: commit this step before it leaves.
            self._commit_before_leaving()
        if stop or preempted:
            if not self._worker.warm.capable and session.last_saved_step != progress.step:
                # FSDP shards cannot be re-broadcast after the group changes: commit them first.
                self._commit_before_leaving()
            raise RescaleInterrupt()
        self._timer.start()

    def log(self, **metrics: Any) -> None:
        """Record metrics at the current step without counting a step (validation, eval).

        Local to this rank, no collective: call it on one rank, or on every rank with the same
        values (one record of a step is kept). Numbers and one-element tensors only."""
        names, values = _numeric_metrics(metrics, reserved=RESERVED_METRICS | {"loss", "lr"})
        progress = self._worker.progress
        self._worker.outbox.put(StepRecord(
            step=progress.step, loss=None, world_size=self.world_size, time=time.time(),
            samples_seen=progress.samples_seen, global_batch=self._global_batch, metrics=dict(zip(names, values)),
            generation=self.generation, kind="log"))

    def _keep_record(self, metrics: dict[str, float], lr: float | None, loss: float | None,
                     compute_s: tuple[float, ...]) -> None:
        progress = self._worker.progress
        if lr is not None:
            metrics = {**metrics, "lr": lr}
        self._worker.outbox.put(StepRecord(
            step=progress.step, loss=loss, world_size=self.world_size, time=time.time(),
            samples_seen=progress.samples_seen, global_batch=self._global_batch, metrics=metrics,
            compute_s=compute_s, data_order=progress.data_order, generation=self.generation,
            accum_steps=self.accum_steps))
        if not self._first_step_announced:
            # The generation's first step ends a recovery: the controller hears it at once,
            # not when the held poll would have come back anyway.
            self._first_step_announced = True
            self._worker.outbox.news.set()

    def _confirm_final_commit(self) -> None:
        """A run is finished only once its final state is committed. Every rank learns the
        commit's outcome from rank 0 (checkpointing broadcasts it): if rank 0 was lost mid-commit
        or storage refused it, this rank reports that failure instead of a finish, and the run
        recovers and commits the final step again."""
        session, step = self._worker.checkpoints, self.step
        if session.unconfirmed_save != step:
            return
        commit = session.manager.last_commit
        if commit is None or commit.step != step:
            session.last_saved_step = commit.step if commit is not None else None
            from checkpointing import CheckpointError
            raise session.manager.last_error or CheckpointError(
                f"the final checkpoint of step {step} was not committed", url=self._spec.storage)
        session.unconfirmed_save = None

    def _finish(self) -> str | None:
        """After the loop: commit the final state and hash the full models (collective)."""
        if self._state is None:
            if self._models or self._optimizers:
                self._require_state("train_loop returned")
            return None
        session = self._worker.checkpoints
        if session.last_saved_step != self.step:
            self.save_checkpoint(wait=True)
        if session.manager is not None:
            session.manager.wait()
            self._export_commit()
            self._confirm_final_commit()
        modules = self._state.modules()
        if not modules:
            return None
        full = {name: _checkpoint_io.full_model_state(m) if self._spec.strategy == "fsdp" else m.state_dict()
                for name, m in modules.items()}
        if self.rank != 0:
            return None
        # One model: the hash of its own state dict (as before several models were possible).
        if len(full) == 1:
            return state_sha256(next(iter(full.values())))
        return state_sha256({f"{name}.{key}": v for name, sd in full.items() for key, v in sd.items()})


def _numeric_metrics(metrics: dict[str, Any], *, skip: frozenset[str] = frozenset(),
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
    return tuple(names), [as_float(metrics[n]) for n in names]

"""TrainContext: what the user's train_loop sees on each rank, for one generation.

A generation is one formation of the process group. When the controller rescales, the loop is
unwound at a step boundary (`report`) and re-entered with a new context. This class is the
user's face only; the work is done by the worker-side parts it holds:
- `StepBoundary` (elastic/_worker/step_boundary.py): opens and closes steps, shares the metrics;
- `StateKeeper` (elastic/_worker/keeping.py): the checkpoints, FSDP's copies in memory, the commit
  before the group changes and the final one;
- `Restorer` (elastic/_worker/restore.py): the recovery ladder's rungs into the generation's state;
- `TrainState` (elastic/_worker/train_state.py): what `restore(...)` was handed, the one object that
  warm broadcasts and checkpoints both save and load;
- `WorkerState` (elastic/_worker/state.py): what outlives the generation, incl. the
  `CheckpointSession` (elastic/_worker/checkpoint_session.py) with the rules around commits.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elastic._determinism import mix_seed
from elastic._protocol import GenerationPlan, RunSpec
from elastic._worker import fault_gate as _fault_gate
from elastic._worker import grad_norm as _grad_norm
from elastic._worker import ray_data as _ray_data
from elastic._worker import spot_check as _spot_check
from elastic._worker import thread_position as _thread_position
from elastic._worker import wrap as _wrap
from elastic._worker.accumulation import wrap_optimizer
from elastic._worker.keeping import StateKeeper
from elastic._worker.loader import ElasticLoader, check_options
from elastic._worker.mesh import GenerationMesh
from elastic._worker.pipeline import Pipeline, build_pipeline, unpipelined
from elastic._worker.precision import Precision
from elastic._worker.restore import Restorer, named_objects
from elastic._worker.state import WorkerState
from elastic._worker.step_boundary import StepBoundary
from elastic._worker.train_state import TrainState
from elastic.errors import ConfigError, NonFiniteLossError, RestoreRequiredError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class RescaleInterrupt(BaseException):
    """Unwinds the user's loop at a step boundary when the controller re-forms the group.

    A BaseException, so a user's `except Exception` does not swallow it.
    """


class RankPlace:
    """Where a rank is in its generation: its rank, its node, its replica and TP rank (the
    identity part of TrainContext)."""

    _plan: GenerationPlan
    _mesh: GenerationMesh

    @property
    def rank(self) -> int:
        return self._plan.rank

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's replica: the data-parallel rank its batches and its randomness follow."""
        return self._mesh.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: replicas of tp_size ranks (world_size without tensor parallelism)."""
        return self._mesh.layout.dp

    @property
    def tp_rank(self) -> int:
        return self._mesh.tp_rank

    @property
    def tp_size(self) -> int:
        """ScalingConfig.tensor_parallel_size: ranks per replica."""
        return self._mesh.layout.tp

    @property
    def pp_rank(self) -> int:
        """The pipeline stage this rank runs (its first, under an interleaved schedule)."""
        return self._mesh.pp_rank

    @property
    def pp_size(self) -> int:
        """ScalingConfig.pipeline_parallel_size: stages per replica."""
        return self._mesh.layout.pp

    @property
    def mesh(self) -> DeviceMesh:
        """The generation's DeviceMesh: (dp_replicate, tp) under "ddp", (dp_shard, tp) under "fsdp",
        (dp_replicate, dp_shard, tp) under "hsdp", as torchtitan names them; with pipeline
        parallelism (data-parallel, pp, tp). Built at its first use, a collective: use it on every
        rank (prepare_model and prepare_pipeline build it)."""
        return self._mesh.mesh()

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


class TrainContext(RankPlace):
    """Per-rank handle given to `train_loop(ctx)`; re-created after every rescale."""

    def __init__(self, *, plan: GenerationPlan, spec: RunSpec, worker: WorkerState, loop_config: Any,
                 stop_requested: threading.Event, preempted: threading.Event, device: torch.device,
                 commit_requested: threading.Event | None = None, mesh: GenerationMesh | None = None):
        self._plan, self._spec, self._worker, self._loop_config = plan, spec, worker, loop_config
        self.device = device
        self._preempted = preempted
        # The worker's, formed with the group (elastic._worker.worker); a context made alone makes its own.
        self._mesh = mesh or GenerationMesh(rank=plan.rank, world_size=plan.world_size, scaling=spec.scaling,
                                            device=device)
        self._boundary = StepBoundary(plan=plan, spec=spec, worker=worker, device=device, layout=self._mesh.layout,
                                      stop_requested=stop_requested, preempted=preempted,
                                      commit_requested=commit_requested)
        self._restorer = Restorer(plan=plan, spec=spec, worker=worker, mesh=self._mesh,
                                  comm_device=device if spec.scaling.use_gpu else torch.device("cpu"))
        self._keeper = StateKeeper(plan=plan, spec=spec, worker=worker, boundary=self._boundary, mesh=self._mesh,
                                   device=device)
        self._models: list[tuple[nn.Module, nn.Module]] = []   # (as returned to the user, unwrapped)
        self._spot_check: _spot_check.SpotCheck | None = None    # set by restore()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._scaling = spec.scaling
        if worker.grad_scaler is None:
            worker.grad_scaler = Precision.new_scaler(self._scaling.precision, device)
        self._precision = Precision(self._scaling.precision, spec.scaling.strategy, device, worker.grad_scaler)
        self._ray_datasets = 0        # ray.data.Datasets prepared so far in this generation (prepare_data)

    @property
    def _state(self) -> TrainState | None:
        """What restore() loaded (None before): the keeper's, which saves and copies it."""
        return self._keeper.state

    @property
    def _compression(self) -> _wrap.PowerSGDCompression | None:
        """The PowerSGD state checkpoints carry (the first compressed model's)."""
        return self._keeper.compression

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
        return self._boundary.accum_steps

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
    def prepare_model(self, model: nn.Module, *, shard_modules: list[nn.Module] | None = None,
                      parallelize: Callable[[nn.Module, DeviceMesh], Any] | None = None) -> nn.Module:
        """Move the model to this rank's device and wrap it: DDP (with the gradient compression
        hook of ScalingConfig), or FSDP2 `fully_shard` (with its precision and memory options).

        With FSDP, each module in `shard_modules` (default: every child of every ModuleList,
        i.e. the transformer blocks) becomes its own shard unit, then the root. Several models
        may be prepared (GAN, teacher/student); hand each to `restore` under a name of its own.
        Models that are not trained across ranks (an EMA copy) need no preparing: move them to
        `ctx.device` and hand them to `restore`.

        With ScalingConfig.tensor_parallel_size T > 1, `parallelize(model, tp_mesh)` applies the
        user's TP plan (torch's `parallelize_module` with Colwise/Rowwise/SequenceParallel styles)
        on the replica's T ranks; then the data-parallel dimension is wrapped (strategy "ddp":
        FSDP2's replicate; "fsdp": fully_shard on dp_shard; "hsdp": fully_shard on (dp_replicate,
        dp_shard), at T = 1 too). At T = 1 `parallelize` is not called
        (there is nothing to split), so one script serves both and a checkpoint moves between them.
        """
        if self._mesh.pipelined:
            raise ConfigError(f"ScalingConfig.pipeline_parallel_size={self.pp_size} splits the model into stages: "
                              f"prepare it with ctx.prepare_pipeline(model, split_points=..., loss_fn=..., "
                              f"microbatches=...) instead of ctx.prepare_model")
        self._require_plan(parallelize, "prepare_model(model, parallelize=fn)")
        wrapped = self._wrap(model.to(self.device), parallelize, shard_modules)
        self._models.append((wrapped, model))
        return wrapped

    def prepare_pipeline(self, model: nn.Module, *, split_points: list[str],
                         loss_fn: Callable[[Any, Any], torch.Tensor], microbatches: int, schedule: str = "1f1b",
                         stages_per_rank: int | None = None,
                         parallelize: Callable[[nn.Module, DeviceMesh], Any] | None = None,
                         shard_modules: list[nn.Module] | None = None) -> Pipeline:
        """Split the whole `model` into pipeline stages (ScalingConfig.pipeline_parallel_size P),
        keep this rank's, wrap each like prepare_model and build the schedule. Returns the
        `Pipeline`: hand it to the optimizer and to `restore` as the model, and train with
        `loss = pipeline.step(inputs, targets)`, which runs forward and backward over
        `microbatches` micro-batches of the batch (every rank of a replica passes the same batch;
        the loss is the batch's mean, on every stage: the pipeline's stages agree on it before
        any applies the step, so a pipeline steps whole or not at all).

        `split_points`: the unit each stage after the first begins with. Units are the root's
        children in forward order, ModuleLists opened ("blocks.4"); P - 1 of them (P x V - 1
        under an interleaved schedule of V `stages_per_rank`, default 2). A stage is the model
        with the other units set to None, so its forward must skip a None child; parameters keep
        their whole-model names, so checkpoints move between values of P.
        `loss_fn(output, target)`: the mean loss of a micro-batch. `schedule`: "gpipe", "1f1b" or
        "interleaved1f1b" (torch.distributed.pipelining's). `parallelize`, `shard_modules`: as
        for prepare_model, applied to each stage. At P = 1 nothing is split: the whole model is
        prepared and `step` is its forward and backward, so one loop serves every P.
        """
        self._require_plan(parallelize, "prepare_pipeline(model, ..., parallelize=fn)")
        if not self._mesh.pipelined:
            wrapped = self._wrap(model.to(self.device), parallelize, shard_modules)
            pipeline = unpipelined(model, wrapped, loss_fn=loss_fn, autocast=self.autocast, backward=self.backward)
        else:
            def wrap_stage(stage: nn.Module) -> nn.Module:
                mine = None if shard_modules is None else [m for m in shard_modules
                                                           if any(m is x for x in stage.modules())]
                return _wrap.wrap_tensor_parallel(stage, generation_mesh=self._mesh, scaling=self._scaling,
                                                  parallelize=parallelize, shard_modules=mine)
            pipeline = build_pipeline(model, mesh=self._mesh, device=self.device, split_points=split_points,
                                      loss_fn=loss_fn, microbatches=microbatches, schedule=schedule,
                                      stages_per_rank=stages_per_rank, wrap=wrap_stage, autocast=self.autocast)
            self._boundary.sync_model = self._boundary.sync_model or pipeline
        self._models.append((pipeline, pipeline))
        return pipeline

    def _require_plan(self, parallelize: Any, call: str) -> None:
        if parallelize is None and self.tp_size > 1:
            raise ConfigError(f"ScalingConfig.tensor_parallel_size={self.tp_size} needs the model's TP plan: "
                              f"ctx.{call}, fn(model, tp_mesh) applying parallelize_module to it")

    def _wrap(self, model: nn.Module, parallelize: Any, shard_modules: list[nn.Module] | None) -> nn.Module:
        """The prepared model on this rank's device, for ScalingConfig."""
        compression = None
        if self._mesh.meshed:          # T > 1, or HSDP (its 2-D data-parallel mesh) at any T
            wrapped = _wrap.wrap_tensor_parallel(model, generation_mesh=self._mesh, scaling=self._scaling,
                                                 parallelize=parallelize, shard_modules=shard_modules)
        else:
            # The same PowerSGD seed on every rank: its random projections must match across ranks.
            wrapped, compression = _wrap.wrap_model(
                model, device=self.device, world_size=self.world_size, scaling=self._scaling,
                timer=self._boundary.timer, seed=mix_seed(self.seed, "powersgd", len(self._models)),
                shard_modules=shard_modules)
        self._boundary.sync_model = self._boundary.sync_model or wrapped
        # Checkpoints carry one PowerSGD state per rank: the first compressed model's.
        self._keeper.compression = self._keeper.compression or compression
        return wrapped

    def autocast(self):
        """Around forward and loss: autocast to ScalingConfig.precision (see elastic._worker.precision)."""
        return self._precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled by the GradScaler under fp16 (required there)."""
        self._precision.backward(loss)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every prepared model by their global norm, as
        `torch.nn.utils.clip_grad_norm_` does on one unsplit model, on any layout: DDP, FSDP2,
        FSDP x TP (where torch's own fails on gradients that live on different meshes) and
        pipeline stages (their norms are combined). Call it between the backward and
        `optimizer.step()`; under fp16 it unscales the gradients first. Returns the norm before
        clipping, the same on every rank."""
        self._precision.unscale(self._optimizers)
        parameters = [p for wrapped, _ in self._models for p in wrapped.parameters()]
        pp_group = self._mesh.pp_group() if self._mesh.pipelined else None
        return _grad_norm.clip_grad_norm_(parameters, max_norm, norm_type, pp_group)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register the optimizer: the LR rule and gradient accumulation act on it (the first one
        prepared carries the LR rule). Hand it to `restore` so its state survives."""
        self._optimizers.append(optimizer)
        self._precision.prepare_optimizer(optimizer)
        rule, first_prepared = self._spec.lr, self._boundary.lr_optimizer is None
        if first_prepared:
            self._boundary.lr_optimizer = optimizer     # its LR is the one metrics.jsonl records
        if rule is not None and first_prepared:
            first = optimizer.param_groups[0]["lr"]
            if rule.base_lr is None and not first > 0:
                raise ConfigError(f"the optimizer's lr is the base LR (LRScalingConfig.base_lr is None) and must "
                                  f"be > 0, got {first!r}; set it or LRScalingConfig.base_lr")
            # Groups keep their LR ratios to the first group; the rule sets the first.
            self._boundary.group_ratios = [g["lr"] / first if first else 1.0 for g in optimizer.param_groups]
            progress = self._worker.progress
            if progress.base_lr is None:
                progress.base_lr = rule.base_lr if rule.base_lr is not None else first
        if self._boundary.accumulation is not None:
            wrap_optimizer(optimizer, self._boundary.accumulation)
        if first_prepared:
            # The parameters' fingerprint before each update (elastic._worker.step_boundary): a
            # pre-hook of the optimizer's own step runs on real steps only (not on an accumulation's
            # skipped micro-steps). One per optimizer object: a loop that prepares the same one
            # again in a new generation replaces the old generation's.
            previous = optimizer.__dict__.pop("_elastic_before_update", None)
            if previous is not None:
                previous.remove()
            boundary = self._boundary
            optimizer.__dict__["_elastic_before_update"] = optimizer.register_step_pre_hook(
                lambda *_: boundary.before_update())
        return optimizer

    def prepare_data(self, dataset: Any, batch_size: int, *, shuffle: bool = True,
                     collate_fn: Callable[[list[Any]], Any] | None = None, **loader_options: Any) -> ElasticLoader:
        """A loader of this rank's batches from the current step to `total_steps`.

        `dataset`: a map-style dataset (`__len__`, `__getitem__` by index), such as
        `elastic.ParquetTokens`, or a `ray.data.Dataset`, which is materialized once per run into
        the object store and read by row index (its rows are dicts of numpy values, batched into
        dicts of tensors; elastic._worker.ray_data). Iterables (a torch IterableDataset, a
        generator, a Ray DataIterator) are refused with a ConfigError: they can be neither
        sharded by rank nor resumed mid-epoch.

        `loader_options` (num_workers, pin_memory, prefetch_factor, ...) go to the torch
        DataLoader that builds the batches; see ElasticLoader. A Ray Dataset takes num_workers=0
        only (worker processes have no Ray connection)."""
        if _ray_data.is_ray_dataset(dataset):
            check_options(loader_options)
            _ray_data.check_loader_options(loader_options)
            # Numbered by the order of the calls in the loop, the same in every generation: every
            # rank, and a replacement, finds the one materialization of the run's n-th dataset.
            n, self._ray_datasets = self._ray_datasets, self._ray_datasets + 1
            dataset = _ray_data.open_rows(dataset, names=self._worker.run_names, n=n,
                                          storage=self._spec.checkpoint.storage)
        return ElasticLoader(self._boundary, dataset, batch_size, shuffle=shuffle, collate_fn=collate_fn,
                             **loader_options)

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
        _thread_position.mark(_thread_position.ThreadPlace.RESTORING)   # never judged hung here (hang_watch)
        state = TrainState(named_objects(self._models, self._optimizers, model, optimizer, more),
                           progress=self._worker.progress, precision=self._precision)
        started = time.monotonic()
        restored = self._restorer.restore(state, self._compression)
        self._keeper.state = state
        if self._spec.failure.sdc_check and self._spec.scaling.strategy in ("ddp", "hsdp") and state.modules():
            # Silent corruption: each step's fingerprint is of the parameters of every module
            # restored, compared between the same positions of the units (elastic._worker.fingerprint).
            self._boundary.fingerprinted = self._parameters
            self._boundary.replica_unit = self._mesh.unit
            self._boundary.clean_through = self.step     # restored alike on every replica
        # Compute corruption: the first prepared model's spot check (elastic._worker.spot_check).
        if self._spot_check is not None:
            self._spot_check.close()
        self._spot_check = _spot_check.for_generation(
            self._models, spec=self._spec, plan=self._plan, layout=self._mesh.layout, worker=self._worker,
            restored=restored, device=self.device, autocast=self.autocast)
        # No copy in memory here: the survivors' copies of the previous generation stay until
        # this one's first K-step boundary (see elastic._worker.replicas).
        # The generation's first step record carries it (the run's time ledger: restore).
        self._boundary.restore_s = time.monotonic() - started
        return self.step

    def _parameters(self) -> list[torch.Tensor]:
        """The restored modules' parameters, in order (the fault gate's bit flip)."""
        state = self._keeper.state
        return [p for m in state.modules().values() for p in m.parameters()] if state is not None else []

    def _require_state(self, where: str) -> TrainState:
        if self._state is None:
            raise RestoreRequiredError(
                f"{where} before ctx.restore() in generation {self.generation} (rank {self.rank}): call "
                f"ctx.restore(model=..., optimizer=..., ...) once per generation, after preparing and before "
                f"the first step; without it a resume or a rescale would retrain from step 0")
        return self._state

    def save_checkpoint(self, *, wait: bool = False) -> None:
        """Collective: commit a checkpoint of the current step (async unless `wait`)."""
        self._require_state("ctx.save_checkpoint()")
        self._keeper.save(wait=wait)

    # ---- step boundary --------------------------------------------------------------
    def report(self, **metrics: Any) -> None:
        """End of a step: count it, share the metrics, checkpoint when due, unwind on rescale.

        Call it once per batch, after `optimizer.step()`, with no collective in between. Every
        numeric keyword (a number or a one-element tensor) reaches metrics.jsonl as the mean over
        ranks (`loss` included; `lr` as this rank has it). For a sum or a max, reduce it yourself
        first (`dist.all_reduce(t, op=SUM)`): every rank then reports the same value. Every rank
        must report the same names. With gradient accumulation a non-final micro-batch's report
        only notes its loss.

        Nothing here waits for the other ranks, nor on a GPU for the device, on a step with
        nothing to do: the step's values are exchanged in the background (on the device, on a
        GPU) and read at the next report. The group acts on them at the next report: a rescale
        or a preemption notice unwinds the loop one step after it arrives, on every rank at the
        same step (see elastic._worker.step_boundary).
        """
        self._require_state("ctx.report()")
        outcome = self._boundary.end_step(metrics)
        if outcome is None:
            return
        if self._spot_check is not None and self._spot_check.due(self.step):
            # The parameters' verdict first (a flipped bit in one rank's parameters makes its
            # recompute differ too; the fingerprint names the step exactly), then the compute's,
            # both before the step's checkpoint: committed only if they pass.
            with _thread_position.waiting(_thread_position.ThreadPlace.EXCHANGE):
                self._boundary.settle()
            self._spot_check.check(self.step)
        if self._keeper.after_step(outcome):      # the group leaves the loop (committed first if it must)
            self._boundary.settle()   # this step's record, before the loop unwinds
            raise RescaleInterrupt()
        _fault_gate.hold_after(self.step, self._loop_config, settle=self._boundary.settle,  # tests only: fault_gate
                               params=self._parameters)
        self._boundary.timer.start()

    def _abandon(self) -> NonFiniteLossError | None:
        """The loop failed (a broken group, the user's error): keep the records of the steps
        whose exchange is still pending, without waiting on the group (see StepBoundary.abandon);
        the error of a pending step whose loss was not finite, to report instead."""
        return self._boundary.abandon()

    def log(self, **metrics: Any) -> None:
        """Record metrics at the current step without counting a step (validation, eval).

        Local to this rank, no collective: call it on one rank, or on every rank with the same
        values (one record of a step is kept). Numbers and one-element tensors only."""
        self._boundary.log(metrics)

    def _finish(self) -> str | None:
        """After the loop: commit the final state and hash the full models (collective)."""
        if self._state is None:
            if self._models or self._optimizers:
                self._require_state("train_loop returned")
            return None
        return self._keeper.finish()

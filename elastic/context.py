"""TrainContext: what the user's train_loop sees on each rank, for one generation.

A generation is one formation of the process group. When the controller rescales, the loop is
unwound at a step boundary (`report`) and re-entered with a new context. This class is the
user's face only; the work is done by the worker-side parts it holds:
- `StepBoundary` (elastic/_worker/step_boundary.py): opens and closes steps, shares the metrics;
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
from typing import Any

import torch
from torch import nn

from elastic._determinism import mix_seed, state_sha256
from elastic._protocol import GenerationPlan, RunSpec
from elastic._worker import checkpoint_io as _checkpoint_io
from elastic._worker import fault_gate as _fault_gate
from elastic._worker import thread_position as _thread_position
from elastic._worker import wrap as _wrap
from elastic._worker.accumulation import wrap_optimizer
from elastic._worker.loader import ElasticLoader
from elastic._worker.precision import Precision
from elastic._worker.restore import Restorer, named_objects
from elastic._worker.state import WorkerState
from elastic._worker.step_boundary import StepBoundary, StepOutcome
from elastic._worker.train_state import TrainState
from elastic.errors import ConfigError, NonFiniteLossError, RestoreRequiredError


class RescaleInterrupt(BaseException):
    """Unwinds the user's loop at a step boundary when the controller re-forms the group.

    A BaseException, so a user's `except Exception` does not swallow it.
    """


class TrainContext:
    """Per-rank handle given to `train_loop(ctx)`; re-created after every rescale."""

    def __init__(self, *, plan: GenerationPlan, spec: RunSpec, worker: WorkerState, loop_config: Any,
                 stop_requested: threading.Event, preempted: threading.Event, device: torch.device,
                 commit_requested: threading.Event | None = None):
        self._plan, self._spec, self._worker, self._loop_config = plan, spec, worker, loop_config
        self.device = device
        self._preempted = preempted
        self._boundary = StepBoundary(plan=plan, spec=spec, worker=worker, device=device,
                                      stop_requested=stop_requested, preempted=preempted,
                                      commit_requested=commit_requested)
        self._restorer = Restorer(plan=plan, spec=spec, worker=worker,
                                  comm_device=device if spec.scaling.use_gpu else torch.device("cpu"))
        self._models: list[tuple[nn.Module, nn.Module]] = []   # (as returned to the user, unwrapped)
        self._optimizers: list[torch.optim.Optimizer] = []
        self._state: TrainState | None = None                   # set by restore()
        self._scaling = spec.scaling
        if worker.grad_scaler is None:
            worker.grad_scaler = Precision.new_scaler(self._scaling.precision, device)
        self._precision = Precision(self._scaling.precision, spec.scaling.strategy, device, worker.grad_scaler)
        self._compression: _wrap.PowerSGDCompression | None = None

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
            model, device=self.device, world_size=self.world_size, scaling=self._scaling,
            timer=self._boundary.timer, seed=mix_seed(self.seed, "powersgd", len(self._models)),
            shard_modules=shard_modules)
        self._models.append((wrapped, model))
        self._boundary.sync_model = self._boundary.sync_model or wrapped
        # Checkpoints carry one PowerSGD state per rank: the first compressed model's.
        self._compression = self._compression or compression
        return wrapped

    def autocast(self):
        """Around forward and loss: autocast to ScalingConfig.precision (see elastic._worker.precision)."""
        return self._precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled by the GradScaler under fp16 (required there)."""
        self._precision.backward(loss)

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
        return optimizer

    def prepare_data(self, dataset: Any, batch_size: int, *, shuffle: bool = True,
                     collate_fn: Callable[[list[Any]], Any] | None = None, **loader_options: Any) -> ElasticLoader:
        """A loader of this rank's batches from the current step to `total_steps`.

        `loader_options` (num_workers, pin_memory, prefetch_factor, ...) go to the torch
        DataLoader that builds the batches; see ElasticLoader."""
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
        self._restorer.restore(state, self._compression)
        self._state = state
        # No copy in memory here: the survivors' copies of the previous generation stay until
        # this one's first K-step boundary (see elastic._worker.replicas).
        # The generation's first step record carries it (the run's time ledger: restore).
        self._boundary.restore_s = time.monotonic() - started
        return self.step

    def _require_state(self, where: str) -> TrainState:
        if self._state is None:
            raise RestoreRequiredError(
                f"{where} before ctx.restore() in generation {self.generation} (rank {self.rank}): call "
                f"ctx.restore(model=..., optimizer=..., ...) once per generation, after preparing and before "
                f"the first step; without it a resume or a rescale would retrain from step 0")
        return self._state

    def save_checkpoint(self, *, wait: bool = False) -> None:
        """Collective: commit a checkpoint of the current step (async unless `wait`)."""
        _thread_position.mark(_thread_position.ThreadPlace.CHECKPOINT)   # never judged hung here (hang_watch)
        state = self._require_state("ctx.save_checkpoint()")
        # The steps' losses are known before their state is saved: a non-finite one is never committed.
        self._boundary.settle()
        # The held poll answers now, with the records of every step up to this one: a step must
        # reach the controller before its commit can. Were every rank to die after the commit
        # (a node, or a whole group, lost) with the records still held, the restored steps would
        # have no metrics.jsonl lines (steps of milliseconds fill a 1 s hold with 100 of them).
        self._worker.outbox.news.set()
        started = time.monotonic()
        payload, meta = state.checkpoint_payload(_wrap.compression_extra(self._compression, self.rank),
                                                 world_size=self.world_size)
        self._worker.checkpoints.save(self._spec, self.step, payload, generation=self.generation, wait=wait,
                                      meta=meta)
        if self.rank == 0:
            self._worker.checkpoints.export_commit()
        # What the loop was blocked for: the next step's record carries it (the run's time ledger).
        self._boundary.checkpoint_stall_s += time.monotonic() - started

    def _commit_before_leaving(self) -> None:
        """Commit this step and make sure it is committed: the group is about to change and this
        state will not be in memory to retry with. A failed commit is raised, not left behind
        unseen (the recovery then counts the steps it loses). The step's save may have been
        issued already (a scheduled one at this step): then it is waited for and checked alike."""
        session = self._worker.checkpoints
        if session.last_saved_step != self.step:
            self.save_checkpoint(wait=True)
        elif session.manager is not None:
            started = time.monotonic()
            session.manager.wait()
            self._boundary.checkpoint_stall_s += time.monotonic() - started
        session.check_committed(self.step)

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
        step = self.step
        every, in_memory = self._spec.checkpoint.every_n_steps, self._spec.in_memory_every
        if every is not None and step % every == 0 and step < self.total_steps:
            self.save_checkpoint()
        leaving = outcome.stop or outcome.preempted > 0
        if leaving:
            outcome = self._boundary.recount(outcome)
        if in_memory is not None and (step % in_memory == 0 or leaving) and step < self.total_steps:
            # FSDP's copies (every rank at the same steps: the swap is a collective); a group that
            # leaves together takes them at the step it leaves from, which the next one restores.
            # The loop waits for them like for a checkpoint save (the run's time ledger says so).
            started = time.monotonic()
            self._copy_to_memory()
            self._boundary.checkpoint_stall_s += time.monotonic() - started
        if leaving:
            if not self._stays_in_memory(outcome):
                self._commit_before_leaving()
            self._boundary.settle()   # this step's record, before the loop unwinds
            raise RescaleInterrupt()
        _fault_gate.hold_after(step, self._loop_config, settle=self._boundary.settle)   # tests only: see fault_gate
        self._boundary.timer.start()

    def _stays_in_memory(self, outcome: StepOutcome) -> bool:
        """Whether the group that leaves the loop (a rescale, `outcome.preempted` ranks with a
        notice) keeps the whole state of this step in the memory of the ranks that stay, so the
        re-formed group restores it without a commit first. A commit at a notice costs the
        seconds of a full save to storage (minutes for a large model) while the survivors already
        hold what it would write; what it would protect against, the survivors failing before the
        next scheduled commit, is the risk of any other step. DDP: every survivor holds a full
        replica. FSDP with copies in memory (just taken, at this leaving step): each rank's shards
        have one copy, at its ring neighbour, which covers one leaving rank. FSDP shards without
        copies cannot be rebuilt after the group changes. `elastic stop`, and a group that
        leaves whole, commit."""
        if outcome.commit or outcome.preempted >= self.world_size:
            return False
        if self._worker.warm.capable:
            return True
        # No copies are taken at the final step (the run commits it instead), so a group leaving
        # from it would restore older copies and redo steps: it commits, like `elastic stop`.
        return self._spec.in_memory_every is not None and outcome.preempted <= 1 and self.step < self.total_steps

    def _copy_to_memory(self) -> None:
        """Collective: this rank's state into host memory, and a copy to its ring neighbour."""
        assert self._state is not None
        self._worker.replicas.refresh(self._state, generation=self.generation, rank=self.rank,
                                      world_size=self.world_size, step=self.step,
                                      device=self.device if self._spec.scaling.use_gpu else torch.device("cpu"))

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
        self._boundary.settle()   # the last step's record
        session = self._worker.checkpoints
        if session.last_saved_step != self.step:
            self.save_checkpoint(wait=True)
        if session.manager is not None:
            session.manager.wait()
            if self.rank == 0:
                session.export_commit()
            session.confirm_final(self.step)
        modules = self._state.modules()
        if not modules:
            return None
        full = {name: _checkpoint_io.full_model_state(m) if self._spec.scaling.strategy == "fsdp" else m.state_dict()
                for name, m in modules.items()}
        if self.rank != 0:
            return None
        # One model: the hash of its own state dict (as before several models were possible).
        if len(full) == 1:
            return state_sha256(next(iter(full.values())))
        return state_sha256({f"{name}.{key}": v for name, sd in full.items() for key, v in sd.items()})

"""The rungs of the recovery ladder, on one rank: load a generation's TrainState from a
survivor's memory (warm), from the FSDP copies in the members' host memory (elastic._worker.replicas),
from the newest committed checkpoint, or start fresh.

Which rung a generation takes is the controller's decision (`GenerationPlan.restore`); this
module only carries it out, the same way on every rank, and names what it did in its errors.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from checkpointing import CheckpointError, StorageError
from elastic._credentials import mask_url
from elastic._protocol import GenerationPlan, ReplicaSource, RestoreKind, RestorePlan, RunSpec
from elastic._worker import wrap as _wrap
from elastic._worker.broadcast import broadcast_state
from elastic._worker.lr import ScaleRamp
from elastic._worker.mesh import GenerationMesh
from elastic._worker.replicas import Rebuild
from elastic._worker.state import WorkerState
from elastic._worker.train_state import EXTRA, FLAT, OPTIMIZER_KEYS, TrainState
from elastic._worker.warm_slices import send_slices
from elastic.errors import ElasticError, StateError

log = logging.getLogger("elastic.context")


def named_objects(models: list[tuple[nn.Module, nn.Module]], optimizers: list[torch.optim.Optimizer],
                  model: Any, optimizer: Any, more: dict[str, Any]) -> dict[str, Any]:
    """ctx.restore()'s keywords by name, modules unwrapped (`models`: (as returned, unwrapped)
    pairs of the prepared ones); every prepared model and optimizer must be among them."""
    def default(given: Any, prepared: list[Any], name: str) -> Any:
        if given is not None or len(prepared) <= 1:
            return given if given is not None else (prepared[0] if prepared else None)
        raise StateError(f"{len(prepared)} {name}s were prepared: name each one, e.g. "
                         f"ctx.restore(model=..., optimizer=..., {name}2=...)")
    unwrapped = {id(wrapped): raw for wrapped, raw in models}
    objects = {"model": default(model, [raw for _, raw in models], "model"),
               "optimizer": default(optimizer, optimizers, "optimizer"), **more}
    objects = {n: unwrapped.get(id(o), o) for n, o in objects.items() if o is not None}
    seen: dict[int, str] = {}
    for name, obj in objects.items():
        if id(obj) in seen:
            raise StateError(f"ctx.restore got the same object as {seen[id(obj)]!r} and {name!r}; pass it once")
        seen[id(obj)] = name
    lost = [f"model #{i}" for i, (_, raw) in enumerate(models) if id(raw) not in seen]
    lost += [f"optimizer #{i}" for i, o in enumerate(optimizers) if id(o) not in seen]
    if lost:
        raise StateError(f"{', '.join(lost)} (in the order prepared) were prepared but not handed to "
                         f"ctx.restore: their state would be lost at the next rescale; pass them by name, "
                         f"e.g. ctx.restore(model=model, optimizer=opt, teacher=teacher)")
    return objects


class Restorer:
    """Carries out one generation's restore plan into its TrainState."""

    def __init__(self, *, plan: GenerationPlan, spec: RunSpec, worker: WorkerState, mesh: GenerationMesh,
                 comm_device: torch.device):
        self._plan, self._spec, self._worker, self._comm_device = plan, spec, worker, comm_device
        self._mesh = mesh

    def restore(self, state: TrainState, compression: Any) -> RestorePlan:
        """Load `state` per the generation's plan; afterwards it is the worker's warm source."""
        plan, worker = self._plan.restore, self._worker
        self._ensure_lr_ramp()
        if plan.kind == RestoreKind.BROADCAST:
            assert plan.warm_sources, "a broadcast restore names its source ranks"
            self._warm(state, plan.warm_sources)
        elif plan.kind == RestoreKind.MEMORY:
            assert plan.replica is not None, "a memory restore names its sources"
            self._memory(state, plan.replica, plan.step)
        elif plan.kind == RestoreKind.CHECKPOINT:
            self._checkpoint(state, compression)
        else:
            # Nothing to load (e.g. FSDP lost a rank before its first commit): every rank starts
            # over from step 0, a survivor's counters included, or the ranks would disagree.
            self._start_over()
            worker.checkpoints.last_saved_step = None
        step = worker.progress.step
        worker.warm.state = state
        # DDP and HSDP hold each shard in more than one rank (replicas, shard groups); FSDP does not.
        worker.warm.capable = self._spec.scaling.strategy in ("ddp", "hsdp") and bool(state.modules())
        worker.warm.shard = (self._mesh.position, self._mesh.unit)
        worker.warm.restored = (self._plan.generation, step)
        worker.outbox.drop_after(step)
        log.info("rank %d generation %d restored %s (%s) at step %d",
                 self._plan.rank, self._plan.generation, sorted(state.objects), plan.kind, step)
        return plan

    def _warm(self, state: TrainState, sources: tuple[int, ...]) -> None:
        """Every source sends a slice to the ranks that lack the state (elastic._worker.warm_slices);
        a source loads its own copy, the others receive into their new objects' tensors.

        Under tensor parallelism a replica's ranks hold different shards: each TP rank's shard
        moves within its data-parallel group, from the sources of the same TP rank (the
        controller places every survivor at the TP rank of the shard it holds), as the local
        tensors of the DTensors, rewrapped on arrival (elastic._worker.warm_slices.localized).
        Under HSDP the same holds per position in a shard group: the ranks at one position of
        every shard group (mesh["dp_replicate"]) hold the same shard."""
        rank, mesh = self._plan.rank, self._mesh
        group = None
        if mesh.meshed:
            peers = set(mesh.dp_peers(mesh.position))
            sources = tuple(r for r in sources if r in peers)
            if not sources:
                raise StateError(f"the warm restore names no source of position {mesh.position} in a unit of "
                                 f"{mesh.unit} ranks; the controller should have planned another rung")
            group = mesh.dp_group()
        if rank in sources:
            source = self._worker.warm
            if not source.available or source.state is None:
                raise ElasticError(f"rank {rank} was chosen as warm source but holds no state")
            # Under TP its own shards come back as DTensors of this generation's mesh (`into`).
            into = state.state_dict() if mesh.meshed else None
            held = send_slices(source.state.state_dict(), sources, self._comm_device, into=into, group=group).state
            state.load_state_dict(held, source=f"this rank's in-memory state (rank {rank})")
            return
        payload = send_slices(None, sources, self._comm_device, into=state.state_dict(), group=group).state
        state.load_state_dict(payload, source=f"the in-memory state of ranks {list(sources)}")

    def _memory(self, state: TrainState, source: ReplicaSource, step: int) -> None:
        """Rebuild this rank's shards from the old generation's copies: each holder broadcasts
        the copy of one old rank in turn; every rank keeps the blocks of its new shards.

        Under tensor or pipeline parallelism (T and P unchanged: the controller rebuilds from
        copies only then) the shards of each place in a replica (stage and TP rank) come from the
        old ranks of that place, broadcast within its data-parallel group: every holder sits at
        the place of the copies it holds."""
        mesh = self._mesh
        old_ranks, group = range(source.world_size), None
        if mesh.split:
            size = mesh.layout.replica_size
            misplaced = [(j, h) for j, h in enumerate(source.holders) if h % size != j % size]
            if source.world_size % size or misplaced:
                # Checked on every rank before any broadcast: all raise alike, none waits for a peer.
                raise StateError(f"a memory restore in replicas of {size} ranks (tensor x pipeline parallel) needs "
                                 f"the copies of generation {source.generation}'s {source.world_size} ranks each held "
                                 f"at its own place in a replica; (old rank, holder) {misplaced} are not: the "
                                 f"controller must place every holder at the place of the copies it holds")
            old_ranks, group = range(self._plan.rank % size, source.world_size, size), mesh.dp_group()
        rebuild = Rebuild(state.state_dict())
        for old_rank in old_ranks:
            holder = source.holders[old_rank]
            payload = self._held_copy(source, old_rank, step) if self._plan.rank == holder else None
            rebuild.take(broadcast_state(payload, holder, self._comm_device, group=group))
        where = "the nodes' keepers' copies" if source.keepers else "the in-memory copies"
        state.load_state_dict(rebuild.result(), source=f"{where} of generation {source.generation}'s "
                                                       f"{source.world_size} ranks at step {step}")
        if self._worker.progress.step != step:
            raise StateError(f"the in-memory copies hold step {self._worker.progress.step}, the plan said {step}")
        session = self._worker.checkpoints
        if session.last_saved_step is not None and session.last_saved_step > step:
            session.last_saved_step = None      # that save's steps are redone: save them again

    def _held_copy(self, source: ReplicaSource, old_rank: int, step: int) -> dict[str, Any]:
        """Old rank `old_rank`'s copy: from this worker's memory, or fetched from the node keeper
        that holds it (the workers that took the copies were lost: elastic._node_keeper)."""
        if not source.keepers:
            return self._worker.replicas.copy_of(source.generation, old_rank)
        from elastic._node_keeper import fetch_copy
        return fetch_copy(source.keepers[old_rank], source.generation, source.world_size, old_rank, step)

    def _checkpoint(self, state: TrainState, compression: Any) -> None:
        session = self._worker.checkpoints
        manager = session.open(self._spec)
        # The framework's progress is JSON in the manifest; checkpoints of earlier runtimes kept
        # it in the DCP state (the newest manifest says which: every rank reads the same one).
        newest = manager.latest()
        in_meta = newest is None or EXTRA in (newest.meta or {})
        # Optimizer states as the newest checkpoint keyed them (flattened under pipelines).
        flat = newest is not None and ((newest.meta or {}).get(EXTRA) or {}).get(OPTIMIZER_KEYS) == FLAT
        loaded_state, loaded = _wrap.load_with_compression_state(
            manager, compression, self._plan.rank, self._plan.world_size, self._comm_device,
            lambda with_keys: _legacy_names(state.checkpoint_template(with_keys, framework_in_meta=in_meta,
                                                                      flat=flat), legacy=not in_meta))
        if loaded is None:
            planned = self._plan.restore.step
            if planned is not None:
                # The controller planned from a checkpoint it listed; its vanishing is a storage
                # fault to recover from (the re-plan lists again), never a silent start from step 0.
                url = self._spec.checkpoint.storage    # shown masked: a CheckpointError masks its message
                raise StorageError(f"the checkpoint of step {planned} that generation {self._plan.generation} "
                                   f"was planned to restore is no longer committed under {url}; re-planning",
                                   url=url)
            log.warning("rank %d: no committed checkpoint under %s; starting fresh", self._plan.rank,
                        mask_url(self._spec.checkpoint.storage))
            self._start_over()
            return
        if in_meta:
            framework = (loaded.meta or {}).get(EXTRA)
            if framework is None:
                raise CheckpointError(f"checkpoint step {loaded.step} at {loaded.path} has no framework state in "
                                      f"its manifest (it was written by an earlier runtime than the newest "
                                      f"checkpoint)", url=self._spec.checkpoint.storage)
            loaded_state = {**loaded_state, EXTRA: {**framework, **loaded_state.get(EXTRA, {})}}
        else:
            loaded_state = _legacy_names(loaded_state, legacy=True, back=True)
        state.load_state_dict(loaded_state, source=f"checkpoint step {loaded.step} at {loaded.path}",
                              legacy=not in_meta, flat=flat)
        session.load_fallbacks.extend(dict(s) for s in loaded.skipped)
        session.last_saved_step = self._worker.progress.step
        if self._plan.generation == 0 and session.resumed_from is None:
            session.resumed_from = self._worker.progress.step

    def _start_over(self) -> None:
        self._worker.progress.reset()
        self._ensure_lr_ramp()

    def _ensure_lr_ramp(self) -> None:
        """The LR rule's state exists before anything is saved or loaded, so a checkpoint always
        holds it and a load always asks for it."""
        progress, rule = self._worker.progress, self._spec.lr
        if rule is not None and progress.lr_ramp is None:
            progress.lr_ramp = ScaleRamp.initial(self._mesh.layout.dp, rule.base_world_size)


# Checkpoints of runtimes before the state contract saved the one optimizer as "optim".
_LEGACY_KEYS = {"optimizer": "optim"}


def _legacy_names(state: dict[str, Any], *, legacy: bool, back: bool = False) -> dict[str, Any]:
    """`state` with restore()'s names as an earlier runtime's checkpoint has them (or back)."""
    if not legacy:
        return state
    names = {v: k for k, v in _LEGACY_KEYS.items()} if back else _LEGACY_KEYS
    return {names.get(k, k): v for k, v in state.items()}

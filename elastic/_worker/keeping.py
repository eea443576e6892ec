"""Keeping a rank's state beyond its step, for one generation: the scheduled checkpoints, FSDP's
copies in host memory, the commit a group takes before it changes, and the run's final commit
and model hash.

TrainContext decides nothing of this: at each step boundary it hands the group's decision
(`StepOutcome`) here, and raises the unwind when the group leaves. The rules about commits that
outlive a generation (never commit a non-finite step, check a commit taken before the group
changes, confirm the final one) are the CheckpointSession's (elastic/_worker/checkpoint_session.py).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from elastic._determinism import state_sha256
from elastic._node_keeper import CopyHandover
from elastic._protocol import GenerationPlan, RunSpec
from elastic._worker import checkpoint_io as _checkpoint_io
from elastic._worker import thread_position as _thread_position
from elastic._worker import wrap as _wrap
from elastic._worker.mesh import GenerationMesh
from elastic._worker.state import WorkerState
from elastic._worker.step_boundary import StepBoundary, StepOutcome
from elastic._worker.train_state import TrainState


class StateKeeper:
    """One generation's saves and copies of the state `restore` loaded (`state`)."""

    def __init__(self, *, plan: GenerationPlan, spec: RunSpec, worker: WorkerState, boundary: StepBoundary,
                 mesh: GenerationMesh, device: torch.device):
        self._plan, self._spec, self._worker, self._boundary = plan, spec, worker, boundary
        self._mesh = mesh
        self._copy_device = device if spec.scaling.use_gpu else torch.device("cpu")
        self.state: TrainState | None = None     # set when the generation restored (ctx.restore)
        self.compression: Any = None              # the PowerSGD state checkpoints carry (the first compressed model's)
        handover = self._handover()
        if handover is not None:
            handover.prepare()

    def save(self, *, wait: bool = False) -> None:
        """Collective: commit a checkpoint of the current step (async unless `wait`)."""
        assert self.state is not None, "TrainContext requires the state first"
        _thread_position.mark(_thread_position.ThreadPlace.CHECKPOINT)   # never judged hung here (hang_watch)
        # The steps' losses are known before their state is saved: a non-finite one is never committed.
        self._boundary.settle()
        # The held poll answers now, with the records of every step up to this one: a step must
        # reach the controller before its commit can. Were every rank to die after the commit
        # (a node, or a whole group, lost) with the records still held, the restored steps would
        # have no metrics.jsonl lines (steps of milliseconds fill a 1 s hold with 100 of them).
        self._worker.outbox.news.set()
        started = time.monotonic()
        rank, step = self._plan.rank, self._boundary.step
        payload, meta = self.state.checkpoint_payload(_wrap.compression_extra(self.compression, rank),
                                                      world_size=self._plan.world_size, flat=self._mesh.pipelined)
        self._worker.checkpoints.save(self._spec, step, payload, generation=self._plan.generation, wait=wait,
                                      meta=meta)
        if rank == 0:
            self._worker.checkpoints.export_commit()
        # What the loop was blocked for: the next step's record carries it (the run's time ledger).
        self._boundary.checkpoint_stall_s += time.monotonic() - started

    def after_step(self, outcome: StepOutcome) -> bool:
        """At a step boundary: the scheduled checkpoint, FSDP's copies, and, when the group leaves
        the loop (returned True), the commit it needs first. The record of the step is the
        caller's to settle."""
        step, total, spec = self._boundary.step, self._boundary.total_steps, self._spec
        if spec.checkpoint_due(step) and step < total:
            self.save()
        leaving = outcome.stop or outcome.preempted > 0
        if leaving:
            outcome = self._boundary.recount(outcome)
            # The state the group leaves with (copied, committed or broadcast to the next
            # generation) is compared after its update: this step's exchange may carry only the
            # fingerprint from before it.
            self._boundary.verify_leaving_state()
        if spec.in_memory_every is not None and (spec.copy_due(step) or leaving) and step < total:
            # FSDP's copies (every rank at the same steps: the swap is a collective); a group that
            # leaves together takes them at the step it leaves from, which the next one restores.
            # The loop waits for them like for a checkpoint save (the run's time ledger says so).
            started = time.monotonic()
            # A copy is what a silent corruption rolls back to: only of a step whose replicas
            # agreed (collected now; a disagreement raises here, before anything is copied).
            # Collecting waits for every rank's exchange: a wait for the others, for the hang
            # judge (in the boundary's own place, a rank stopped meanwhile went unseen: no front).
            if self._boundary.checks_fingerprints:
                with _thread_position.waiting(_thread_position.ThreadPlace.EXCHANGE):
                    self._boundary.settle()
            self._copy_to_memory()
            _thread_position.worked()      # the keeper's handover goes on beside the next step
            self._boundary.checkpoint_stall_s += time.monotonic() - started
        if leaving and not self.stays_in_memory(outcome):
            self._commit_before_leaving()
        return leaving

    def stays_in_memory(self, outcome: StepOutcome) -> bool:
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
        if outcome.commit or outcome.preempted >= self._plan.world_size:
            return False
        if self._worker.warm.capable:
            return True
        # No copies are taken at the final step (the run commits it instead), so a group leaving
        # from it would restore older copies and redo steps: it commits, like `elastic stop`.
        return (self._spec.in_memory_every is not None and outcome.preempted <= 1
                and self._boundary.step < self._boundary.total_steps)

    def _commit_before_leaving(self) -> None:
        """Commit this step and make sure it is committed: the group is about to change and this
        state will not be in memory to retry with. A failed commit is raised, not left behind
        unseen (the recovery then counts the steps it loses). The step's save may have been
        issued already (a scheduled one at this step): then it is waited for and checked alike."""
        session, step = self._worker.checkpoints, self._boundary.step
        if session.last_saved_step != step:
            self.save(wait=True)
        elif session.manager is not None:
            started = time.monotonic()
            session.manager.wait()
            self._boundary.checkpoint_stall_s += time.monotonic() - started
        session.check_committed(step)

    def _copy_to_memory(self) -> None:
        """Collective: this rank's state into host memory, and a copy to its ring neighbour (under
        tensor or pipeline parallelism, the same place in the next replica)."""
        assert self.state is not None
        mesh = self._mesh
        if self._spec.scaling.strategy == "ddp":
            # Every replica holds the whole state: each rank keeps its own copy, as the copy of
            # its place in a world of one replica (any replica's holder restores it), no swap.
            size = mesh.layout.replica_size
            self._worker.replicas.refresh(self.state, generation=self._plan.generation, rank=self._plan.rank % size,
                                          world_size=size, step=self._boundary.step, device=self._copy_device,
                                          replica_size=size)
            self._hand_to_keeper()
            return
        # Unsplit, the ring is the world: no mesh is built for it (its process groups cost a collective).
        group = mesh.dp_group() if mesh.split else None
        self._worker.replicas.refresh(self.state, generation=self._plan.generation, rank=self._plan.rank,
                                      world_size=self._plan.world_size, step=self._boundary.step,
                                      device=self._copy_device, replica_size=mesh.layout.replica_size, group=group,
                                      shift=self._plan.copy_shift)
        self._hand_to_keeper()

    def _hand_to_keeper(self) -> None:
        """This rank's own copy to its node's keeper, which outlives the workers
        (elastic._node_keeper), in the background. Under DDP only the node's first replica
        hands its copies over: every replica holds the same."""
        own, handover = self._worker.replicas.own(), self._handover()
        if own is not None and handover is not None:
            handover.hand(own.generation, own.world_size, own.rank, own.step, own.state)

    def _handover(self) -> CopyHandover | None:
        """This worker's handover to its node's keeper, when this rank hands copies over: copies
        are taken and node_copies is on, in a run (not a benchmark's bare context), and under DDP
        in the node's first replica (every replica holds the same state)."""
        worker, spec = self._worker, self._spec
        if worker.run_names is None or spec.in_memory_every is None or not spec.checkpoint.node_copies:
            return None
        if spec.scaling.strategy == "ddp" and self._plan.local_rank >= self._mesh.layout.replica_size:
            return None
        if worker.copy_handover is None:
            worker.copy_handover = CopyHandover(worker.run_names)
        return worker.copy_handover

    def finish(self) -> str | None:
        """After the loop: commit the final state and hash the full models (collective); the
        hash on rank 0 (None elsewhere, and without a model)."""
        assert self.state is not None
        self._boundary.settle()   # the last step's record
        session, step = self._worker.checkpoints, self._boundary.step
        if session.last_saved_step != step:
            self.save(wait=True)
        if session.manager is not None:
            session.manager.wait()
            if self._plan.rank == 0:
                session.export_commit()
            session.confirm_final(step)
        modules = self.state.modules()
        if not modules:
            return None
        # Sharded modules (FSDP, TP) are gathered, a pipeline's stages merged: a collective, and
        # the hash is of the whole model.
        sharded = self._spec.scaling.strategy in ("fsdp", "hsdp") or self._mesh.split
        pipeline = self._mesh.pp_group() if self._mesh.pipelined else None
        full = {name: _checkpoint_io.full_model_state(m, pipeline) if sharded else m.state_dict()
                for name, m in modules.items()}
        if self._plan.rank != 0:
            return None
        if len(full) == 1:
            return state_sha256(next(iter(full.values())))
        return state_sha256({f"{name}.{key}": v for name, sd in full.items() for key, v in sd.items()})

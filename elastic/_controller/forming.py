"""Forming a generation: where it restores from, the fence, and every member's plan.

`GenerationFormer` counts generations (they keep growing across runs on the same storage, or the
fence would refuse a later run's checkpoints as a zombie's), reads where the run resumes from,
chooses a re-formed group's restore (a warm broadcast from the survivor furthest ahead that
holds its state; else, under FSDP, the shards' copies in the members' host memory when every old
rank's copy survives and no checkpoint is newer; else the newest committed checkpoint), writes the
fence and hands every member its plan. What a new generation resets elsewhere (the intake, the
ledgers, the record, the judges) is the controller's to tell them, from the `GenerationStarted`
that `form` returns: the former changes nothing but its own count. Who the members are is the
controller's choice; it forms only what it is handed. Storage calls of the re-form go through the
controller's retrying `storage` call, which fails the run when an error outlasts its retries.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from elastic._controller.collaborators import CheckpointView, WorkerGroup
from elastic._controller.replica_arrangement import warm_sources
from elastic._controller.running import Fault
from elastic._controller.slot_table import WorkerView
from elastic._controller.states import Running, Starting
from elastic._protocol import (
    GenerationPlan,
    ReplicaSource,
    RestoreKind,
    RestorePlan,
    WorkerReport,
    copy_shift,
    placement,
)
from elastic.config import FailureConfig
from elastic.errors import WorkerLostError
from elastic.policies import Cause, Failure

log = logging.getLogger("elastic.controller")

StorageCall = Callable[[str, Callable[[], Any]], tuple[bool, Any]]


@dataclass(frozen=True)
class GenerationStarted:
    """A generation was handed to its members: what every part that counts per generation starts
    over from (the controller hands it to each, in one place)."""

    generation: int
    step: int              # the step it restores (as planned; rank 0 confirms or corrects it)
    world_size: int


class GenerationFormer:
    """Starts generations and owns their count. It reads storage and hands out plans; it tells
    nothing to the other parts (the controller does, with what `form` returns)."""

    def __init__(self, group: WorkerGroup, checkpoints: CheckpointView, storage: StorageCall, *,
                 failure: FailureConfig, clock: Callable[[], float], unit: int = 1, replica: int = 1):
        self.group, self._checkpoints, self._storage = group, checkpoints, storage
        self._failure, self._clock, self._unit, self._replica = failure, clock, unit, replica
        self.generation = -1

    def resume_plan(self) -> RestorePlan:
        """The first generation's restore: after the previous run's generations, from its newest
        checkpoint. Raises what storage raises (the controller's storage call retries it)."""
        fence = self._checkpoints.current_fence()
        if fence is not None:
            self.generation = max(self.generation, fence)
        # Fence before listing (see reform_plan): a previous run's writer still committing is
        # refused from here on, so the listing is all the run keeps from before this generation.
        latest = self._fence_then_list()
        if latest is None:
            return RestorePlan(RestoreKind.FRESH)
        return RestorePlan(RestoreKind.CHECKPOINT, step=latest)

    def reform_plan(self, members: list[int], settled: dict[int, WorkerReport], *,
                    before: int | None = None) -> tuple[bool, RestorePlan | None]:
        """A re-formed group's restore: warm from every member that holds the state of the newest
        step any member holds (a slice from each; under TP, of its own TP rank's shard: every TP
        rank needs one); else from the members' in-memory copies (FSDP; DDP's under the silent
        corruption check) unless a checkpoint is newer; else from the newest committed checkpoint
        (or fresh when there is none). `before`: a silent corruption found at that step, so no
        live state is restored (it may have trained on the corrupt rank's gradients), only copies
        from before it (taken at steps whose replicas agreed) or a checkpoint (never committed
        from a step whose replicas disagreed)."""
        warm = warm_sources(members, settled, self._unit)
        if before is not None:
            warm = "the survivors' live state may have trained on it"
        if not isinstance(warm, str):
            # Every member holding the newest step sends a slice; one holding an older step receives.
            newest, sources = warm
            held = "full state" if self._unit == 1 else f"model shards (all {self._unit} places of a unit)"
            return True, RestorePlan(RestoreKind.BROADCAST, source_rank=sources[0], sources=sources, step=newest,
                                     reason=f"{len(sources)} survivor(s) hold the {held} of step {newest}")
        memory = memory_source(members, settled)
        if self._unit > 1 and any(w in settled and settled[w].has_state for w in members):
            memory = warm      # why the survivors' memory is not enough (copies are not kept under TP)
        if isinstance(memory, str):
            # The workers holding the copies were lost (all of them, say): their nodes' keepers may have them.
            kept = keeper_source(self.group.node_copies(), len(members), self._unit)
            memory = kept if isinstance(kept, RestorePlan) else f"{memory}; {kept}"
        if before is not None and isinstance(memory, RestorePlan) and memory.step >= before:
            memory = f"the copies in memory are of step {memory.step}, not from before step {before}"
        # Fence the next generation before listing (the protocol of checkpointing.manifest's
        # advance_fence): a broken generation's rank 0 may still be committing a save issued
        # before its peer died. Listed first, that late commit could land after the listing, run
        # its retention (deleting the checkpoint this plan names) and then be hidden by the
        # fence's start step: nothing left to restore. Fenced first, the late commit is refused,
        # or it landed before the fence and its retention sees the fence moved and skips; either
        # way the listing below is what the new generation keeps. `form` records the start step.
        # One storage call for both: a storage error in either is one trouble, retried whole.
        ok, latest = self._storage("fence the next generation and list the committed checkpoints",
                                   self._fence_then_list)
        if not ok:
            return False, None
        # After a silent corruption the plan says why the survivors' live state was passed over.
        after = f"silent corruption, rolled back to before step {before}: " if before is not None else ""
        if isinstance(memory, RestorePlan):
            if latest is None or memory.step >= latest:
                return True, dataclasses.replace(memory, reason=after + memory.reason)
            why = f"the newest checkpoint (step {latest}) is ahead of the copies in memory (step {memory.step})"
        else:
            why = memory
        if latest is None:
            return True, RestorePlan(RestoreKind.FRESH, reason=f"{after}{why}, and no checkpoint is committed")
        return True, RestorePlan(RestoreKind.CHECKPOINT, step=latest, reason=after + why)

    def _fence_then_list(self) -> int | None:
        self._checkpoints.fence(self.generation + 1)
        return self._checkpoints.latest_step()

    def form(self, st: Starting, views: dict[int, WorkerView]) -> Formed | None:
        """Fence the storage for the next generation and start it on `st.members`. None: storage
        said "not now". Else what was formed: the Running state, the generation's start, and the
        fault to recover from at once if not every member was handed its plan (start_fault)."""
        ok, _ = self._storage("write the generation fence",
                              lambda: self._checkpoints.fence(self.generation + 1, start_step=st.restore.step))
        if not ok:
            return None
        self.generation += 1
        world, failure = len(st.members), self._failure
        fault: Fault | None = None
        try:
            addr, port = self.group.rendezvous_address(st.members[0])
            infos = [views[wid].info for wid in st.members]
            places, shift = placement(infos), copy_shift(infos, self._replica)
            self.group.start_generation({wid: GenerationPlan(
                generation=self.generation, rank=rank, world_size=world, master_addr=addr, master_port=port,
                restore=st.restore, timeout_s=failure.collective_timeout_s, copy_shift=shift, **places[rank])
                for rank, wid in enumerate(st.members)})
        except WorkerLostError as error:
            log.warning("generation %d could not start: %s", self.generation, error)
            fault = start_fault(self.generation, st.members, error)
        started = GenerationStarted(self.generation, st.restore.step, world)
        return Formed(Running(self.generation, st.members, started_at=self._clock()), started, fault)


class Formed(NamedTuple):
    running: Running
    started: GenerationStarted
    fault: Fault | None


def start_fault(generation: int, members: list[int], error: WorkerLostError) -> Fault:
    """What to recover from when `generation` could not start on every member: the members the
    error names (error.lost) are lost, at their ranks in the generation and for their causes; the
    others may hold their plan already and be joining, waiting on the rendezvous for a rank that
    never comes, so their group is cut (the controller does so for a fault with lost members). An
    error that names no member (nothing was handed out) blames rank 0, whose address it lacked."""
    rank_of = {wid: rank for rank, wid in enumerate(members)}
    lost = [wid for wid in error.lost if wid in rank_of]
    message = f"generation {generation} could not start: {error}"
    if not lost:
        return Fault(Failure(Cause.HANG, (0,), message), [], 0.0)
    return Fault(Failure(error.lost[lost[0]], tuple(rank_of[wid] for wid in lost), message), lost, 0.0)


def memory_source(members: list[int], settled: dict[int, WorkerReport]) -> RestorePlan | str:
    """A MEMORY restore from the members' copies (elastic._worker.replicas), or why there is none.

    Copies count only by (generation, step): a rebuild needs every rank of one generation at one
    step. Of the (generation, step)s that every old rank has a holder for, the newest step wins;
    each old rank is read from the member holding its own copy where it survives."""
    held = {rank: settled[w].replicas for rank, w in enumerate(members) if w in settled and settled[w].replicas}
    if not held:
        return "no member holds a copy of the state in memory"
    by_key: dict[tuple[int, int, int], dict[int, int]] = {}     # (step, generation, world) -> old rank -> holder
    for new_rank, replica in held.items():
        assert replica is not None
        holders = by_key.setdefault((replica.step, replica.generation, replica.world_size), {})
        for position, old_rank in enumerate(replica.ranks):
            if position == 0 or old_rank not in holders:     # a rank's own copy first
                holders[old_rank] = new_rank
    complete = [key for key, holders in by_key.items() if len(holders) == key[2]]
    if not complete:
        step, generation, world = max(by_key)
        lost = sorted(set(range(world)) - set(by_key[(step, generation, world)]))
        return (f"the copies of rank(s) {lost} of generation {generation} were lost with their holders "
                f"(neighbours lost together)")
    step, generation, world = max(complete)
    holders = by_key[(step, generation, world)]
    return RestorePlan(RestoreKind.MEMORY, step=step,
                       replica=ReplicaSource(generation=generation, world_size=world,
                                             holders=tuple(holders[r] for r in range(world))),
                       reason=f"every rank of generation {generation} has a copy in a member's memory "
                              f"(step {step}); no storage read")


def keeper_source(copies: list[tuple[str, int, int, int, int]], world: int, unit: int) -> RestorePlan | str:
    """A MEMORY restore from the nodes' keepers (elastic._node_keeper), or why there is none.
    `copies`: (keeper, generation, world size, rank, step) of every copy they hold. Of the
    (generation, step)s with a copy of every old rank, the newest step wins; old rank j's copy is
    fetched and broadcast by new rank j mod `world` (at the same place in its replica of `unit`
    ranks, as the rebuild needs, when `unit` divides `world`)."""
    by_key: dict[tuple[int, int, int], dict[int, str]] = {}     # (step, generation, world) -> old rank -> keeper
    for keeper, generation, old_world, rank, step in copies:
        by_key.setdefault((step, generation, old_world), {}).setdefault(rank, keeper)
    complete = [key for key, kept in by_key.items() if len(kept) == key[2]]
    if not complete:
        return "no node keeper holds a copy of every rank" if copies else "no node keeper holds a copy"
    step, generation, old_world = max(complete)
    if old_world % unit or world % unit:
        return f"the keepers' copies are of {old_world} ranks, not whole replicas of {unit} for {world} ranks"
    kept = by_key[(step, generation, old_world)]
    return RestorePlan(RestoreKind.MEMORY, step=step,
                       replica=ReplicaSource(generation=generation, world_size=old_world,
                                             holders=tuple(rank % world for rank in range(old_world)),
                                             keepers=tuple(kept[rank] for rank in range(old_world))),
                       reason=f"every rank of generation {generation} has a copy in its node's keeper (step {step}), "
                              f"outliving the workers that took it; no storage read")

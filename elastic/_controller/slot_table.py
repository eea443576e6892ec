"""The worker group's slot table: one record per worker slot, and what the controller sees of it.

`SlotTable` alone changes where a slot is (pending, starting, ready, dead), knows which slots
share a placement group (one per slot; one per replica under tensor parallelism, a slot in each of
its bundles) and which of its bundles a live slot holds, files its poll answers (the step records
the controller has not viewed yet are kept across answers), records its death and the silence
that led to it, drops a dead slot once no recovery can ask about it, and builds each tick's views
(a slot's silence: how long it has not answered). It makes no Ray call: the worker group
(worker_group.RayWorkerGroup) polls and kills, its placements (placement.Placements) place and
start the actors, and both tell the table what came of it.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from elastic._protocol import PollFailure, WorkerInfo, WorkerReport
from elastic.config import FailureConfig
from elastic.policies import Cause

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.util.placement_group import PlacementGroup


class SlotStatus(enum.StrEnum):
    """Where a worker slot is: its placement pending, its actor starting, ready, or dead."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"


PENDING, STARTING, READY, DEAD = SlotStatus.PENDING, SlotStatus.STARTING, SlotStatus.READY, SlotStatus.DEAD


@dataclass(slots=True)
class WorkerView:
    """What the controller knows of one worker slot."""

    wid: int
    status: str                                # pending | starting | ready | dead
    report: WorkerReport | None = None         # newest poll answer
    info: WorkerInfo | None = None
    silent_s: float = 0.0                      # time since the last answer (ready workers)
    death: str | None = None                   # why it is dead, in words
    death_cause: Cause | None = None           # why it is dead: worker_died, node_lost, or hang (killed)
    records: list = field(default_factory=list)  # step records drained by this tick
    via_agent: bool = False                    # its polls go through its node's agent (node_agent)


@dataclass
class Slot:
    wid: int
    pg: PlacementGroup | None          # None: a slot a replacing controller found dead (WorkerGroup.bury)
    pg_ready: ObjectRef | None
    created_at: float
    bundle: int = 0                    # its bundle in `pg` (a replica's placement group has one per TP rank)
    status: str = PENDING
    actor: Any = None                  # the TrainWorker actor's handle: Ray resolves its methods by name
    info_ref: ObjectRef | None = None
    info: WorkerInfo | None = None
    poll_ref: ObjectRef | None = None
    last_answer_at: float = 0.0
    report: WorkerReport | None = None
    death: str | None = None
    death_cause: Cause | None = None
    silent_at_death: float = 0.0
    died_at: float = 0.0               # monotonic time it was found dead (its slot is dropped later)
    warned: bool = False               # its placement was said to be stuck
    placed_at: float = 0.0             # monotonic time its placement was granted and its actor launched
    agent: str | None = None           # the node whose agent carries its polls (None: polled directly)
    seq_seen: int = 0                  # the newest answer received (each poll acknowledges it: state.Outbox)
    pg_name: str = ""                  # its placement group's name (elastic._run_names; empty: unnamed)


class SlotTable:
    """The worker slots by worker id, each in one status."""

    def __init__(self, failure: FailureConfig, clock: Callable[[], float]):
        self._clock = clock          # monotonic: answers, deaths
        self._slots: dict[int, Slot] = {}
        self._next_wid = 0
        # A dead slot stays in the views until no recovery can still ask about it: the one that
        # lost it settles within the collective and heartbeat timeouts, then re-forms or fails
        # within the rendezvous timeout (twice that, to be safe). Then it is dropped: a long run
        # at 10,000 ranks would otherwise view thousands of dead slots at every tick.
        self._dead_kept_s = 2 * (failure.collective_timeout_s + failure.heartbeat_timeout_s
                                 + failure.rendezvous_timeout_s)

    # ---- the records -------------------------------------------------------------------
    def open(self, pg: PlacementGroup, pg_ready: ObjectRef, bundle: int = 0, pg_name: str = "") -> Slot:
        """A new slot, numbered next, in bundle `bundle` of a placement group just asked for (or
        of a replica's whose other bundles still hold live slots)."""
        slot = Slot(wid=self._next_wid, pg=pg, pg_ready=pg_ready, created_at=self._clock(), bundle=bundle,
                    pg_name=pg_name)
        self.add(slot)
        return slot

    def add(self, slot: Slot) -> None:
        """File `slot` under its worker id (a worker id is never given twice)."""
        self._slots[slot.wid] = slot
        self._next_wid = max(self._next_wid, slot.wid + 1)

    def get(self, wid: int) -> Slot | None:
        """The slot of `wid`, or None once it was dropped (dead long ago)."""
        return self._slots.get(wid)

    def __getitem__(self, wid: int) -> Slot:
        return self._slots[wid]

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots.values())

    def in_status(self, status: SlotStatus) -> list[Slot]:
        return [s for s in self._slots.values() if s.status == status]

    def live(self) -> int:
        """Slots alive or pending."""
        return sum(1 for s in self._slots.values() if s.status != DEAD)

    @property
    def next_wid(self) -> int:
        """The id the next slot gets."""
        return self._next_wid

    def continue_from(self, next_wid: int) -> None:
        """Number new slots from `next_wid` on (a replacing controller: ids are never given twice)."""
        self._next_wid = max(self._next_wid, next_wid)

    def free_bundles(self, bundles: int) -> list[tuple[PlacementGroup, int, str]]:
        """The bundles no live slot holds in the placement groups (of `bundles` bundles each)
        where some live slot still holds one: a dead slot's bundle, its peers alive on its node.
        Oldest group first, each group's bundles in order; each with its group's name."""
        held: dict[Any, tuple[PlacementGroup, str, set[int]]] = {}
        for slot in sorted(self._slots.values(), key=lambda s: s.wid):
            if slot.status != DEAD and slot.pg is not None:
                held.setdefault(_group_key(slot), (slot.pg, slot.pg_name, set()))[2].add(slot.bundle)
        return [(pg, b, name) for pg, name, taken in held.values() for b in range(bundles) if b not in taken]

    def placement_unused(self, slot: Slot) -> bool:
        """No live slot holds a bundle of `slot`'s placement group any more (it can be removed)."""
        return all(s.status == DEAD for s in self._slots.values() if _group_key(s) == _group_key(slot))

    def ready_nodes(self) -> set[str]:
        """The nodes that have a ready worker."""
        return {s.info.node_id for s in self._slots.values() if s.status == READY and s.info is not None}

    def drop_dead(self, now: float) -> None:
        for wid in [s.wid for s in self._slots.values() if s.status == DEAD and now - s.died_at > self._dead_kept_s]:
            del self._slots[wid]

    # ---- where a slot is ---------------------------------------------------------------
    def launched(self, slot: Slot, actor: Any, info_ref: ObjectRef, placed_at: float) -> None:
        """Its placement was granted and its actor launched: it starts."""
        slot.placed_at = placed_at
        slot.actor, slot.info_ref = actor, info_ref
        slot.status = STARTING

    def started(self, slot: Slot, info: WorkerInfo, now: float) -> None:
        """Its actor answered info(): it is ready (and has answered as of `now`)."""
        slot.info = info
        slot.status = READY
        slot.last_answer_at = now

    def take(self, slot: Slot, answer: WorkerReport | PollFailure, now: float) -> PollFailure | None:
        """A worker's poll answer, whether it came directly or through its node's agent. A failed
        poll is returned (the group acts on it), its silence counted up to `now`."""
        if isinstance(answer, PollFailure):
            self.silenced(slot, now)
            return answer
        if slot.report is not None and slot.report.records:
            answer = replace(answer, records=slot.report.records + answer.records)
        slot.report = answer
        slot.last_answer_at = now
        slot.seq_seen = max(slot.seq_seen, answer.seq)
        return None

    def silenced(self, slot: Slot, now: float) -> None:
        """It will not answer again (its death is being recorded): its silence stops at `now`."""
        slot.silent_at_death = now - slot.last_answer_at

    def mark_dead(self, slot: Slot, reason: str, cause: Cause = Cause.WORKER_DIED) -> bool:
        """Record its death (False: it was dead already). Its polls stop, by any route."""
        if slot.status == DEAD:
            return False
        slot.status = DEAD
        slot.died_at = self._clock()
        slot.death, slot.death_cause = reason, cause
        slot.poll_ref = None
        slot.agent = None
        return True

    def released(self, wids: list[int]) -> None:
        """Their agent stopped: these workers are polled directly from now on."""
        for wid in wids:
            slot = self._slots.get(wid)
            if slot is not None and slot.status == READY:
                slot.agent = None

    # ---- what the controller sees ------------------------------------------------------
    def views(self, now: float, answered_at: dict[str, float]) -> dict[int, WorkerView]:
        """Every slot's view as of `now` (`answered_at`: when each agent made the answer that
        came in this tick). The step records in them are handed over once: the next view holds
        only newer ones."""
        views = {}
        for slot in self._slots.values():
            records = []
            if slot.report is not None and slot.report.records:
                records = slot.report.records
                slot.report = replace(slot.report, records=[])
            views[slot.wid] = WorkerView(
                wid=slot.wid, status=slot.status, report=slot.report, info=slot.info,
                silent_s=_silence(slot, answered_at.get(slot.agent, now) if slot.agent is not None else now),
                death=slot.death, death_cause=slot.death_cause, records=records, via_agent=slot.agent is not None)
        return views


def _group_key(slot: Slot) -> Any:
    """Which placement group a slot is in: by name when it has one (an adopting controller holds a
    handle of its own per slot), else by handle."""
    return slot.pg_name or id(slot.pg)


def _silence(slot: Slot, as_of: float) -> float:
    """Seconds the worker had not answered as of `as_of`: the tick's time, or for a worker whose
    agent answered in this tick without it, when the agent made that answer (the controller's own
    lateness in taking it is not the worker's silence). The upper bound on how long a fault went
    unseen."""
    if slot.status == DEAD:
        return slot.silent_at_death
    if slot.status == READY and (slot.poll_ref is not None or slot.agent is not None):
        return max(0.0, as_of - slot.last_answer_at)
    return 0.0

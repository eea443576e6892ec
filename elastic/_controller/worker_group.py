"""The worker group on Ray: one placement group and one TrainWorker actor per worker slot.

Only this module talks to Ray about workers (agent_pool, about the node agents that may carry
their polls). It is non-blocking: `tick()` advances pending placements, collects poll answers
and sends new polls, and returns a view the controller decides on. A placement group that cannot
be placed yet stays pending, so replacements start by themselves when capacity returns (a node
comes back, resources free up).
"""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ray
from ray import ObjectRef
from ray.exceptions import GetTimeoutError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic._controller.agent_pool import AgentPool
from elastic._controller.ray_calls import answered, first_line, poll_failure
from elastic._protocol import GenerationPlan, PollFailure, RunSpec, WorkerInfo, WorkerReport
from elastic._worker.worker import TrainWorker
from elastic.config import FailureConfig, ScalingConfig
from elastic.errors import WorkerLostError
from elastic.policies import Cause

log = logging.getLogger("elastic.group")

SLOW_TICK_S = 2.0    # a tick is normally milliseconds: Ray calls that block show up here
PLACEMENT_WARN_S = 30.0   # a placement pending this long (at least startup_wait_s) is said to be stuck

class SlotStatus(enum.StrEnum):
    """Where a worker slot is: its placement pending, its actor starting, ready, or dead."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"


PENDING, STARTING, READY, DEAD = SlotStatus.PENDING, SlotStatus.STARTING, SlotStatus.READY, SlotStatus.DEAD


class PollTerms(NamedTuple):
    """What a tick's polls ask of the workers (the controller's terms, from its running judge)."""

    hold_s: float = 0.0           # a worker may hold its answer this long when nothing happens,
    wake_s: float | None = None   # and answers when its training thread's wait crosses this (or None)


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
class _Slot:
    wid: int
    pg: PlacementGroup
    pg_ready: ObjectRef
    created_at: float
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


class RayWorkerGroup:
    def __init__(self, spec: RunSpec, scaling: ScalingConfig, failure: FailureConfig, *,
                 clock: Callable[[], float] = time.monotonic):
        self._spec = spec
        self._clock = clock          # monotonic: placements, answers, deaths
        self._scaling = scaling
        self._failure = failure
        self._slots: dict[int, _Slot] = {}
        self._next_wid = 0
        # A dead slot stays in the views until no recovery can still ask about it: the one that
        # lost it settles within the collective and heartbeat timeouts, then re-forms or fails
        # within the rendezvous timeout (twice that, to be safe). Then it is dropped: a long run
        # at 10,000 ranks would otherwise view thousands of dead slots at every tick.
        self._dead_kept_s = 2 * (failure.collective_timeout_s + failure.heartbeat_timeout_s
                                 + failure.rendezvous_timeout_s)
        self._alive_nodes: set[str] | None = None    # ray.nodes() as read in this tick (None: not yet)
        # ScalingConfig.node_agents: one agent per node carries its workers' polls (agent_pool).
        self._agents = AgentPool(failure.rendezvous_timeout_s, self._nodes_alive, self._released,
                                 self._lost_with_agent, clock=clock) if scaling.node_agents else None
        self.terms = PollTerms()     # the last tick's poll terms (wait() waits on held polls by them)
        resources = dict(scaling.resources_per_worker)
        if scaling.use_gpu:
            resources.setdefault("GPU", 1.0)
        self._bundle = resources

    # ---- capacity ----------------------------------------------------------------------
    def scale_to(self, n: int) -> None:
        """Keep `n` worker slots alive or pending; start placements for the missing ones."""
        live = [s for s in self._slots.values() if s.status != DEAD]
        for _ in range(n - len(live)):
            pg = placement_group([dict(self._bundle)], strategy="PACK")
            wid = self._next_wid
            self._next_wid += 1
            self._slots[wid] = _Slot(wid=wid, pg=pg, pg_ready=pg.ready(), created_at=self._clock())

    def _launch(self, slot: _Slot) -> None:
        slot.placed_at = self._clock()
        resources = dict(self._bundle)
        cpus = resources.pop("CPU", 0.0)
        gpus = resources.pop("GPU", 0.0)
        actor_cls = ray.remote(TrainWorker).options(
            num_cpus=cpus, num_gpus=gpus, resources=resources or None, max_concurrency=8,
            max_restarts=0, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(slot.pg, placement_group_bundle_index=0))
        slot.actor = actor_cls.remote(self._spec)
        slot.info_ref = slot.actor.info.remote()
        slot.status = STARTING

    # ---- the tick ----------------------------------------------------------------------
    def tick(self, terms: PollTerms | None = None) -> dict[int, WorkerView]:
        """Poll the workers with `terms` (None: the last tick's) and return what they said."""
        if terms is not None:
            self.terms = terms
        now = self._clock()
        self._alive_nodes = None
        self._drop_dead(now)
        self._advance_placements(now)
        if self._agents is not None:
            self._agents.advance(self._ready_nodes(), now)
        placed = self._clock()
        answered_at = self._collect_polls(now)
        if self._agents is not None:
            self._agents.retire(self._ready_nodes(), now)
        collected = self._clock()
        self._send_polls()
        sent = self._clock()
        if sent - now > SLOW_TICK_S:
            # Detection of every failure waits for the tick: say where a tick was held up.
            log.warning("worker group tick took %.1fs (placements %.1fs, collecting polls %.1fs, sending "
                        "polls %.1fs)", sent - now, placed - now, collected - placed, sent - collected)
        views = {}
        for slot in self._slots.values():
            records = []
            if slot.report is not None and slot.report.records:
                records = slot.report.records
                slot.report = _without_records(slot.report)
            views[slot.wid] = WorkerView(
                wid=slot.wid, status=slot.status, report=slot.report, info=slot.info,
                silent_s=_silence(slot, answered_at.get(slot.agent, now) if slot.agent is not None else now),
                death=slot.death, death_cause=slot.death_cause, records=records, via_agent=slot.agent is not None)
        return views

    def wait(self, timeout_s: float) -> None:
        """Block until a worker may have news for the controller, or `timeout_s` passes: a held
        poll answered (a held poll answers early only on news, and a death fails it at once), a
        placement granted, an actor started. Polls that are not held are not waited on: each is
        answered at once with or without news, and would wake the controller every time."""
        if timeout_s <= 0:
            return
        refs = [s.pg_ready for s in self._slots.values() if s.status == PENDING]
        refs += [s.info_ref for s in self._slots.values() if s.status == STARTING and s.info_ref is not None]
        if self.terms.hold_s > 0:
            refs += [s.poll_ref for s in self._slots.values() if s.status == READY and s.poll_ref is not None]
        if self._agents is not None:
            refs += self._agents.refs(polls=self.terms.hold_s > 0)
        if refs:
            ray.wait(refs, num_returns=1, timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def _drop_dead(self, now: float) -> None:
        for wid in [s.wid for s in self._slots.values() if s.status == DEAD and now - s.died_at > self._dead_kept_s]:
            del self._slots[wid]

    def _advance_placements(self, now: float) -> None:
        placed, pending = answered([s for s in self._slots.values() if s.status == PENDING], lambda s: s.pg_ready)
        for slot, _ in placed:
            self._launch(slot)
        for slot in pending:
            if (not slot.warned and self._scaling.max_workers is not None     # unlimited: a probe waits
                      and now - slot.created_at > max(PLACEMENT_WARN_S, self._scaling.startup_wait_s)):
                # Nothing else says it: a configured spare (or a worker up to max_workers) that never
                # gets resources leaves the run without the replacement it counts on.
                slot.warned = True
                log.warning("worker slot %d has waited %.0fs for resources %s (Ray has %s available): the "
                            "cluster cannot place max_workers + spare_workers = %s workers; add resources or "
                            "lower them", slot.wid, now - slot.created_at, self._bundle,
                            _available_resources(), self._scaling.max_workers + self._scaling.spare_workers)
        started, starting = answered([s for s in self._slots.values() if s.status == STARTING], lambda s: s.info_ref)
        for slot, ref in started:
            try:
                slot.info = ray.get(ref)
                slot.status = READY
                slot.last_answer_at = now
                # Where a replacement's start goes (a recovery may wait on it): the placement,
                # then the process and the worker's imports.
                log.debug("worker %d ready %.2fs after its slot was made (placed in %.2fs)", slot.wid,
                          now - slot.created_at, slot.placed_at - slot.created_at)
            except RayTaskError as error:
                self.kill(slot.wid, f"failed while starting: {first_line(error)}")
            except RayError as error:
                self._mark_dead(slot, f"died while starting: {error}")
        for slot in starting:
            if now - slot.created_at > self._failure.rendezvous_timeout_s:
                self.kill(slot.wid, "did not start within FailureConfig.rendezvous_timeout_s")

    def _collect_polls(self, now: float) -> dict[str, float]:
        """Take the answers that came; returns, for each agent whose answer came in this tick, when
        it made it (its workers' silence is judged as of then: node_agent's "Silence")."""
        got, _ = answered([s for s in self._slots.values() if s.status == READY], lambda s: s.poll_ref)
        for slot, ref in got:
            try:
                answer: WorkerReport | PollFailure = ray.get(ref)
            except RayError as error:
                answer = poll_failure(error)
            slot.poll_ref = None
            self._take(slot, answer, now)
        answered_at: dict[str, float] = {}
        for node_id, answers, at in self._agents.collect(now) if self._agents is not None else ():
            answered_at[node_id] = at
            for wid, carried in answers.items():
                held = self._slots.get(wid)
                if held is not None and held.status == READY and held.agent == node_id:
                    self._take(held, carried, now)
        return answered_at

    def _take(self, slot: _Slot, answer: WorkerReport | PollFailure, now: float) -> None:
        """A worker's poll answer, whether it came directly or through its node's agent."""
        if isinstance(answer, PollFailure):
            slot.silent_at_death = now - slot.last_answer_at
            if answer.actor_gone:
                self._mark_dead(slot, *self._death_reason(slot, answer.message))
            else:
                # The poll itself raised: a worker that cannot report cannot be watched. Replace it.
                self.kill(slot.wid, f"its poll failed: {answer.message}")
            return
        if slot.report is not None and slot.report.records:
            answer = _merge_records(slot.report, answer)
        slot.report = answer
        slot.last_answer_at = now
        slot.seq_seen = max(slot.seq_seen, answer.seq)

    def _send_polls(self) -> None:
        for slot in self._slots.values():
            if slot.status != READY or slot.poll_ref is not None or slot.agent is not None:
                continue
            node_id = slot.info.node_id if slot.info is not None else None
            if self._agents is not None and node_id is not None and self._agents.carrier(node_id):
                slot.agent = node_id           # from now on its node's agent polls it
                self._agents.hand(node_id, slot.wid, slot.actor, slot.seq_seen)
            else:
                slot.poll_ref = slot.actor.poll.remote(self.terms.hold_s, slot.seq_seen, self.terms.wake_s)
        if self._agents is not None:
            self._agents.send_polls(self.terms.hold_s, lambda wid: self._slots[wid].seq_seen, self.terms.wake_s)

    # ---- what the node agents tell the group (agent_pool) --------------------------------
    def _released(self, wids: list[int]) -> None:
        """Their agent stopped: these workers are polled directly from the next tick."""
        for wid in wids:
            slot = self._slots.get(wid)
            if slot is not None and slot.status == READY:
                slot.agent = None

    def _lost_with_agent(self, wids: list[int], node_id: str, why: str) -> None:
        """Their agent was lost with its node: so are they."""
        now = self._clock()
        for wid in wids:
            slot = self._slots.get(wid)
            if slot is not None and slot.status == READY:
                slot.silent_at_death = now - slot.last_answer_at
                self._mark_dead(slot, f"node lost: node {node_id[:12]} left the cluster (its agent: {why})",
                                Cause.NODE_LOST)

    def _ready_nodes(self) -> set[str]:
        """The nodes that have a ready worker (each needs an agent)."""
        return {s.info.node_id for s in self._slots.values() if s.status == READY and s.info is not None}

    def _nodes_alive(self) -> set[str]:
        """The cluster's live nodes, read once per tick (a lost node kills 8 workers at once)."""
        if self._alive_nodes is None:
            self._alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return self._alive_nodes

    def _mark_dead(self, slot: _Slot, reason: str, cause: Cause = Cause.WORKER_DIED) -> None:
        if slot.status == DEAD:
            return
        slot.status = DEAD
        slot.died_at = self._clock()
        slot.death, slot.death_cause = reason, cause
        slot.poll_ref = None
        if slot.agent is not None and self._agents is not None:
            self._agents.forget(slot.agent, slot.wid)
        slot.agent = None
        (log.info if reason == "run ended" else log.warning)("worker %d is dead: %s", slot.wid, reason)
        try:
            remove_placement_group(slot.pg)
        except Exception:   # the placement group may be gone with its node
            log.debug("removing placement group of worker %d failed", slot.wid, exc_info=True)

    # ---- actions -----------------------------------------------------------------------
    def rendezvous_address(self, wid: int) -> tuple[str, int]:
        slot = self._slots[wid]
        (answer,), failures = self._await({wid: slot.actor.rendezvous_address.remote()},
                                          "did not give a rendezvous address")
        if failures:
            raise _lost(failures)
        return answer

    def start_generation(self, plans: dict[int, GenerationPlan]) -> None:
        """Hand every worker its plan. WorkerLostError names the workers that did not take it
        (WorkerLostError.lost); the others did, and are joining the generation."""
        refs = {wid: self._slots[wid].actor.start_generation.remote(plan) for wid, plan in plans.items()}
        _, failures = self._await(refs, "could not start the generation")
        if failures:
            raise _lost(failures)

    def _await(self, refs: dict[int, ObjectRef], what: str) -> tuple[list[Any], dict[int, tuple[Cause, str]]]:
        """The answers of calls to workers, waited for heartbeat_timeout_s in all, and the failures
        by worker: why (a Cause) and a message. A worker whose method raised (RayTaskError: e.g.
        start_generation refused because its previous generation's thread is stuck) is in a state
        nobody planned: it is killed here, so the controller replaces it. A dead or silent one is
        left to the controller (which replaces it as lost) and to the polls."""
        deadline = self._clock() + self._failure.heartbeat_timeout_s
        answers: list[Any] = []
        failures: dict[int, tuple[Cause, str]] = {}
        for wid, ref in refs.items():
            try:
                answers.append(ray.get(ref, timeout=max(0.0, deadline - self._clock())))
                continue
            except RayTaskError as error:
                self.kill(wid, f"{what}: {first_line(error)}")
                # Its previous generation's thread did not end: a hang, as the polls would judge it.
                failures[wid] = Cause.HANG, f"worker {wid} {what} and was replaced: {first_line(error)}"
            except GetTimeoutError as error:
                failures[wid] = Cause.HANG, f"worker {wid} {what}: {error}"
            except RayError as error:
                cause = self._death_reason(self._slots[wid], first_line(error))[1]
                failures[wid] = cause, f"worker {wid} {what}: {error}"
            answers.append(None)
        return answers, failures

    def request_stop(self, wids: list[int], generation: int, cut_group: bool = False) -> None:
        for wid in wids:
            slot = self._slots.get(wid)       # None: dead long ago, dropped
            if slot is not None and slot.status == READY:
                slot.actor.request_stop.remote(generation, cut_group)

    def request_preemption(self, wids: list[int]) -> None:
        """Each worker commits at its next step boundary and leaves (`elastic stop`)."""
        for wid in wids:
            slot = self._slots.get(wid)
            if slot is not None and slot.status == READY:
                slot.actor.preempt.remote()

    def kill(self, wid: int, reason: str) -> None:
        slot = self._slots.get(wid)
        if slot is None:                      # dead long ago, dropped
            return
        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:   # noqa: BLE001 - already gone
                pass
        self._mark_dead(slot, reason)

    def shutdown(self, graceful: bool = True) -> None:
        live = [s for s in self._slots.values() if s.status in (READY, STARTING)]
        if graceful and live:
            refs = [s.actor.shutdown.remote() for s in live if s.status == READY]
            ray.wait(refs, num_returns=len(refs), timeout=30)
        for slot in list(self._slots.values()):
            if slot.status != DEAD:
                self.kill(slot.wid, "run ended")
        if self._agents is not None:
            self._agents.shutdown()

    def _death_reason(self, slot: _Slot, error: str) -> tuple[str, Cause]:
        """Node lost when the worker's node is gone from the cluster, else the actor died
        (`error`: the first line of Ray's error)."""
        node_id = slot.info.node_id if slot.info else None
        if node_id is not None and node_id not in self._nodes_alive():
            return f"node lost: node {node_id[:12]} left the cluster ({error})", Cause.NODE_LOST
        return f"actor died: {error}", Cause.WORKER_DIED


def _lost(failures: dict[int, tuple[Cause, str]]) -> WorkerLostError:
    """The error of a call that failed on `failures`' workers, naming them and why."""
    return WorkerLostError("; ".join(message for _, message in failures.values()),
                           lost={wid: cause for wid, (cause, _) in failures.items()})


def _available_resources() -> dict[str, float] | str:
    try:
        return {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
    except Exception:   # noqa: BLE001 - only for the warning's words
        return "unknown"


def _silence(slot: _Slot, as_of: float) -> float:
    """Seconds the worker had not answered as of `as_of`: the tick's time, or for a worker whose
    agent answered in this tick without it, when the agent made that answer (the controller's own
    lateness in taking it is not the worker's silence). The upper bound on how long a fault went
    unseen."""
    if slot.status == DEAD:
        return slot.silent_at_death
    if slot.status == READY and (slot.poll_ref is not None or slot.agent is not None):
        return max(0.0, as_of - slot.last_answer_at)
    return 0.0


def _without_records(report: WorkerReport) -> WorkerReport:
    from dataclasses import replace
    return replace(report, records=[])


def _merge_records(old: WorkerReport, new: WorkerReport) -> WorkerReport:
    from dataclasses import replace
    return replace(new, records=old.records + new.records)

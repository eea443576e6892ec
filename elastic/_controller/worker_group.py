"""The worker group on Ray: one TrainWorker actor per worker slot, in a placement group of its own
(one per replica under tensor parallelism: placement).

Only this module and its parts talk to Ray about workers: placement (the slots' placements and
their actors' starts) and agent_pool (the node agents that may carry their polls); the slot table
(slot_table) holds what became of each slot. It is non-blocking: `tick()` advances pending
placements, collects poll answers and sends new polls, and returns a view the controller decides
on. A placement group that cannot be placed yet stays pending, so replacements start by
themselves when capacity returns (a node comes back, resources free up).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import ray
from ray import ObjectRef
from ray.exceptions import GetTimeoutError, RayError, RayTaskError
from ray.util.placement_group import remove_placement_group

from elastic._controller.agent_pool import AgentPool
from elastic._controller.placement import Placements
from elastic._controller.ray_calls import answered, first_line, poll_failure
from elastic._controller.slot_table import DEAD, READY, STARTING, Slot, SlotTable, WorkerView
from elastic._node_keeper import kept_copies
from elastic._protocol import GenerationPlan, PollFailure, RunSpec, WorkerInfo, WorkerReport
from elastic._run_names import NAMESPACE, RunNames, remove_holders
from elastic.errors import WorkerLostError
from elastic.policies import Cause

log = logging.getLogger("elastic.group")

SLOW_TICK_S = 2.0    # a tick is normally milliseconds: Ray calls that block show up here


class PollTerms(NamedTuple):
    """What a tick's polls ask of the workers (the controller's terms, from its running judge)."""

    hold_s: float = 0.0           # a worker may hold its answer this long when nothing happens,
    wake_s: float | None = None   # and answers when its training thread's wait crosses this (or None)


class RayWorkerGroup:
    """The run's workers on Ray, as the controller acts on them (collaborators.WorkerGroup)."""

    def __init__(self, spec: RunSpec, *, clock: Callable[[], float] = time.monotonic, names: RunNames | None = None):
        """`names`: the run's names (elastic._run_names): its workers outlive this controller, and a
        replacement adopts them (`adopt`). None: they die with it."""
        self._clock = clock          # monotonic: placements, answers, deaths
        self._failure = spec.failure
        self._names = names
        self._slots = SlotTable(spec.failure, clock)
        self._placements = Placements(spec, self._slots, clock, names)
        self._alive_nodes: set[str] | None = None    # ray.nodes() as read in this tick (None: not yet)
        # ScalingConfig.node_agents: one agent per node carries its workers' polls (agent_pool).
        self._agents = AgentPool(spec.failure.rendezvous_timeout_s, self._nodes_alive, self._slots.released,
                                 self._lost_with_agent, clock=clock) if spec.scaling.node_agents else None
        self.terms = PollTerms()     # the last tick's poll terms (wait() waits on held polls by them)

    # ---- capacity ----------------------------------------------------------------------
    def scale_to(self, n: int) -> None:
        """Keep `n` worker slots alive or pending; start placements for the missing ones."""
        self._placements.scale_to(n)

    def avoid_nodes(self, node_ids: tuple[str, ...]) -> None:
        """New placements exclude these nodes (those already granted stay where they are)."""
        self._placements.avoid = node_ids

    @property
    def next_wid(self) -> int:
        return self._slots.next_wid

    # ---- a lost controller's workers -----------------------------------------------------
    def adopt(self, after_step: int, next_wid: int) -> dict[int, tuple[WorkerReport, float]]:
        """Take over the run's live workers from a lost controller: each is asked for its report,
        with its records of the steps after `after_step` (the lost controller's journal has the
        ones before), and becomes a ready slot of this group. A worker that does not answer within
        heartbeat_timeout_s is killed (it would be replaced as silent anyway), and the placement
        groups no adopted worker holds (placements the lost controller had not filled) are removed.
        New slots are numbered from `next_wid` on. Returns worker id -> (its report, seconds since
        the lost controller's last poll of it)."""
        from ray.util.placement_group import remove_placement_group
        assert self._names is not None, "only a run's named workers can be adopted"
        self._slots.continue_from(next_wid)
        groups = self._names.placement_groups()
        calls: dict[str, tuple[Any, Any, ObjectRef, ObjectRef]] = {}
        for name, parsed in self._names.workers().items():
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:        # gone since it was listed
                continue
            calls[name] = (parsed, actor, actor.adopt.remote(after_step), actor.info.remote())
        adopted: dict[int, tuple[WorkerReport, float]] = {}
        deadline = self._clock() + self._failure.heartbeat_timeout_s
        for parsed, actor, adopt_ref, info_ref in calls.values():
            pg = groups.get(parsed.placement_group)
            try:
                answer: tuple[WorkerReport, float]
                info: WorkerInfo
                answer, info = ray.get([adopt_ref, info_ref], timeout=max(0.0, deadline - self._clock()))
                report, since = answer
            except RayError as error:
                log.warning("worker %d could not be adopted (%s): it is replaced", parsed.wid, first_line(error))
                ray.kill(actor, no_restart=True)
                continue
            if pg is None:            # not expected: a live worker's group is not removed
                log.warning("worker %d could not be adopted: its placement group %s is gone", parsed.wid,
                            parsed.placement_group)
                ray.kill(actor, no_restart=True)
                continue
            now = self._clock()
            self._slots.add(Slot(wid=parsed.wid, pg=pg, pg_ready=pg.ready(), created_at=now, bundle=parsed.bundle,
                                 status=READY, actor=actor, info=info, last_answer_at=now, report=report,
                                 seq_seen=report.seq, pg_name=parsed.placement_group))
            adopted[parsed.wid] = report, since
        held = {slot.pg_name for slot in self._slots if slot.status != DEAD}
        for name, pg in groups.items():
            if name not in held:
                try:
                    remove_placement_group(pg)
                except Exception:
                    log.debug("could not remove placement group %s", name, exc_info=True)
        return adopted

    def bury(self, wid: int, reason: str) -> None:
        """A worker the lost controller had that is gone: its slot, dead (a generation's member
        lost while no controller was there is then a fault like any other)."""
        now = self._clock()
        self._slots.add(Slot(wid=wid, pg=None, pg_ready=None, created_at=now, status=DEAD, death=reason,
                             death_cause=Cause.WORKER_DIED, died_at=now))

    # ---- the tick ----------------------------------------------------------------------
    def tick(self, terms: PollTerms | None = None) -> dict[int, WorkerView]:
        """Poll the workers with `terms` (None: the last tick's) and return what they said."""
        if terms is not None:
            self.terms = terms
        now = self._clock()
        self._alive_nodes = None
        self._slots.drop_dead(now)
        for failed in self._placements.advance(now):
            if failed.alive:
                self.kill(failed.slot.wid, failed.reason)
            else:
                self._mark_dead(failed.slot, failed.reason)
        if self._agents is not None:
            self._agents.advance(self._slots.ready_nodes(), now)
        placed = self._clock()
        answered_at = self._collect_polls(now)
        if self._agents is not None:
            self._agents.retire(self._slots.ready_nodes(), now)
        collected = self._clock()
        self._send_polls()
        sent = self._clock()
        if sent - now > SLOW_TICK_S:
            # Detection of every failure waits for the tick: say where a tick was held up.
            log.warning("worker group tick took %.1fs (placements %.1fs, collecting polls %.1fs, sending "
                        "polls %.1fs)", sent - now, placed - now, collected - placed, sent - collected)
        return self._slots.views(now, answered_at)

    def wait(self, timeout_s: float) -> None:
        """Block until a worker may have news for the controller, or `timeout_s` passes: a held
        poll answered (a held poll answers early only on news, and a death fails it at once), a
        placement granted, an actor started. Polls that are not held are not waited on: each is
        answered at once with or without news, and would wake the controller every time."""
        if timeout_s <= 0:
            return
        refs = self._placements.refs()
        if self.terms.hold_s > 0:
            refs += [s.poll_ref for s in self._slots.in_status(READY) if s.poll_ref is not None]
        if self._agents is not None:
            refs += self._agents.refs(polls=self.terms.hold_s > 0)
        if refs:
            ray.wait(refs, num_returns=1, timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def _collect_polls(self, now: float) -> dict[str, float]:
        """Take the answers that came; returns, for each agent whose answer came in this tick, when
        it made it (its workers' silence is judged as of then: node_agent's "Silence")."""
        got, _ = answered(self._slots.in_status(READY), lambda s: s.poll_ref)
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

    def _take(self, slot: Slot, answer: WorkerReport | PollFailure, now: float) -> None:
        """A worker's poll answer, whether it came directly or through its node's agent."""
        failed = self._slots.take(slot, answer, now)
        if failed is None:
            return
        if failed.actor_gone:
            self._mark_dead(slot, *self._death_reason(slot, failed.message))
        else:
            # The poll itself raised: a worker that cannot report cannot be watched. Replace it.
            self.kill(slot.wid, f"its poll failed: {failed.message}")

    def _send_polls(self) -> None:
        for slot in self._slots.in_status(READY):
            if slot.poll_ref is not None or slot.agent is not None:
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
    def _lost_with_agent(self, wids: list[int], node_id: str, why: str) -> None:
        """Their agent was lost with its node: so are they."""
        now = self._clock()
        for wid in wids:
            slot = self._slots.get(wid)
            if slot is not None and slot.status == READY:
                self._slots.silenced(slot, now)
                self._mark_dead(slot, f"node lost: node {node_id[:12]} left the cluster (its agent: {why})",
                                Cause.NODE_LOST)

    def _nodes_alive(self) -> set[str]:
        """The cluster's live nodes, read once per tick (a lost node kills 8 workers at once)."""
        if self._alive_nodes is None:
            self._alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return self._alive_nodes

    def _mark_dead(self, slot: Slot, reason: str, cause: Cause = Cause.WORKER_DIED) -> None:
        agent = slot.agent
        if not self._slots.mark_dead(slot, reason, cause):
            return
        if agent is not None and self._agents is not None:
            self._agents.forget(agent, slot.wid)
        (log.info if reason == "run ended" else log.warning)("worker %d is dead: %s", slot.wid, reason)
        if slot.pg is None or not self._slots.placement_unused(slot):
            return       # its replica's peers live: a replacement goes into its bundle, beside them
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

    def node_copies(self) -> list[tuple[str, int, int, int, int]]:
        if self._names is None:
            return []
        try:
            return kept_copies(self._names)
        except Exception:   # the GCS unreachable: the run takes the checkpoint
            log.warning("could not ask the nodes' keepers for their copies", exc_info=True)
            return []

    def shutdown(self, graceful: bool = True) -> None:
        """The run ended: its workers leave (gracefully: each returns from its shutdown first),
        then what they left in Ray goes too: the node agents, and the actors holding the run's Ray
        Datasets and its copies in the nodes' keepers (after the workers, which would find, or
        make, them again)."""
        live = [s for s in self._slots if s.status in (READY, STARTING)]
        if graceful and live:
            refs = [s.actor.shutdown.remote() for s in live if s.status == READY]
            ray.wait(refs, num_returns=len(refs), timeout=30)
        for slot in list(self._slots):
            if slot.status != DEAD:
                self.kill(slot.wid, "run ended")
        if self._agents is not None:
            self._agents.shutdown()
        if self._names is not None:
            remove_holders(self._names.run_id)

    def _death_reason(self, slot: Slot, error: str) -> tuple[str, Cause]:
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


"""The node agents as the worker group uses them (`ScalingConfig.node_agents`): one agent actor
per node with a ready worker (node_agent.NodeAgent), the workers each one carries, its polls,
and its start, loss and retirement.

One role: it keeps the agents and talks to Ray about them. The worker slots stay the worker
group's (worker_group.RayWorkerGroup): the group hands a ready worker to its node's agent, takes
the answers the pool collects as if they came from the workers, and hears from the pool, through
the two callbacks it gives, when workers go back to direct polls (their agent stopped) or are
lost with their agent's node.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import ObjectRef
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic._controller.node_agent import WAIT_MARGIN_S, NodeAgent
from elastic._controller.ray_calls import answered, error_line
from elastic._protocol import PollFailure, WorkerReport

log = logging.getLogger("elastic.group")

AGENT_STALL_S = 1.0       # beyond its hold and margin, an agent's poll this late is a stuck agent
AGENT_RETRY_S = 30.0      # after an agent failed on a node, poll its workers directly this long
AGENT_IDLE_S = 60.0       # an agent whose node has had no ready worker this long is stopped


@dataclass
class _Agent:
    """A node agent as the pool sees it."""

    node_id: str
    actor: Any
    ready_ref: ObjectRef | None        # its ready() while it starts; None once it answered
    started_at: float
    poll_ref: ObjectRef | None = None
    polled_at: float = 0.0             # when its poll went out (monotonic), held up to hold_s
    hold_s: float = 0.0
    carries: set[int] = field(default_factory=set)   # the workers whose polls it carries
    handed: dict[int, tuple[Any, int]] = field(default_factory=dict)  # carried from this tick on: (actor, acked)
    idle_since: float | None = None    # since when its node has had no ready worker
    forget: list[int] = field(default_factory=list)  # workers to drop with its next poll


class AgentPool:
    """`released(wids)`: these workers' agent stopped; they are polled directly from the next
    tick. `lost(wids, node_id, why)`: their agent was lost with its node; they are lost too."""

    def __init__(self, rendezvous_timeout_s: float, nodes_alive: Callable[[], set[str]],
                 released: Callable[[list[int]], None], lost: Callable[[list[int], str, str], None], *,
                 clock: Callable[[], float] = time.monotonic):
        self._rendezvous_timeout_s = rendezvous_timeout_s
        self._clock = clock
        self._nodes_alive = nodes_alive
        self._released, self._lost = released, lost
        self._agents: dict[str, _Agent] = {}
        self._failed_at: dict[str, float] = {}   # node -> when its agent last failed (start, loss, late)

    def carrier(self, node_id: str) -> bool:
        """Whether the node has a started agent to carry a worker's polls."""
        agent = self._agents.get(node_id)
        return agent is not None and agent.ready_ref is None

    def hand(self, node_id: str, wid: int, actor: Any, acked: int) -> None:
        """The node's agent carries worker `wid` from now on (`acked`: its newest answer received)."""
        agent = self._agents[node_id]
        agent.carries.add(wid)
        agent.handed[wid] = (actor, acked)

    def forget(self, node_id: str, wid: int) -> None:
        """Worker `wid` is dead: its agent polls it no more."""
        agent = self._agents.get(node_id)
        if agent is not None:
            agent.carries.discard(wid)
            agent.forget.append(wid)

    def advance(self, ready_nodes: set[str], now: float) -> None:
        """Start an agent on each node with ready workers, take the started ones into use, and
        give up on those that fail to start."""
        for node_id in sorted(ready_nodes - set(self._agents)):
            if now - self._failed_at.get(node_id, -AGENT_RETRY_S) >= AGENT_RETRY_S:
                self._launch(node_id, now)
        started, starting = answered(list(self._agents.values()), lambda a: a.ready_ref)
        for agent, ref in started:
            try:
                ray.get(ref)
                agent.ready_ref = None
                log.info("node agent on node %s is up: it carries the polls of that node's workers", agent.node_id[:12])
            except RayError as error:
                self._failed(agent, f"failed to start: {error}", now)
        for agent in starting:
            if now - agent.started_at > self._rendezvous_timeout_s:
                self._failed(agent, "did not start within FailureConfig.rendezvous_timeout_s", now)

    def collect(self, now: float) -> list[tuple[str, dict[int, WorkerReport | PollFailure], float]]:
        """The answers the agents have sent (node, {wid: answer}, answered_at); an agent whose poll
        failed is dropped here (and its node's workers lost, if the node is gone). `answered_at`
        (monotonic, this process) is when the agent fixed its answer, at the latest `now`: its
        poll's send time plus how long the agent says it ran (node_agent.AgentAnswers); an
        answer without that is taken as of `now`."""
        out = []
        got, _ = answered(list(self._agents.values()), lambda a: a.poll_ref)
        for agent, ref in got:
            try:
                answers = ray.get(ref)
            except RayError as error:
                self._agent_lost(agent, error_line(error), now)
                continue
            agent.poll_ref = None
            waited_s = getattr(answers, "waited_s", None)
            answered_at = now if waited_s is None else min(now, agent.polled_at + max(0.0, waited_s))
            out.append((agent.node_id, answers, answered_at))
        return out

    def retire(self, ready_nodes: set[str], now: float) -> None:
        """After the answers of this tick are taken: give up on an agent whose answer is overdue
        (its workers would all look silent to the hang watch: they are polled directly instead;
        what it held is sent again, state.Outbox), and stop one whose node has had no ready
        worker for AGENT_IDLE_S (a recovery's replacement on its node would otherwise wait for
        a new agent's start)."""
        for agent in list(self._agents.values()):
            late = now - agent.polled_at - agent.hold_s - WAIT_MARGIN_S
            if agent.poll_ref is not None and late > AGENT_STALL_S:
                self._failed(agent, f"its poll is {late:.1f}s late", now)
                continue
            agent.idle_since = None if agent.node_id in ready_nodes else (agent.idle_since or now)
            if agent.poll_ref is None and agent.idle_since is not None and now - agent.idle_since >= AGENT_IDLE_S:
                self._drop(agent, "no worker left on its node", quiet=True)

    def send_polls(self, hold_s: float, acked: Callable[[int], int], wake_s: float | None = None) -> None:
        """The handed workers to their agents, and a poll to each started agent that carries
        workers and has none out (`acked(wid)`: the newest answer received from a worker;
        `hold_s`, `wake_s`: worker.poll's)."""
        for agent in self._agents.values():
            if agent.handed:
                agent.actor.watch.remote(agent.handed)
                agent.handed = {}
            if agent.ready_ref is None and agent.poll_ref is None and agent.carries:
                agent.poll_ref = agent.actor.poll.remote(hold_s, agent.forget, {w: acked(w) for w in agent.carries},
                                                         wake_s)
                agent.polled_at, agent.hold_s = self._clock(), hold_s
                agent.forget = []

    def refs(self, polls: bool) -> list[ObjectRef]:
        """What the group's wait may wake on: the agents' starts, and their polls if `polls` (when
        the polls are held: an unheld one answers at once and would wake the controller each time)."""
        return [ref for a in self._agents.values() for ref in (a.ready_ref, a.poll_ref if polls else None)
                if ref is not None]

    def shutdown(self) -> None:
        for agent in list(self._agents.values()):
            self._drop(agent, "run ended", quiet=True)

    def _launch(self, node_id: str, now: float) -> None:
        actor: Any = ray.remote(NodeAgent).options(
            num_cpus=0, max_concurrency=2, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        self._agents[node_id] = _Agent(node_id=node_id, actor=actor, ready_ref=actor.ready.remote(), started_at=now)

    def _failed(self, agent: _Agent, why: str, now: float) -> None:
        """An agent that failed is not replaced on its node for AGENT_RETRY_S (its workers are
        polled directly meanwhile): one that fails again and again must not cost a start per tick."""
        self._failed_at[agent.node_id] = now
        self._drop(agent, why)

    def _agent_lost(self, agent: _Agent, why: str, now: float) -> None:
        """An agent died: with its node (its workers are lost too), or alone (they go on, polled
        directly until a new agent starts)."""
        if agent.node_id in self._nodes_alive():
            self._failed(agent, f"was lost ({why})", now)
            return
        self._lost(sorted(agent.carries), agent.node_id, why)
        agent.carries.clear()
        self._drop(agent, "was lost with its node", quiet=True)

    def _drop(self, agent: _Agent, why: str, quiet: bool = False) -> None:
        """Stop using an agent: the workers it carried are polled directly from the next tick."""
        del self._agents[agent.node_id]
        carried = sorted(agent.carries)
        self._released(carried)
        if quiet:
            log.debug("node agent on node %s stopped: %s", agent.node_id[:12], why)
        else:
            log.warning("node agent on node %s %s: %d of its workers are polled directly until a new agent "
                        "starts", agent.node_id[:12], why, len(carried))
        try:
            ray.kill(agent.actor, no_restart=True)
        except Exception:   # noqa: BLE001 - already gone
            pass

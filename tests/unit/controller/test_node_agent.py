"""Node agents (ScalingConfig.node_agents): the agent that carries one node's workers' polls, and
the worker group's routing through it, with Ray faked (refs that are ready or not, actors whose
methods record their calls). The end-to-end runs through real agents are in
tests/integration/test_runtime.py (a worker killed) and test_node_loss.py (a node lost)."""
from __future__ import annotations

import logging

import pytest
from fake_ray import spec_of
from ray.exceptions import ActorDiedError, RayTaskError

import elastic._controller.agent_pool as agent_pool
import elastic._controller.placement as placement
import elastic._controller.ray_calls as ray_calls
import elastic._controller.worker_group as ray_group
from elastic._controller.agent_pool import AGENT_IDLE_S, AGENT_RETRY_S, AGENT_STALL_S
from elastic._controller.node_agent import NodeAgent, hold_until_beat, one_record_per_step
from elastic._controller.slot_table import DEAD, READY, Slot
from elastic._controller.worker_group import PollTerms, RayWorkerGroup
from elastic._protocol import PollFailure, StepRecord, WorkerInfo, WorkerReport
from elastic.config import FailureConfig, ScalingConfig
from elastic.policies import Cause

pytestmark = pytest.mark.timeout(30)

PENDING = object()     # a ref whose call has not answered
A, B = "a" * 56, "b" * 56      # node ids (Ray checks that they are hex)


class Ref:
    def __init__(self, outcome=PENDING):
        self.outcome = outcome


class Method:
    """An actor method: each call makes a pending ref (answered by the test) and is recorded."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.refs: list[Ref] = []

    def remote(self, *args):
        self.calls.append(args)
        self.refs.append(Ref())
        return self.refs[-1]


class Actor:
    def __init__(self, *names):
        for name in names:
            setattr(self, name, Method())


class FakeRay:
    def __init__(self, clock=None):
        self.killed: list = []
        self.agents: list[Actor] = []
        self.alive = {A, B}
        self.clock = clock

    def get(self, ref, timeout=None):
        assert ref.outcome is not PENDING
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.outcome is not PENDING]
        if not ready and self.clock is not None and timeout:
            self.clock.now += timeout          # nothing answers: the wait runs out
        return ready, [r for r in refs if r.outcome is PENDING]

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)

    def nodes(self):
        return [{"NodeID": n, "Alive": True} for n in self.alive]

    def remote(self, cls):
        fake = self

        class Options:
            def options(self, **kwargs):
                return self

            def remote(self):
                fake.agents.append(Actor("ready", "watch", "poll"))
                return fake.agents[-1]
        return Options()


def died() -> ActorDiedError:
    return ActorDiedError()


def task_error(message: str) -> RayTaskError:
    return RayTaskError("poll", f"Traceback (most recent call last):\n  ...\nRuntimeError: {message}",
                        RuntimeError(message)).as_instanceof_cause()


def report(step: int = 1, seq: int = 0) -> WorkerReport:
    return WorkerReport(phase="running", generation=0, rank=0, step=step, has_state=True, records=[], seq=seq)


# ---- the agent ------------------------------------------------------------------------------
class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def test_holds_end_on_a_common_beat_never_past_the_controllers_hold():
    assert hold_until_beat(1.0, 100.25) == pytest.approx(0.75)
    assert hold_until_beat(1.0, 100.9) == pytest.approx(0.1)     # to the beat, not a whole hold more
    assert hold_until_beat(1.0, 100.0) == pytest.approx(1.0)
    assert all(0 < hold_until_beat(0.5, t / 7) <= 0.5 for t in range(200))
    assert {round(t + hold_until_beat(1.0, t), 6) for t in (100.1, 100.5, 100.99)} == {101.0}
    assert hold_until_beat(0.0, 100.3) == 0.0                   # unheld polls stay unheld


def agent_with(clock: Clock, *wids: int) -> tuple[NodeAgent, FakeRay, dict[int, Actor]]:
    fake = FakeRay(clock)
    agent = NodeAgent(clock=clock, ray_api=fake)
    workers = {wid: Actor("poll") for wid in wids}
    agent.watch({wid: (actor, 0) for wid, actor in workers.items()})
    return agent, fake, workers


def test_the_agent_polls_each_worker_once_and_returns_every_answer_that_came():
    clock = Clock(100.25)
    agent, _, workers = agent_with(clock, 0, 1, 2)
    assert [w.poll.calls for w in workers.values()] == [[(0.0, 0, None)]] * 3   # no hold known yet: at once
    workers[0].poll.refs[0].outcome = report(1)
    workers[2].poll.refs[0].outcome = report(1)
    answers = agent.poll(1.0, forget=[])
    assert answers == {0: report(1), 2: report(1)}
    workers[1].poll.refs[0].outcome = report(2)
    assert agent.poll(1.0, forget=[], acked={0: 7, 2: 5}, wake_s=2.4) == {1: report(2)}
    # The next poll sent the answered ones a new poll, held to the beat and acknowledging the
    # answers the controller has; worker 1's first was still out.
    assert workers[0].poll.calls[-1] == (pytest.approx(0.75), 7, 2.4)   # and to wake at the hang bound
    assert workers[2].poll.calls[-1] == (pytest.approx(0.75), 5, 2.4)
    assert len(workers[1].poll.calls) == 1


def test_the_agent_answers_after_the_hold_with_nothing_when_no_worker_answers():
    clock = Clock()
    agent, _, _ = agent_with(clock, 0)
    assert agent.poll(1.0, forget=[]) == {}
    assert clock.now >= 101.0                    # it waited the hold (and its margin), in slices


def test_a_worker_whose_poll_fails_is_reported_once_and_polled_no_more():
    clock = Clock()
    agent, _, workers = agent_with(clock, 0, 1)
    workers[0].poll.refs[0].outcome = task_error("poll broke")
    workers[1].poll.refs[0].outcome = died()
    answers = agent.poll(1.0, forget=[])
    assert answers[0] == PollFailure(actor_gone=False, message="RuntimeError: poll broke")
    assert answers[1].actor_gone and isinstance(answers[1], PollFailure)
    assert agent.poll(1.0, forget=[]) == {}
    assert [len(w.poll.calls) for w in workers.values()] == [1, 1]


def record(step: int, *, compute_s: tuple[float, ...] = (), kind: str = "step", generation: int = 0,
           loss: float | None = 2.0) -> StepRecord:
    return StepRecord(step=step, loss=loss, world_size=3, time=float(step), samples_seen=8 * step, global_batch=8,
                      compute_s=compute_s, kind=kind, generation=generation)


def with_records(rank: int, *records: StepRecord, step: int = 4) -> WorkerReport:
    return WorkerReport(phase="running", generation=0, rank=rank, step=step, has_state=True,
                        records=list(records), seq=1)


def test_each_steps_record_travels_once_per_message_the_copy_with_compute_times_kept():
    times = (0.1, 0.2, 0.3)
    log = record(2, kind="log", loss=None)
    answers = {
        5: with_records(1, record(1), record(2)),
        6: with_records(0, record(1, compute_s=times), record(2, compute_s=times), log),
        7: with_records(2, record(2), record(3), record(2, generation=1)),   # 3: only this rank had it yet
        8: PollFailure(actor_gone=True, message="gone"),
    }
    shed = one_record_per_step(answers)
    assert shed[5].records == []                                           # both its steps ride on rank 0's
    assert shed[6].records == [record(1, compute_s=times), record(2, compute_s=times), log]
    assert shed[7].records == [record(3), record(2, generation=1)]         # another generation's step 2 is another step
    assert shed[8] == answers[8]
    # Nothing but the copies went: every answer's other fields are the worker's own.
    assert [(a.rank, a.step, a.seq) for a in (shed[5], shed[6], shed[7])] == [(1, 4, 1), (0, 4, 1), (2, 4, 1)]
    # Every (generation, step) of the message is still there, exactly once.
    steps = [(r.generation, r.step) for a in shed.values() if isinstance(a, WorkerReport)
             for r in a.records if r.kind == "step"]
    assert sorted(steps) == [(0, 1), (0, 2), (0, 3), (1, 2)]
    # Without compute times anywhere, the first copy is kept.
    assert one_record_per_step({1: with_records(1, record(4)), 2: with_records(2, record(4))}) == {
        1: with_records(1, record(4)), 2: with_records(2)}


def test_the_agents_answer_carries_each_steps_record_once():
    clock = Clock()
    agent, _, workers = agent_with(clock, 0, 1)
    workers[0].poll.refs[0].outcome = with_records(0, record(1, compute_s=(0.1, 0.2)))
    workers[1].poll.refs[0].outcome = with_records(1, record(1))
    answers = agent.poll(1.0, forget=[])
    assert answers[0].records == [record(1, compute_s=(0.1, 0.2))] and answers[1].records == []


def test_a_forgotten_worker_is_no_longer_polled_nor_answered_for():
    clock = Clock()
    agent, _, workers = agent_with(clock, 0, 1)
    workers[0].poll.refs[0].outcome = report()
    assert agent.poll(1.0, forget=[0]) == {}
    workers[1].poll.refs[0].outcome = report()
    assert agent.poll(1.0, forget=[]) == {1: report()}
    assert len(workers[0].poll.calls) == 1


# ---- the worker group's routing -------------------------------------------------------------
@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    for module in (ray_group, placement, agent_pool, ray_calls):
        monkeypatch.setattr(module, "ray", fake)
    monkeypatch.setattr(ray_group, "remove_placement_group", lambda pg: None)
    return fake


def group_on(nodes: dict[int, str], agents: bool = True) -> RayWorkerGroup:
    # The group's clock reads the time module's as the test sets it (monkeypatch), tick by tick.
    group = RayWorkerGroup(spec_of(ScalingConfig(min_workers=1, max_workers=len(nodes), node_agents=agents),
                                   FailureConfig(heartbeat_timeout_s=5.0)), clock=lambda: ray_group.time.monotonic())
    group.terms = PollTerms(hold_s=1.0)
    for wid, node in nodes.items():
        group._slots.add(Slot(wid=wid, pg=None, pg_ready=None, created_at=0.0, status=READY,
                              actor=Actor("poll"), info=WorkerInfo(pid=wid, node_id=node, actor_id="", ip="")))
    return group


def started(group: RayWorkerGroup, fake: FakeRay) -> list[Actor]:
    """Tick until the group has launched its agents; then they answer ready()."""
    group.tick()
    for agent in fake.agents:
        agent.ready.refs[0].outcome = "node"
    return fake.agents


def test_without_agents_every_worker_is_polled_directly(fake_ray):
    group = group_on({0: A, 1: A}, agents=False)
    views = group.tick()
    assert fake_ray.agents == [] and not any(v.via_agent for v in views.values())
    assert [len(group._slots[w].actor.poll.calls) for w in (0, 1)] == [1, 1]


def test_each_nodes_agent_takes_its_workers_polls_and_their_answers_reach_the_views(fake_ray):
    group = group_on({0: A, 1: A, 2: B})
    a, b = started(group, fake_ray)
    # Until its agent answered ready(), each worker was polled directly; that poll is collected.
    for wid in (0, 1, 2):
        group._slots[wid].actor.poll.refs[0].outcome = report(1)
    views = group.tick()
    assert {w: v.via_agent for w, v in views.items()} == {0: True, 1: True, 2: True}
    assert a.watch.calls == [({0: (group._slots[0].actor, 0), 1: (group._slots[1].actor, 0)},)]
    assert b.watch.calls == [({2: (group._slots[2].actor, 0)},)]
    assert a.poll.calls == [(1.0, [], {0: 0, 1: 0}, None)] and b.poll.calls == [(1.0, [], {2: 0}, None)]
    a.poll.refs[0].outcome = {0: report(2, seq=2), 1: report(3, seq=4)}
    group.terms = group.terms._replace(wake_s=2.4)         # the controller has learned a hang bound
    views = group.tick()
    assert (views[0].report.step, views[1].report.step, views[2].report.step) == (2, 3, 1)
    assert [len(group._slots[w].actor.poll.calls) for w in (0, 1, 2)] == [1, 1, 1]   # no direct polls since
    assert len(a.poll.calls) == 2 and len(b.poll.calls) == 1      # a new poll to the agent that answered,
    assert a.poll.calls[-1] == (1.0, [], {0: 2, 1: 4}, 2.4)        # acknowledging what came, with the bound


def test_deaths_and_failed_polls_that_an_agent_reports_are_acted_on_as_direct_ones(fake_ray):
    group = group_on({0: A, 1: A, 2: A})
    (agent,) = started(group, fake_ray)
    for wid in (0, 1, 2):
        group._slots[wid].actor.poll.refs[0].outcome = report(1)
    group.tick()
    agent.poll.refs[0].outcome = {0: PollFailure(actor_gone=True, message="The actor died unexpectedly"),
                                  1: PollFailure(actor_gone=False, message="RuntimeError: poll broke")}
    views = group.tick()
    assert views[0].status == DEAD and views[0].death_cause == Cause.WORKER_DIED
    assert views[0].death == "actor died: The actor died unexpectedly"
    assert views[1].status == DEAD and views[1].death == "its poll failed: RuntimeError: poll broke"
    assert group._slots[1].actor in fake_ray.killed and views[2].status == READY
    assert agent.poll.calls[-1] == (1.0, [0, 1], {2: 0}, None)    # the agent is told to drop them


def test_an_agent_lost_alone_hands_its_workers_back_to_direct_polls_and_is_not_restarted_at_once(fake_ray):
    group = group_on({0: A, 1: A})
    (agent,) = started(group, fake_ray)
    for wid in (0, 1):
        group._slots[wid].actor.poll.refs[0].outcome = report(1, seq=1)
    group.tick()
    agent.poll.refs[0].outcome = {0: report(2, seq=2)}
    group.tick()
    agent.poll.refs[1].outcome = died()
    group.terms = group.terms._replace(wake_s=2.4)
    views = group.tick()
    assert all(v.status == READY and not v.via_agent for v in views.values())
    # Polled directly again, acknowledging the newest answers that came: a worker whose answer
    # the agent took with it sends its records again (state.Outbox).
    assert [group._slots[w].actor.poll.calls[-1] for w in (0, 1)] == [(1.0, 2, 2.4), (1.0, 1, 2.4)]
    assert agent in fake_ray.killed and len(fake_ray.agents) == 1
    group._agents._failed_at[A] -= AGENT_RETRY_S                 # the retry delay has passed
    group.tick()
    assert len(fake_ray.agents) == 2


def test_an_agent_lost_with_its_node_loses_its_workers_as_node_lost(fake_ray):
    group = group_on({0: A, 1: A, 2: B})
    a, b = started(group, fake_ray)
    for wid in (0, 1, 2):
        group._slots[wid].actor.poll.refs[0].outcome = report(1)
    group.tick()
    fake_ray.alive = {B}
    a.poll.refs[0].outcome = died()
    views = group.tick()
    assert [(views[w].status, views[w].death_cause) for w in (0, 1)] == [(DEAD, Cause.NODE_LOST)] * 2
    assert views[0].death.startswith("node lost: node aaaaaaaaaaaa left the cluster (its agent: ")
    assert views[2].status == READY and views[2].via_agent


def test_an_agent_whose_answer_is_overdue_is_replaced_by_direct_polls(fake_ray, monkeypatch, caplog):
    group = group_on({0: A})
    (agent,) = started(group, fake_ray)
    group._slots[0].actor.poll.refs[0].outcome = report(1)
    group.tick()
    assert group._slots[0].agent == A
    clock = ray_group.time.monotonic() + group.terms.hold_s + 0.25 + AGENT_STALL_S + 0.1
    monkeypatch.setattr(ray_group.time, "monotonic", lambda: clock)
    with caplog.at_level(logging.WARNING, logger="elastic.group"):
        views = group.tick()
    assert not views[0].via_agent and agent in fake_ray.killed
    assert "its poll is" in caplog.text and "1 of its workers are polled directly" in caplog.text


def test_an_answer_that_is_there_when_the_controller_looks_late_is_taken_not_judged_overdue(fake_ray, monkeypatch):
    # The controller's own tick may come late (a busy process): what counts is the agent's answer.
    group = group_on({0: A})
    (agent,) = started(group, fake_ray)
    group._slots[0].actor.poll.refs[0].outcome = report(1)
    group.tick()
    agent.poll.refs[0].outcome = {0: report(2)}
    clock = ray_group.time.monotonic() + group.terms.hold_s + 0.25 + AGENT_STALL_S + 0.1
    monkeypatch.setattr(ray_group.time, "monotonic", lambda: clock)
    views = group.tick()
    assert views[0].via_agent and views[0].report.step == 2 and agent not in fake_ray.killed


def test_an_agent_outlives_its_nodes_workers_for_a_while_so_a_replacement_finds_it(fake_ray, monkeypatch):
    group = group_on({0: A})
    (agent,) = started(group, fake_ray)
    group._slots[0].actor.poll.refs[0].outcome = report(1)
    group.tick()
    agent.poll.refs[0].outcome = {0: PollFailure(actor_gone=True, message="The actor died unexpectedly")}
    group.tick()                                   # its only worker died: the agent idles
    assert agent not in fake_ray.killed
    clock = ray_group.time.monotonic() + AGENT_IDLE_S + 1
    monkeypatch.setattr(ray_group.time, "monotonic", lambda: clock)
    group.tick()
    assert agent in fake_ray.killed and group._agents._agents == {}


def test_a_worker_whose_answer_missed_its_agents_message_is_not_silent_for_the_controllers_late_tick(
        fake_ray, monkeypatch):
    """R3-5's repro: the agent's message carries worker 0; worker 1 answered the agent 20 ms later,
    past the coalescing window. The controller's tick is then blocked for 12 s (a stalled
    storage call, a Ray call). The tick that takes the message must judge worker 1's silence as
    of when the agent made it, not count the controller's 12 s: before, worker 1 was 12 s
    "silent" (over the heartbeat timeout: HANG, killed), where a direct poll reads 0."""
    from elastic._controller.hang_watch import SILENCE_MARGIN_S
    now = [1000.0]
    monkeypatch.setattr(ray_group.time, "monotonic", lambda: now[0])
    group = group_on({0: A, 1: A})
    (carrier,) = started(group, fake_ray)
    for wid in (0, 1):
        group._slots[wid].actor.poll.refs[0].outcome = report(1, seq=1)
    views = group.tick()                          # answers taken at 1000.0; the agent carries both from here
    assert all(v.via_agent for v in views.values()) and len(carrier.poll.calls) == 1

    # The agent on its node (its own clock), answering that poll: worker 0 at the beat, 0.9 s into it.
    agent_clock = Clock(500.0)
    workers = {wid: Actor("poll") for wid in (0, 1)}

    class AgentsRay(FakeRay):
        def wait(self, refs, num_returns=1, timeout=None):
            if workers[0].poll.refs[0].outcome is PENDING:
                self.clock.now += 0.9
                workers[0].poll.refs[0].outcome = report(2, seq=2)
            return super().wait(refs, num_returns, timeout)
    agent = NodeAgent(clock=agent_clock, ray_api=AgentsRay(agent_clock))
    agent.watch({wid: (actor, 1) for wid, actor in workers.items()})
    message = agent.poll(*carrier.poll.calls[0])
    assert list(message) == [0]
    workers[1].poll.refs[0].outcome = report(2, seq=2)      # 20 ms later: it waits in the agent

    carrier.poll.refs[0].outcome = message
    now[0] += 12.0                                # the controller comes back 12 s late
    views = group.tick()
    assert views[0].silent_s == 0.0 and views[0].report.step == 2
    assert views[1].silent_s == pytest.approx(0.9)          # as of the agent's answer
    assert views[1].silent_s < group.terms.hold_s + SILENCE_MARGIN_S < 5.0    # neither hang rule fires
    # The agent's next answer brings worker 1's (it was waiting there): heard from at once.
    carrier.poll.refs[1].outcome = agent.poll(*carrier.poll.calls[1])
    now[0] += 0.01
    views = group.tick()
    assert views[1].silent_s == 0.0 and views[1].report.step == 2


def test_an_agents_answer_travels_with_how_long_its_poll_took():
    import pickle

    from elastic._controller.node_agent import AgentAnswers
    clock = Clock()
    agent, _, _ = agent_with(clock, 0)
    answers = agent.poll(1.0, forget=[])
    assert isinstance(answers, AgentAnswers) and answers == {} and answers.waited_s >= 1.0
    back = pickle.loads(pickle.dumps(AgentAnswers({0: report(3)}, waited_s=0.25)))
    assert back == {0: report(3)} and back.waited_s == 0.25 and type(back) is AgentAnswers

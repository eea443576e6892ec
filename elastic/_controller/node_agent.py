"""A node's agent: it carries the polls of the workers on its node to the controller, one Ray
message per node and round instead of one per worker (`ScalingConfig.node_agents`).

Why: every poll answer costs the controller's process Ray's own CPU, 150-250 us per message
(benchmarks/ray_poll_floor.py, BENCHMARKS P1), whatever it carries. With a held poll answered
once a second by every worker, 10,000 workers ask 1.5-2.5 s of CPU per second of one process:
the controller cannot keep up. With an agent per node of 8 workers it gets 1,250 messages a
second, each with 8 answers, and the per-message cost is paid by the agents, on their own nodes.

One role: this actor runs on one node (pinned there, no CPU reserved), holds one poll to each
worker it is given, and answers the controller's poll with every answer that has come, as they
came (a WorkerReport, or a PollFailure when the worker's poll raised or its actor is gone), with
each step's record once (`one_record_per_step`: every rank of a step sends the same record). It
decides nothing: the worker group (worker_group.RayWorkerGroup) hands it workers, takes its
answers as if they came from the workers, and falls back to polling a worker itself while no
agent carries it (its agent not started yet, or lost).

Timing. A worker's held poll answers at once on news (its loop stops or fails, a generation's
first step, a long wait in a collective) and otherwise when its hold ends; the agent answers the
controller as soon as one worker has answered, after a short window (COALESCE_S) that lets the
answers that are due at the same moment go in the same message. So that they are due at the
same moment, every hold the agent asks for ends on a common beat (`hold_until_beat`): a worker
re-polled after news holds only to the next beat, never longer than the controller's own hold,
so the controller's reading of a silence (hang_watch: hold + its margin) is unchanged.

Silence is judged as of the agent's answer. An agent's answer says who had answered *when it
was made*; a worker whose answer came a few ms after it (past the window) waits in the agent for
the controller's next poll. If the controller takes the message late (a tick blocked for
seconds), that worker must not look silent for the controller's lateness: the answer says how
long the agent's poll ran (`AgentAnswers.waited_s`, a duration on the agent's clock, so it means
the same on the controller's node), and the worker group measures the silence of the workers it
does not carry up to the poll's send time plus that, not up to the moment the controller looked
(worker_group). A direct poll needs nothing of the kind: an answer that came while the controller
was busy is taken, and counts, at the next tick.

What is not carried: calls that act on a worker (plans, stop requests, kills) go to it directly,
as without agents; they are a few per recovery, not per second.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ray.exceptions import RayError

from elastic._controller.ray_calls import poll_failure
from elastic._protocol import PollFailure, WorkerReport

COALESCE_S = 0.01          # after the first answer, wait this long for those due with it
SLICE_S = 0.05             # a poll under way looks for workers handed to it (watch) this often
WAIT_MARGIN_S = 0.25       # an agent answers at most this long after the hold, even with nothing to say


def hold_until_beat(hold_s: float, now: float) -> float:
    """The hold for a poll sent at `now` (monotonic seconds): until the next multiple of
    `hold_s`, so that every worker's routine answer falls due at the same moment. At most
    `hold_s`; 0 (answer at once) stays 0."""
    if hold_s <= 0:
        return 0.0
    beat = (math.floor(now / hold_s) + 1) * hold_s
    return min(hold_s, max(0.0, beat - now))


class AgentAnswers(dict[int, WorkerReport | PollFailure]):
    """An agent's answer to the controller's poll: {wid: answer} for the workers that answered,
    and `waited_s`, how long the agent's poll ran until it fixed the answers it returns (on the
    agent's clock). The workers it does not carry were silent as of then, not as of when the
    controller took it."""

    def __init__(self, answers: dict[int, WorkerReport | PollFailure] | None = None, waited_s: float = 0.0):
        super().__init__(answers or {})
        self.waited_s = waited_s


def one_record_per_step(answers: dict[int, WorkerReport | PollFailure]) -> dict[int, WorkerReport | PollFailure]:
    """`answers` with each step's record on one answer only. Every rank of a step builds the same
    record from the step's exchange (elastic._worker.step_boundary), and the controller takes each
    step once, from whichever rank's record it finds (intake.ReportIntake): the copies would cost
    it decoding (S1: most of a step tick at 10,000 ranks) and nothing else. The copy kept is the
    one with the per-rank compute times where one has them (rank 0's), as the intake prefers.
    `ctx.log` records are each rank's own: all kept. A worker whose copy was shed loses nothing:
    the answer that carries the step travels in the same message."""
    kept: dict[tuple[int, int], tuple[int, int, bool]] = {}   # (generation, step) -> (wid, index, has times)
    for wid, answer in answers.items():
        if not isinstance(answer, WorkerReport):
            continue
        for index, record in enumerate(answer.records):
            key = (record.generation, record.step)
            if record.kind == "step" and (key not in kept or (record.compute_s and not kept[key][2])):
                kept[key] = (wid, index, bool(record.compute_s))
    keep = {(wid, index) for wid, index, _ in kept.values()}
    out: dict[int, WorkerReport | PollFailure] = {}
    for wid, answer in answers.items():
        if isinstance(answer, WorkerReport) and answer.records:
            records = [r for index, r in enumerate(answer.records) if r.kind != "step" or (wid, index) in keep]
            if len(records) < len(answer.records):
                answer = replace(answer, records=records)
        out[wid] = answer
    return out


class NodeAgent:
    """Ray actor, one per node (worker_group starts it pinned to its node with num_cpus=0).
    Two of its methods may run at once (max_concurrency 2): `watch` while `poll` waits."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, ray_api: Any = None):
        if ray_api is None:
            import ray as ray_api
        self._ray = ray_api
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[int, Any] = {}        # wid -> the worker's actor handle
        self._polls: dict[Any, int] = {}          # the outstanding poll of each worker -> its wid
        self._acked: dict[int, int] = {}          # wid -> the newest answer the controller received
        self._hold_s = 0.0                        # the controller's newest hold
        self._wake_s: float | None = None         # and hang bound (worker.poll's wake_s)

    def ready(self) -> str:
        """The node it runs on (the group starts using it when this answers)."""
        return str(self._ray.get_runtime_context().get_node_id())

    def watch(self, workers: dict[int, tuple[Any, int]]) -> None:
        """Carry the polls of `workers` (wid -> (actor handle, the newest of its answers the
        controller received)) from now on: each is polled at once, and a `poll` under way takes
        its answer (it looks for new workers every SLICE_S)."""
        with self._lock:
            for wid, (actor, acked) in workers.items():
                self._workers[wid], self._acked[wid] = actor, acked
            self._send_polls(only=set(workers))

    def poll(self, hold_s: float, forget: list[int], acked: dict[int, int] | None = None,
             wake_s: float | None = None) -> AgentAnswers:
        """Drop the workers in `forget`, make sure every other worker has a poll out (held up to
        `hold_s`, to the beat, or until its wait crosses `wake_s` (worker.poll), acknowledging
        `acked[wid]`: the newest of its answers the controller has received, all of this agent's
        earlier ones), and return the answers that came: as soon as one is there (with those
        that come within COALESCE_S), else after the hold plus WAIT_MARGIN_S, with whatever came
        by then (possibly nothing), and how long that took (`AgentAnswers.waited_s`). Each step's
        record comes once (`one_record_per_step`)."""
        started = self._clock()
        deadline = started + hold_s + WAIT_MARGIN_S
        with self._lock:
            self._hold_s, self._wake_s = hold_s, wake_s
            self._acked.update(acked or {})
            for wid in forget:
                self._workers.pop(wid, None)
                self._acked.pop(wid, None)
            self._polls = {ref: wid for ref, wid in self._polls.items() if wid in self._workers}
            self._send_polls()
        ready: list[Any] = []
        while True:
            with self._lock:
                refs = list(self._polls)
            left = deadline - self._clock()
            if not refs or left <= 0:
                break
            ready, _ = self._ray.wait(refs, num_returns=1, timeout=min(SLICE_S, left))
            if ready:
                if len(refs) > 1:
                    ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=COALESCE_S)
                break
        waited_s = self._clock() - started      # what it returns is who had answered by now
        answers: dict[int, WorkerReport | PollFailure] = {}
        for ref in ready:
            with self._lock:
                taken = self._polls.pop(ref) if ref in self._polls else None
            if taken is not None:
                answers[taken] = self._answer(ref, taken)
        return AgentAnswers(one_record_per_step(answers), waited_s)

    def _send_polls(self, only: set[int] | None = None) -> None:
        """A poll to every worker (or every one in `only`) that has none out (under the lock).
        Only `poll` polls the others again: their acknowledgements come with it (`watch` may run
        while a `poll` is taking answers the controller has not received yet)."""
        polled = set(self._polls.values())
        hold = hold_until_beat(self._hold_s, self._clock())
        for wid, actor in self._workers.items():
            if wid not in polled and (only is None or wid in only):
                self._polls[actor.poll.remote(hold, self._acked.get(wid, 0), self._wake_s)] = wid

    def _answer(self, ref: Any, wid: int) -> WorkerReport | PollFailure:
        try:
            return self._ray.get(ref)
        except RayError as error:
            with self._lock:                      # a worker that cannot answer is not polled again
                self._workers.pop(wid, None)
            return poll_failure(error)

"""P1: what one round of polls costs the controller's process in Ray itself, per rank.

`benchmarks/controller_scale.py` (S1) times the controller's own work and a pickle decode of each
poll answer; it leaves out what RayWorkerGroup.tick asks of Ray for every rank in every round:
one `actor.poll.remote()`, the rank's reference in a `ray.wait`, one `ray.get` of the answer.
This measures those three on the driver, CPU (time.process_time) and wall, with `--actors`
actors answering a realistic steady-state poll answer (a WorkerReport with one StepRecord and a
PositionReport, as a rank sends at each step) round-robin for N simulated ranks. Ray's
per-call cost does not depend on which actor answers, so N ranks are stood in for by a few
actors (this machine cannot hold 10,000 processes); the actors' own time is theirs, not the
controller's.

    python benchmarks/ray_poll_floor.py --ranks 1000 2000 4000 [--actors 4] [--reps 3]
    python benchmarks/ray_poll_floor.py --ranks 4000 8000 --batch 8     # one call per 8 ranks (a per-node agent)
    python benchmarks/ray_poll_floor.py --ranks 1000 4000 --mode stream # one streaming generator per actor
    python benchmarks/ray_poll_floor.py --ranks 4000 8000 --mode agent --batch 8   # real node agents

Prints one JSON line per N: medians over reps of the driver process's CPU per rank (all its
threads: Ray's own receive the answers) for `submit_us` (the remote calls), `receive_us` (while
the answers arrive), `wait_us` (the tick's ray.wait over the answered references), `get_us` (one
ray.get each); `round_cpu_ms` and `round_wall_ms` for the whole round; and `at_10000_ms`: the
round's driver CPU scaled to 10,000 ranks (the cost per rank does not fall with N).

`--mode agent` puts the real node agent (elastic._controller.node_agent.NodeAgent, the actor
`ScalingConfig.node_agents` starts) between them: `--agents` agents each carry `--batch` ranks'
polls (stood in for by the same answering actors), and the driver polls each agent as
RayWorkerGroup does, one poll out per agent, until N answers have come; `answer_us` is the
driver's CPU per rank's answer, `answers_per_message` how many each agent answer carried.
Every mode also prints `idle_cpu_ms_per_s`, the driver's CPU per second while it waits in
`ray.wait` for an answer that takes 2 s (Ray's own threads and wait loop), and
`at_10000_less_idle_ms`, the 10,000-rank round less that idle CPU over the round's wall time
(an agent round is long in wall time here: 2 cores for all the actors).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ray  # noqa: E402

from elastic._protocol import (  # noqa: E402
    PositionReport,
    StepRecord,
    ThreadPlace,
    WorkerPhase,
    WorkerReport,
)


def steady_answer(rank: int, world: int, step: int) -> WorkerReport:
    """A rank's poll answer at a step in steady state (the shape RayWorkerGroup receives)."""
    record = StepRecord(step=step, loss=2.345678, world_size=world, time=float(step), samples_seen=step * 8 * world,
                        global_batch=8 * world, metrics={"lr": 3e-4}, data_order="ab" * 32, generation=3)
    position = PositionReport(generation=3, place=ThreadPlace.EXCHANGE, step=step, nth=step, age_s=0.01,
                              step_times=(0.2,), exchanged=step - 1)
    return WorkerReport(phase=WorkerPhase.RUNNING, generation=3, rank=rank, step=step, has_state=True,
                        records=[record], position=position)


@ray.remote(num_cpus=0)
class Answerer:
    def __init__(self, world: int, batch: int) -> None:
        self._answer = steady_answer(1, world, 100)
        self._batch = [steady_answer(rank, world, 100) for rank in range(batch)]

    def poll(self, hold_s: float, acked: int = 0, wake_s: float | None = None) -> WorkerReport:
        return self._answer

    def poll_node(self, hold_s: float) -> list[WorkerReport]:
        """A per-node agent's answer: its ranks' answers in one message."""
        return self._batch

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def stream(self, count: int):
        for _ in range(count):
            yield self._answer


def one_round(actors: list, n: int, batch: int = 1) -> dict[str, float]:
    """One poll per rank (batch 1), or one per `batch` ranks (a per-node agent's answer)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    calls, method = n // batch, "poll" if batch == 1 else "poll_node"
    refs = [getattr(actors[i % len(actors)], method).remote(0.0) for i in range(calls)]
    cpu1 = time.process_time()
    ray.wait(refs, num_returns=calls, timeout=None)      # the answers arrive (Ray's threads here receive them)
    cpu1b = time.process_time()
    ready, _ = ray.wait(refs, num_returns=calls, timeout=0)   # the tick's look at which have answered
    assert len(ready) == calls
    cpu2 = time.process_time()
    for ref in refs:   # one get per answer, as RayWorkerGroup._collect_polls does
        ray.get(ref)
    cpu3, wall3 = time.process_time(), time.perf_counter()
    return {"submit_us": (cpu1 - cpu0) / n * 1e6, "wait_us": (cpu2 - cpu1b) / n * 1e6,
            "get_us": (cpu3 - cpu2) / n * 1e6, "receive_us": (cpu1b - cpu1) / n * 1e6,
            "round_cpu_ms": (cpu3 - cpu0) * 1e3,
            "round_wall_ms": (wall3 - wall0) * 1e3}


def one_stream_round(actors: list, n: int) -> dict[str, float]:
    """The same N answers through one streaming generator per actor (`num_returns="streaming"`):
    one call for many answers, as a long-lived poll that yields on news would be."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    share = n // len(actors)
    streams = [a.stream.options(num_returns="streaming").remote(share) for a in actors]
    got = 0
    for stream in streams:
        for ref in stream:
            ray.get(ref)
            got += 1
    assert got == share * len(actors)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    return {"item_us": (cpu1 - cpu0) / got * 1e6, "round_cpu_ms": (cpu1 - cpu0) * 1e3,
            "round_wall_ms": (wall1 - wall0) * 1e3}


def one_agent_round(agents: list, n: int) -> dict[str, float]:
    """N ranks' answers through node agents: one poll out per agent at a time, as the worker
    group keeps it, repeated until N answers have come."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    got = messages = 0
    while got < n:
        refs = [agent.poll.remote(0.0, []) for agent in agents]
        ray.wait(refs, num_returns=len(refs), timeout=None)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            got += len(ray.get(ref))
        messages += len(refs)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    return {"answer_us": (cpu1 - cpu0) / got * 1e6, "answers_per_message": got / messages,
            "round_cpu_ms": (cpu1 - cpu0) / got * n * 1e3, "round_wall_ms": (wall1 - wall0) / got * n * 1e3}


def node_agents(count: int, batch: int, answerers: list) -> list:
    """`count` real node agents, each carrying `batch` ranks (stood in for by the answerers)."""
    from elastic._controller.node_agent import NodeAgent
    agents = [ray.remote(NodeAgent).options(num_cpus=0, max_concurrency=2).remote() for _ in range(count)]
    ray.get([agent.watch.remote({wid: (answerers[wid % len(answerers)], 0) for wid in range(batch)})
             for agent in agents])
    return agents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1000, 2000, 4000])
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mode", choices=("poll", "stream", "agent"), default="poll",
                        help="poll: one call per answer (RayWorkerGroup without agents); stream: streaming "
                             "generators; agent: through real node agents carrying --batch ranks each")
    parser.add_argument("--agents", type=int, default=4, help="agent mode: node agents")
    parser.add_argument("--batch", type=int, default=1,
                        help="poll mode: ranks per call (8: one call per node, as a per-node agent would answer)")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = [Answerer.remote(max(args.ranks), args.batch) for _ in range(args.actors)]
        ray.get([a.poll.remote(0.0) for a in actors])
        one_round(actors, 200)           # warm-up
        agents = node_agents(args.agents, args.batch, actors) if args.mode == "agent" else []
        if agents:
            one_agent_round(agents, 200)
        # The driver's CPU while it waits in ray.wait for an answer that takes 2 s (Ray's own
        # threads and its wait loop: 5 % of a core here, against 0.3 % in a plain sleep): an
        # agent round is long in wall time on 2 cores, and this part of its CPU is paid per
        # second of waiting, not per answer.
        cpu0, wall0 = time.process_time(), time.perf_counter()
        ray.wait([actors[0].sleep.remote(2.0)], num_returns=1, timeout=None)
        idle_ms_per_s = (time.process_time() - cpu0) / (time.perf_counter() - wall0) * 1e3
        for n in args.ranks:
            if args.mode == "poll":
                rounds = [one_round(actors, n, args.batch) for _ in range(args.reps)]
            elif args.mode == "agent":
                rounds = [one_agent_round(agents, n) for _ in range(args.reps)]
            else:
                rounds = [one_stream_round(actors, n) for _ in range(args.reps)]
            out: dict[str, float | int | str] = {"mode": args.mode, "ranks": n, "batch": args.batch,
                                                 "actors": args.actors, "reps": args.reps}
            keys = {"poll": ("submit_us", "receive_us", "wait_us", "get_us"), "stream": ("item_us",),
                    "agent": ("answer_us", "answers_per_message")}[args.mode]
            for key in keys + ("round_cpu_ms", "round_wall_ms"):
                out[key] = round(statistics.median(r[key] for r in rounds), 2)
            out["at_10000_ms"] = round(float(out["round_cpu_ms"]) / n * 10_000, 1)
            # The same, less the driver's idle CPU over the round's wall time.
            busy = float(out["round_cpu_ms"]) - idle_ms_per_s * float(out["round_wall_ms"]) / 1e3
            out["idle_cpu_ms_per_s"] = round(idle_ms_per_s, 2)
            out["at_10000_less_idle_ms"] = round(busy / n * 10_000, 1)
            print(json.dumps(out), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

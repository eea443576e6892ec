"""S1: the controller's CPU per tick at N ranks (no Ray, no torch), and the step records' bytes.

Drives the real `Controller` (elastic._controller.controller) and the real run record
(`RunRecorder` on an in-memory store: status.json and metrics.jsonl are encoded and written as in
a run) with the unit tests' fake worker group (tests/unit/controller/fakes.py), extended here so that each
rank's poll answer arrives as pickled bytes and is decoded inside the tick, as Ray would. Timed in
CPU (time.process_time), repeated, medians:

- idle_tick_ms: a tick with no news (every 0.2 s while training runs);
- step_tick_ms: a tick in which every rank reports one new step (straggler scoring on, the default);
  step_decode_ms is the part of it spent decoding the N poll answers (Ray's deserialization);
- record_bytes_per_step: the pickled poll answers of one step, all ranks together;
- detect_ms: the tick that sees one node's 8 ranks dead and decides the recovery;
- reform_ms: the tick that sees the survivors out of the broken group and re-forms (with 8 new
  workers placed meanwhile) up to RUNNING;
- status_write_ms: one write of status.json and the new metrics lines (the run record's writer
  thread does it at most once a second, whatever the tick rate: not counted in the ticks).

    python benchmarks/controller_scale.py --ranks 10000 [--reps 5] [--compute-times every|one] [--node-agents]

The garbage collector runs as in the controller's actor (`actor.tune_gc`; `--default-gc`: CPython's
defaults). --compute-times says which ranks' step records carry the per-rank compute times: `every` rank
(the worker's step boundary before issue 15) or only `one` (rank 0; after it). --node-agents: the
answers come as node agents send them (ScalingConfig.node_agents): one message per node of NODE
ranks, each step's record on one answer of the message only (node_agent.one_record_per_step).
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "unit", "controller")]

from fakes import FakeCheckpoints, FakeGroup  # noqa: E402

from elastic._controller.actor import tune_gc  # noqa: E402
from elastic._controller.controller import Controller  # noqa: E402
from elastic._controller.node_agent import one_record_per_step  # noqa: E402
from elastic._controller.run_record import RunRecorder  # noqa: E402
from elastic._controller.slot_table import DEAD, WorkerView  # noqa: E402
from elastic._controller.states import Recovering, Running, RunState  # noqa: E402
from elastic._controller.worker_group import PollTerms  # noqa: E402
from elastic._protocol import StepRecord, WorkerPhase, WorkerReport  # noqa: E402
from elastic.config import FailureConfig, ScalingConfig  # noqa: E402
from support import FakeClock  # noqa: E402

NODE = 8                       # ranks per node: a node loss takes 8
TICK_S, STEP_S = 0.2, 1.0      # the controller's tick interval (heartbeat_interval_s) and a step


class WireGroup(FakeGroup):
    """FakeGroup whose ranks' poll answers come as pickled bytes, decoded in `tick()` (Ray's
    ray.get of each answer). Decoded answers are dropped at once and the views share one record
    object per kind, so that 10,000 copies of a 10,000-float tuple are decoded (CPU counted) but
    never held together (memory)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.wire: dict[int, bytes] = {}           # wid (or node) -> this tick's poll answer(s), pickled
        self.decode_s = 0.0                        # CPU spent decoding answers, all ticks

    def tick(self, terms: PollTerms | None = None) -> dict[int, WorkerView]:
        t0 = time.process_time()
        for payload in self.wire.values():
            pickle.loads(payload)
        self.wire = {}
        self.decode_s += time.process_time() - t0
        # A new view per slot, as RayWorkerGroup.tick builds them (FakeGroup's copies cost more).
        out = {w: WorkerView(wid=w, status=v.status, report=v.report, info=v.info, silent_s=v.silent_s,
                             death=v.death, death_cause=v.death_cause, records=v.records)
               for w, v in self.views.items()}
        for v in self.views.values():
            v.records = []
        return out

    def drop_dead(self) -> None:
        """Forget dead slots (the real group drops them once no recovery can ask about them)."""
        for wid in [w for w, v in self.views.items() if v.status == DEAD]:
            del self.views[wid]


class Bench:
    def __init__(self, n: int, compute_times: str, scoring: bool, node_agents: bool = False):
        self.n, self.compute_times, self.node_agents = n, compute_times, node_agents
        rng = random.Random(0)
        self.compute_s = tuple(round(rng.uniform(0.9, 1.1), 6) for _ in range(n))
        self.clock, self.group = FakeClock(), WireGroup(n)
        self.recorder = RunRecorder(f"memory://controller-scale-{os.getpid()}-{n}", None, total_steps=10 ** 9,
                                    config={})
        # status.json is written at most once a second of the run's time, as in a run (the
        # benchmark's clock is the controller's fake one, not the wall clock).
        self.recorder.status_writer._clock = self.clock
        # status.json and the metrics lines are written by the writer's thread in a run, at most
        # once a second whatever the tick rate: timed apart from the ticks (`status_write_ms`).
        self.write_s: list[float] = []
        write_now = self.recorder.status_writer.write_now

        def timed_write() -> None:
            t0 = time.process_time()
            write_now()
            self.write_s.append(time.process_time() - t0)
        self.recorder.status_writer.write_now = timed_write  # type: ignore[method-assign]
        self.controller = Controller(
            self.group, self.recorder, FakeCheckpoints(latest=900, fence=2),
            scaling=ScalingConfig(min_workers=max(1, n - 64), max_workers=n, startup_wait_s=10.0),
            failure=FailureConfig(max_failures=None, heartbeat_timeout_s=10.0, collective_timeout_s=60.0,
                                  rendezvous_timeout_s=120.0, straggler_threshold=1.35 if scoring else None),
            total_steps=10 ** 9, clock=self.clock)
        self.record_bytes: list[int] = []

    def start(self) -> None:
        self.controller.tick()        # places N workers
        self.controller.tick()        # all ready: starting, running
        assert self.controller.state.state == RunState.RUNNING, self.controller.state

    def post_step(self) -> None:
        """Every rank of the running generation answers its poll with the next step's record."""
        c = self.controller
        st = c.state
        step, generation = c.step + 1, c.generation
        assert isinstance(st, Running), st
        bare = StepRecord(step=step, loss=2.345678, world_size=self.n, time=float(step),
                          samples_seen=step * 8 * self.n, global_batch=8 * self.n, metrics={"lr": 3e-4},
                          data_order="ab" * 32, generation=generation)
        full = replace(bare, compute_s=self.compute_s)
        if self.compute_times == "every":
            bare = full
        reports = {wid: WorkerReport(phase=WorkerPhase.RUNNING, generation=generation, rank=rank, step=step,
                                     has_state=True, records=[full if rank == 0 else bare])
                   for rank, wid in enumerate(st.members)}
        if self.node_agents:
            # One message per node: its ranks' answers with each step's record once, as agents
            # send them. Each answer decoded on its own first, as the agent's ray.get of each
            # worker's answer makes them (objects shared between answers would be pickled once).
            reports = one_record_per_step({wid: pickle.loads(pickle.dumps(r, protocol=5))
                                           for wid, r in reports.items()})
        total, payload = 0, b""
        per_message = NODE if self.node_agents else 1
        for first in range(0, len(st.members), per_message):
            carried = st.members[first:first + per_message]
            # Only the first two messages are pickled: the others are the same bytes but for the ranks.
            if first < 2 * per_message:
                payload = pickle.dumps({w: reports[w] for w in carried} if self.node_agents else reports[carried[0]],
                                       protocol=5)
            self.group.wire[carried[0]] = payload
            total += len(payload)
        for wid in st.members:
            report = reports[wid]
            view = self.group.views[wid]
            view.records = list(report.records)
            view.report = replace(report, records=[])
        self.record_bytes.append(total)

    def timed_tick(self, advance: float) -> float:
        """CPU ms of one tick on the controller's thread (without the status write, see above)."""
        self.clock.advance(advance)
        writes = len(self.write_s)
        t0 = time.process_time()
        self.controller.tick()
        return (time.process_time() - t0 - sum(self.write_s[writes:])) * 1000

    def decoding(self, measure: Callable[[], float]) -> tuple[float, float]:
        """`measure()`'s CPU ms, and the part of it spent decoding poll answers."""
        before = self.group.decode_s
        total = measure()
        return total, (self.group.decode_s - before) * 1000

    def batch(self, ticks: int, prepare: Callable[[], None] | None, advance: float) -> float:
        """Mean CPU ms of `ticks` ticks (the CPU clock is coarse on a loaded machine: small N batches)."""
        total = 0.0
        for _ in range(ticks):
            if prepare is not None:
                prepare()
            total += self.timed_tick(advance)
        return total / ticks

    def node_loss(self) -> tuple[float, float]:
        """One node's ranks die; the survivors leave the broken group; the re-form. CPU ms of both ticks."""
        c = self.controller
        assert isinstance(c.state, Running), c.state
        members, generation, step = list(c.state.members), c.generation, c.step
        lost = members[NODE:2 * NODE]
        for wid in lost:
            self.group.die(wid, reason="node lost: node abc left the cluster", silent_s=3.0)
        detect = self.timed_tick(TICK_S)
        assert isinstance(c.state, Recovering), c.state
        for rank, wid in enumerate(c.state.survivors):
            self.group.set_report(wid, WorkerPhase.INTERRUPTED, generation=generation, rank=rank, step=step,
                                  error_type="RuntimeError", error_message="NCCL communicator was aborted")
        reform = self.timed_tick(TICK_S)
        assert isinstance(c.state, Running) and len(c.state.members) == self.n, c.state
        self.post_step()                 # the re-formed group's first step closes the recovery
        self.timed_tick(STEP_S)
        self.group.drop_dead()
        return detect, reform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--reps", type=int, default=None, help="repetitions of each measure (default by N)")
    parser.add_argument("--compute-times", choices=("every", "one"), default="every",
                        help="which ranks' step records carry every rank's compute time")
    parser.add_argument("--no-scoring", action="store_true", help="straggler scoring off")
    parser.add_argument("--default-gc", action="store_true",
                        help="CPython's default collection thresholds, not the controller actor's (actor.tune_gc)")
    parser.add_argument("--node-agents", action="store_true",
                        help=f"answers come {NODE} ranks per message, each step's record once (node agents)")
    args = parser.parse_args()
    n = args.ranks
    reps = args.reps or (15 if n <= 1000 else 3)
    batch = max(1, 2000 // n)        # ticks per timed batch (small N: the CPU clock is coarse)
    if not args.default_gc:
        tune_gc()                    # as the controller's actor does (its own process)
    bench = Bench(n, args.compute_times, not args.no_scoring, args.node_agents)
    gc.collect()
    started = time.process_time()
    bench.start()
    # Scoring starts after the generation's first step (its restore is no step time).
    bench.post_step()
    bench.timed_tick(STEP_S)
    steps = [bench.decoding(lambda: bench.batch(batch, bench.post_step, STEP_S) * batch) for _ in range(reps)]
    step_ms = [total / batch for total, _ in steps]
    decode_ms = [decode / batch for _, decode in steps]
    idle_ms = [bench.batch(batch, None, TICK_S) for _ in range(reps)]
    recoveries = [bench.node_loss() for _ in range(reps)]
    out: dict[str, Any] = {
        "ranks": n, "compute_times": args.compute_times, "scoring": not args.no_scoring,
        "node_agents": args.node_agents, "gc_threshold": list(gc.get_threshold()), "reps": reps,
        "idle_tick_ms": round(statistics.median(idle_ms), 3),
        "step_tick_ms": round(statistics.median(step_ms), 3),
        "step_decode_ms": round(statistics.median(decode_ms), 3),
        "record_bytes_per_step": int(statistics.median(bench.record_bytes)),
        "detect_ms": round(statistics.median(d for d, _ in recoveries), 3),
        "reform_ms": round(statistics.median(r for _, r in recoveries), 3),
        "recoveries_closed": len(bench.recorder.summary.build(
            status="running", final_step=bench.controller.step, checkpoints=[], model_sha256=None, error=None,
            metrics={})["recoveries"]),
        "status_write_ms": round(statistics.median(bench.write_s) * 1000, 3),
        "cpu_total_s": round(time.process_time() - started, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

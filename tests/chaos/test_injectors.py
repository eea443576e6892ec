"""Injectors act on real processes and every fault's heal runs: at its time, and in the final
heal whatever happened to the run."""
from __future__ import annotations

import random
import time

import pytest

from chaos.faults import Hang, KillWorker, Preempt, Slow, StorageOutage
from chaos.history import History
from chaos.injectors import Env, Skip, build_injectors
from chaos.nemesis import Nemesis
from chaos.procs import Proc, alive
from chaos.schedule import fixed
from chaos.services import wait_until

pytestmark = pytest.mark.timeout(60)


class FakeView:
    """status.json as a dict; workers as the injectors read them."""

    def __init__(self, pids):
        self.state = {"state": "running", "generation": 0, "step": 10,
                      "workers": [{"rank": r, "pid": p, "node_id": "n"} for r, p in enumerate(pids)]}

    def status(self):
        return self.state

    def workers(self):
        return self.state["workers"]

    def committed(self):
        return []


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_hang_stops_the_worker_and_its_heal_resumes_it(spawn_worker):
    proc = spawn_worker()
    wait_until(lambda: Proc.of_worker(proc.pid) is not None, 10, "the fake worker")
    injector = build_injectors(Env(view=FakeView([proc.pid])))["hang"]
    active = injector.invoke(Hang(duration_s=5), random.Random(0))
    wait_until(lambda: state_of(proc.pid) == "T", 5, "the worker to stop")
    assert injector.heal(active) == {"resumed": [proc.pid]}
    wait_until(lambda: state_of(proc.pid) != "T", 5, "the worker to run again")


def test_slow_steals_cpu_in_cycles_until_healed(spawn_worker):
    proc = spawn_worker()
    wait_until(lambda: Proc.of_worker(proc.pid) is not None, 10, "the fake worker")
    injector = build_injectors(Env(view=FakeView([proc.pid])))["slow"]
    active = injector.invoke(Slow(duration_s=5, stopped_share=0.5, period_s=0.05), random.Random(0))
    wait_until(lambda: state_of(proc.pid) == "T", 5, "a stopped phase")
    wait_until(lambda: active.state[3]["n"] >= 3, 10, "a few duty cycles")
    assert injector.heal(active)["cycles"] >= 3
    wait_until(lambda: state_of(proc.pid) != "T", 5, "the worker to run again")
    assert alive(proc.pid)


def test_kill_and_preempt_signal_the_chosen_rank_only(spawn_worker):
    procs = [spawn_worker() for _ in range(3)]
    wait_until(lambda: all(Proc.of_worker(p.pid) for p in procs), 10, "the fake workers")
    injectors = build_injectors(Env(view=FakeView([p.pid for p in procs])))
    active = injectors["kill_worker"].invoke(KillWorker(target="rank:1"), random.Random(0))
    assert active.detail["ranks"] == [1]
    procs[1].wait(timeout=10)
    assert procs[1].returncode == -9 and procs[0].poll() is None and procs[2].poll() is None
    injectors["preempt"].invoke(Preempt(target="rank:2"), random.Random(0))
    procs[2].wait(timeout=10)
    assert procs[2].returncode == -15 and procs[0].poll() is None
    with pytest.raises(Skip):
        injectors["kill_worker"].invoke(KillWorker(target="rank:7"), random.Random(0))


def test_a_recycled_pid_is_never_signalled(spawn_worker):
    proc = spawn_worker()
    wait_until(lambda: Proc.of_worker(proc.pid) is not None, 10, "the fake worker")
    stale = Proc(proc.pid, Proc.of_worker(proc.pid).started - 1)   # same pid, another process
    assert not stale.signal(19)
    assert state_of(proc.pid) != "T"


def test_nemesis_heals_on_time_and_the_final_heal_runs_when_the_run_dies(spawn_worker, tmp_path):
    procs = [spawn_worker() for _ in range(2)]
    wait_until(lambda: all(Proc.of_worker(p.pid) for p in procs), 10, "the fake workers")
    view = FakeView([p.pid for p in procs])
    env = Env(view=view)
    history = History(str(tmp_path / "history.jsonl"))
    job = {"alive": True}
    schedule = fixed([(0.0, Hang(target="rank:0", duration_s=0.5)), (0.1, Hang(target="rank:1", duration_s=600))],
                     wait_for_recovery=False)
    nemesis = Nemesis(schedule, build_injectors(env), view, history, total_steps=1000, heartbeat_timeout_s=10,
                      job_alive=lambda: job["alive"])
    nemesis.setup()
    nemesis.run(time.time())
    assert [e["index"] for e in history.of_type("invoke")] == [0, 1]
    wait_until(lambda: (nemesis._heal_due() or True) and history.of_type("heal"), 10, "the first heal")
    assert state_of(procs[0].pid) != "T" and state_of(procs[1].pid) == "T"
    job["alive"] = False                 # the run under test crashes with a fault still active
    nemesis.heal_all(env.touched)
    heals = history.of_type("heal")
    assert [(h["index"], h["final"]) for h in heals] == [(0, False), (1, True)]
    assert state_of(procs[1].pid) != "T"


def test_faults_that_cannot_be_caused_here_are_skipped_with_the_reason(tmp_path):
    view = FakeView([])
    history = History(str(tmp_path / "history.jsonl"))
    nemesis = Nemesis(fixed([(0.0, StorageOutage(duration_s=1))]), build_injectors(Env(view=view)), view, history,
                      total_steps=1000, heartbeat_timeout_s=10, job_alive=lambda: True)
    nemesis.setup()
    nemesis.run(time.time())
    skip, = history.of_type("skip")
    assert "unsupported" in skip["reason"] and "s3://" in skip["reason"]

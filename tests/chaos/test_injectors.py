"""Injectors act on real processes and every fault's heal runs: at its time, and in the final
heal whatever happened to the run."""
from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from chaos.faults import Hang, KillController, KillDriver, KillNode, KillWorker, Partition, Preempt, Slow, StorageOutage
from chaos.history import History
from chaos.injectors import Env, Skip, Unsupported, build_injectors
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


def test_kill_controller_kills_the_process_status_json_names_only_while_the_run_is_running(spawn_worker):
    controller, worker = spawn_worker(), spawn_worker()
    wait_until(lambda: Proc.of_worker(controller.pid) and Proc.of_worker(worker.pid), 10, "the fake processes")
    view = FakeView([worker.pid])
    view.state["controller"] = {"pid": controller.pid, "node": "n", "since": 1.0, "restarts": 0}
    injectors = build_injectors(Env(view=view))
    view.state["state"] = "recovering"
    with pytest.raises(Skip, match="recovering"):
        injectors["kill_controller"].invoke(KillController(), random.Random(0))
    view.state["state"] = "running"
    active = injectors["kill_controller"].invoke(KillController(), random.Random(0))
    assert active.detail["signalled"] == 1 and active.detail["worker_pids"] == [worker.pid]
    controller.wait(timeout=10)
    assert controller.returncode == -9 and worker.poll() is None


def test_kill_driver_kills_the_driver_alone_while_the_run_trains_and_names_it_for_a_restart():
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    group_mate = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  process_group=driver.pid)     # the run's own Ray lives in the driver's group
    try:
        view = FakeView([])
        env = Env(view=view, driver_pid=lambda: driver.pid if driver.poll() is None else None)
        injectors = build_injectors(env)
        view.state.update(state="scheduling", run_id="r1")
        with pytest.raises(Skip, match="scheduling"):
            injectors["kill_driver"].invoke(KillDriver(), random.Random(0))
        view.state["state"] = "running"
        active = injectors["kill_driver"].invoke(KillDriver(), random.Random(0))
        assert active.detail == {"pid": driver.pid, "signalled": 1, "run_id": "r1", "step": view.state.get("step")}
        assert driver.wait(timeout=10) == -9 and group_mate.poll() is None
        assert env.drivers_killed == [driver.pid]
        with pytest.raises(Skip, match="no live driver"):
            injectors["kill_driver"].invoke(KillDriver(), random.Random(0))
    finally:
        for p in (driver, group_mate):
            p.kill()
            p.wait(timeout=10)


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


class FakeCluster:
    """Nodes by id, as chaos.cluster.LocalCluster and chaos.netns.NetnsCluster expose them."""

    supports_partition = True

    def __init__(self, nodes):
        self.nodes, self.removed, self.cut_off, self.added = list(nodes), [], set(), 0

    def node_of(self, worker):
        return worker.get("node_id") if worker.get("node_id") in self.nodes else None

    def node_ids(self):
        return list(self.nodes)

    def remove_node(self, node_id):
        self.nodes.remove(node_id)
        self.removed.append(node_id)

    def add_node(self):
        self.added += 1
        self.nodes.append(f"fresh{self.added}")
        return self.nodes[-1]

    def cut(self, node_id):
        self.cut_off.add(node_id)

    def reconnect(self, node_id):
        self.cut_off.discard(node_id)
        return node_id


def test_node_loss_removes_the_targets_node_and_its_heal_adds_one_back():
    view = FakeView([101, 102])
    view.state["workers"][1]["node_id"] = "b"
    view.state["workers"][0]["node_id"] = "a"
    cluster = FakeCluster(["a", "b"])
    injector = build_injectors(Env(view=view, cluster=cluster))["kill_node"]
    injector.setup()
    active = injector.invoke(KillNode(target="rank:1"), random.Random(0))
    assert cluster.removed == ["b"] and active.detail["ranks"] == [1]
    assert injector.heal(active) == {"added_nodes": ["fresh1"]}
    assert injector.heal(active) == {"added_nodes": ["fresh1"]}        # a second heal adds nothing
    view.state["workers"][0]["node_id"] = "head"
    with pytest.raises(Skip):
        injector.invoke(KillNode(target="rank:0"), random.Random(0))   # never the head
    with pytest.raises(Unsupported):
        build_injectors(Env(view=view))["kill_node"].setup()


def test_partition_cuts_the_targets_node_until_healed():
    view = FakeView([101, 102])
    for w, node in zip(view.state["workers"], ("a", "b"), strict=True):
        w["node_id"] = node
    cluster = FakeCluster(["a", "b"])
    injector = build_injectors(Env(view=view, cluster=cluster))["partition"]
    injector.setup()
    active = injector.invoke(Partition(target="rank:0", duration_s=5), random.Random(0))
    assert cluster.cut_off == {"a"}
    assert injector.heal(active) == {"reconnected": ["a"]} and not cluster.cut_off
    cluster.supports_partition = False
    with pytest.raises(Unsupported):
        injector.setup()


class FailingMaintenance(FakeCluster):
    """A cluster whose replacement of a dead node fails (`ray start` timed out on a loaded
    machine, as in the mixed-pp campaign of seed 1) until `fail` is cleared."""

    def __init__(self, nodes):
        super().__init__(nodes)
        self.fail, self.tries = True, 0

    def maintain(self):
        self.tries += 1
        if self.fail:
            raise RuntimeError("`ray start` in chx00001n5 exited with 1")
        return ["fresh9"]


def test_a_node_replacement_that_fails_is_recorded_and_tried_again_later_and_due_heals_go_on(
        spawn_worker, tmp_path, monkeypatch):
    proc = spawn_worker()
    wait_until(lambda: Proc.of_worker(proc.pid) is not None, 10, "the fake worker")
    view = FakeView([proc.pid])
    cluster = FailingMaintenance(["a"])
    env = Env(view=view, cluster=cluster)
    history = History(str(tmp_path / "history.jsonl"))
    nemesis = Nemesis(fixed([(0.0, Hang(target="rank:0", duration_s=0.2))], wait_for_recovery=False),
                      build_injectors(env), view, history, total_steps=1000, heartbeat_timeout_s=10,
                      job_alive=lambda: True, cluster=cluster)
    nemesis.setup()
    nemesis.run(time.time())               # the campaign goes on: no exception out of the heals
    failed, = history.of_type("node_replace_failed")
    assert "exited with 1" in failed["error"]
    wait_until(lambda: (nemesis._heal_due() or True) and history.of_type("heal"), 10, "the hang's heal")
    assert state_of(proc.pid) != "T"
    assert cluster.tries == 1              # not again before MAINTAIN_RETRY_S
    monkeypatch.setattr(nemesis, "_maintain_after", 0.0)
    cluster.fail = False
    nemesis._heal_due()
    assert [e["node"] for e in history.of_type("node_replaced")] == ["fresh9"]


class FakeCommits:
    """The CommitWatcher's view: generations seen committing, and when a commit was last new."""

    def __init__(self):
        self.generations, self.newest_at = set(), 0.0


def gated_nemesis(view, commits, tmp_path):
    history = History(str(tmp_path / "history.jsonl"))
    schedule = fixed([(0.0, Hang(target="rank:0", duration_s=0.1))], wait_for_recovery=True)
    nemesis = Nemesis(schedule, build_injectors(Env(view=view)), view, history, total_steps=10_000,
                      heartbeat_timeout_s=10, job_alive=lambda: True, gate_timeout_s=3, commits=commits)
    return nemesis, history


def test_a_gated_fault_waits_until_the_current_generation_has_committed(spawn_worker, tmp_path):
    proc = spawn_worker()
    wait_until(lambda: Proc.of_worker(proc.pid) is not None, 10, "the fake worker")
    view, commits = FakeView([proc.pid]), FakeCommits()
    view.state["generation"] = 1
    commits.generations.add(0)             # an older generation's commit does not open the gate
    calls = {"n": 0}

    def status():
        calls["n"] += 1
        view.state["step"] += 1
        if calls["n"] == 5:
            commits.generations.add(1)
            commits.newest_at = time.time()
        return view.state

    view.status = status
    nemesis, history = gated_nemesis(view, commits, tmp_path)
    nemesis.run(time.time())
    invoke, = history.of_type("invoke")
    assert invoke["run"]["step"] > 10 + 5          # injected only after generation 1's commit
    nemesis.heal_all()
    assert state_of(proc.pid) != "T"


def test_a_gated_fault_is_skipped_when_the_generation_never_commits(spawn_worker, tmp_path):
    proc = spawn_worker()
    wait_until(lambda: Proc.of_worker(proc.pid) is not None, 10, "the fake worker")
    view, commits = FakeView([proc.pid]), FakeCommits()
    status = view.status
    view.status = lambda: {**status(), "step": time.monotonic_ns()}      # training on
    nemesis, history = gated_nemesis(view, commits, tmp_path)
    nemesis.run(time.time())
    assert not history.of_type("invoke")
    skip, = history.of_type("skip")
    assert "not training again" in skip["reason"]
    assert state_of(proc.pid) != "T"


def test_a_bitflip_request_is_served_once_by_the_worker_it_names(tmp_path, monkeypatch):
    """The injector's request file (named after the target worker's pid) and the worker's side
    (elastic._worker.fault_gate.BitFlipRequests): one bit of one parameter flips, once, and the
    worker records what it flipped; a job started without the directory skips the fault."""
    import json
    import os
    import random

    import torch

    from chaos.faults import BitFlip
    from elastic._worker.fault_gate import BITFLIP_REQUESTS_KEY, BitFlipRequests, hold_after

    view = FakeView([os.getpid()])
    with pytest.raises(Skip):
        build_injectors(Env(view=view))["bitflip"].invoke(BitFlip(), random.Random(0))
    spec = type("Spec", (), {"bitflip_requests": str(tmp_path)})()
    active = build_injectors(Env(view=view, job_spec=spec))["bitflip"].invoke(BitFlip(), random.Random(0))
    assert active.detail["pids"] == [os.getpid()] and (tmp_path / f"pid-{os.getpid()}").exists()
    params = [torch.randn(7, 3), torch.randn(5)]
    before = [p.clone() for p in params]
    config = BitFlipRequests(str(tmp_path)).as_config()
    monkeypatch.setenv("RANK", "2")
    hold_after(12, config, params=lambda: params)
    hold_after(13, config, params=lambda: params)                     # served once
    changed = [(i, int((a != b).sum())) for i, (a, b) in enumerate(zip(params, before, strict=True)) if (a != b).any()]
    done = json.loads((tmp_path / f"pid-{os.getpid()}.done").read_text())
    assert changed == [(done["param"], 1)] and done["step"] == 12 and done["rank"] == 2
    assert done["bit"] in (*range(23), 31)
    assert not (tmp_path / f"pid-{os.getpid()}").exists()
    assert BITFLIP_REQUESTS_KEY in config


def test_a_bad_gradient_request_corrupts_every_backward_of_the_worker_it_names(tmp_path, monkeypatch):
    """chaos's bad_gradient: the same request file, asking for a wrong gradient; the worker
    (BitFlipRequests) hooks one parameter's gradient so that every backward from then on has one
    bit flipped, and leaves the parameters alone."""
    import json
    import os
    import random

    import torch

    from chaos.faults import BadGradient
    from chaos.injectors.process import GRADIENT_REQUEST
    from elastic._worker import fault_gate
    from elastic._worker.fault_gate import BitFlipRequests, hold_after

    assert GRADIENT_REQUEST == fault_gate.GRADIENT_REQUEST      # the word the worker reads
    spec = type("Spec", (), {"bitflip_requests": str(tmp_path)})()
    view = FakeView([os.getpid()])
    build_injectors(Env(view=view, job_spec=spec))["bad_gradient"].invoke(BadGradient(), random.Random(0))
    assert (tmp_path / f"pid-{os.getpid()}").read_text().startswith(GRADIENT_REQUEST + " ")
    params = [torch.randn(7, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    before = [p.detach().clone() for p in params]

    def gradients() -> list[torch.Tensor]:
        return list(torch.autograd.grad(sum((p * p).sum() for p in params), params))

    clean = gradients()
    monkeypatch.setenv("RANK", "0")
    hold_after(5, BitFlipRequests(str(tmp_path)).as_config(), params=lambda: params)
    done = json.loads((tmp_path / f"pid-{os.getpid()}.done").read_text())
    assert done["kind"] == GRADIENT_REQUEST and done["step"] == 5
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))     # the parameters are untouched
    for _ in range(2):                                                           # every backward, not once
        wrong = [(i, int((a != b).sum())) for i, (a, b) in enumerate(zip(gradients(), clean, strict=True))
                 if (a != b).any()]
        assert wrong == [(done["param"], 1)]

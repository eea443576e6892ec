"""The attacks on the commit protocol on real processes: a zombie writer (chaos/zombie.py,
the checkpointing package's own save path) stalled across a fence change, and a second start of
a job on a live run's storage; then the `commit` scenario end to end on the fake job.

Here the test plays the run's controller where one is needed: when the zombie's attack kills
the (fake) worker, the test moves FENCE to a new generation that restarts from an earlier step
and, for the PUT-phase attack, commits the zombie's step as that generation.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time

import pytest

from chaos.faults import LateCommit, SecondRun
from chaos.injectors import Env, Skip, build_injectors
from chaos.injectors.commit import ZOMBIE_AHEAD
from chaos.invariants import Evidence, intruders_refused
from chaos.job import JobProcess, JobSpec
from chaos.observe import RunView
from chaos.procs import Proc
from chaos.runner import RunOptions, run
from chaos.scenarios import SCENARIOS
from chaos.services import wait_until
from chaos.zombie import zombie_step
from checkpointing import manifest as mf
from checkpointing.storage import Storage

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

FAKE_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_job.py")
EVERY = 20


def live_run(url: str, pid: int, *, generation: int = 1, step: int = 10) -> Storage:
    """Storage as a running generation leaves it: FENCE (with the run's lease), status.json."""
    st = Storage(url)
    for g in range(generation + 1):
        mf.advance_fence(st, g, start_step=0, run_id="live")
    st.write_atomic(st.path("status.json"), json.dumps({
        "state": "running", "generation": generation, "step": step, "run_id": "live", "updated_at": time.time(),
        "workers": [{"rank": 0, "pid": pid, "node_id": "n", "actor_id": "a"}]}).encode())
    return st


def controller(st: Storage, worker, *, restart_from: int, commit_step: int | None) -> threading.Thread:
    """Plays the run's controller: once the worker is dead, fence generation 2 (restarting from
    `restart_from`), then commit `commit_step` as generation 2 (create if absent)."""
    def act() -> None:
        worker.wait(timeout=60)
        mf.advance_fence(st, 2, start_step=restart_from, run_id="live")
        if commit_step is not None:
            files = {"g000002/.metadata": {"size": 1, "sha256": "0" * 64}}
            st.put_if(f"{mf.step_path(st, commit_step)}/{mf.MANIFEST_NAME}",
                      mf.encode_manifest(commit_step, 1, 2, "g000002", files), if_token=None)
    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


def injector_env(url: str, tmp_path, **kw) -> Env:
    return Env(view=RunView(url), job_spec=JobSpec(storage=url, checkpoint_every=EVERY), out_dir=str(tmp_path), **kw)


def test_the_zombie_writes_ahead_of_a_fast_run_by_its_pace():
    assert zombie_step(10, 20, 5, pace=0.0) == 120
    assert zombie_step(1122, 20, 5, pace=50.0) == 1880        # 750 steps ahead: 15 s at 50 steps/s
    assert zombie_step(1120, 20, 5, pace=0.1) % 20 == 0


def judged(active) -> object:
    invoke = {"t": time.time(), "type": "invoke", "index": 0, "fault": active.fault.to_dict(), "detail": active.detail}
    return intruders_refused(Evidence(history=[invoke], attempts=[], total_steps=1, heartbeat_timeout_s=10))


@pytest.mark.parametrize("phase", ["check", "put"])
def test_a_zombies_late_commit_is_refused_and_a_newer_commit_survives(phase, tmp_path, spawn_worker):
    worker = spawn_worker()
    wait_until(lambda: Proc.of_worker(worker.pid) is not None, 10, "the fake worker")
    url = str(tmp_path / "run")
    st = live_run(url, worker.pid)
    step = zombie_step(10, EVERY, ZOMBIE_AHEAD, pace=0.0)     # where the zombie will write (the run stands still)
    ctl = controller(st, worker, restart_from=10, commit_step=step if phase == "put" else None)
    injector = build_injectors(injector_env(url, tmp_path))["late_commit"]
    injector.setup()
    active = injector.invoke(LateCommit(target="rank:0", phase=phase, within_s=60), random.Random(0))
    ctl.join(timeout=10)
    z = active.detail["zombie"]
    assert active.detail["pids"] == [worker.pid] and active.detail["acted_at"] >= active.detail["written_at"]
    assert (z["outcome"], z["generation"], z["step"], z["fence_moved_to"]) == ("fenced", 1, step, 2), z
    assert "FENCE is at generation 2" in z["error"] and z["deleted"] == []
    if phase == "put":
        # The PUT went out after generation 2 had committed the step, and lost the compare-and-swap.
        assert z["manifest_before_put"] == 2 and z["manifest_after"] == 2
        assert mf.read_manifest(st, step).generation == 2
    else:
        assert mf.read_manifest(st, step) is None
    assert judged(active).status == "pass"
    assert injector.heal(active) == {"zombie_killed": False}


def test_a_late_put_with_no_newer_commit_lands_outside_the_timeline(tmp_path, spawn_worker):
    worker = spawn_worker()
    wait_until(lambda: Proc.of_worker(worker.pid) is not None, 10, "the fake worker")
    url = str(tmp_path / "run")
    st = live_run(url, worker.pid)
    controller(st, worker, restart_from=10, commit_step=None)
    injector = build_injectors(injector_env(url, tmp_path))["late_commit"]
    # No newer commit comes, so the zombie puts at the end of `within_s`, which also covers its
    # start (imports), its shards and the fence's move: 15 s ran out before the fence moved in
    # CI's parallel pass on 2 cores ("no_fence_change").
    active = injector.invoke(LateCommit(target="rank:0", phase="put", within_s=30), random.Random(0))
    z = active.detail["zombie"]
    assert z["outcome"] == "landed" and "fenced writer's late commit" in z["rejected_by_fence"], z
    assert z["manifest_after"] == 1 and z["deleted"] == []          # its retention pass was skipped
    assert mf.list_committed(st) == []                               # no reader takes it
    assert judged(active).status == "pass"


def test_a_zombie_that_finds_no_running_generation_is_skipped(tmp_path):
    url = str(tmp_path / "run")
    st = Storage(url)
    mf.advance_fence(st, 0, run_id="live")
    st.write_atomic(st.path("status.json"), json.dumps({"state": "recovering", "generation": 0, "workers": [
        {"rank": 0, "pid": 1, "node_id": "n"}]}).encode())
    injector = build_injectors(injector_env(url, tmp_path))["late_commit"]
    with pytest.raises(Skip, match="not running"):
        injector.invoke(LateCommit(), random.Random(0))


def start_fake_job(tmp_path, *extra: str) -> tuple[JobSpec, JobProcess]:
    spec = JobSpec(storage=str(tmp_path / "run"), workers="1:1", steps=100_000, checkpoint_every=10,
                   script=FAKE_JOB, extra_args=("--step-s", "0.05", *extra))
    job = JobProcess(spec, dict(os.environ), str(tmp_path / "first.log")).start()
    view = RunView(spec.storage)
    wait_until(lambda: job.poll() is not None or (view.status() or {}).get("state") == "running", 30, "the fake job")
    assert job.poll() is None, open(tmp_path / "first.log").read()
    return spec, job


def test_a_second_run_is_refused_by_the_lease_and_the_first_goes_on(tmp_path):
    spec, job = start_fake_job(tmp_path)
    try:
        view = RunView(spec.storage)
        live = view.status()["run_id"]
        injector = build_injectors(Env(view=view, job_spec=spec, job_env=dict(os.environ), out_dir=str(tmp_path)))
        active = injector["second_run"].invoke(SecondRun(within_s=60), random.Random(0))
        d = active.detail
        assert d["exit_code"] == 4 and not d["timed_out"] and d["live_run"] == live, d
        assert f"in use by run {live}" in d["conflict_message"]
        assert d["first_run_went_on"]["ok"] and d["fence_after"]["run_id"] == live and not d["summary_written"]
        assert judged(active).status == "pass"
        assert injector["second_run"].heal(active) == {"second_run_stopped": False}
        assert job.poll() is None
    finally:
        job.stop()


def test_a_job_that_takes_no_lease_is_caught_running_twice(tmp_path):
    spec, job = start_fake_job(tmp_path, "--break", "nolease")
    try:
        injector = build_injectors(Env(view=RunView(spec.storage), job_spec=spec, job_env=dict(os.environ),
                                       out_dir=str(tmp_path)))
        active = injector["second_run"].invoke(SecondRun(within_s=3), random.Random(0))
        assert active.detail["timed_out"]
        verdict = judged(active)
        assert verdict.status == "fail" and "not refused" in verdict.detail, verdict.detail
    finally:
        job.stop()


def test_the_commit_scenario_on_the_fake_job_passes_every_invariant(tmp_path):
    sc = dataclasses.replace(SCENARIOS["commit"], steps=1000, workers="1:1", checkpoint_every=10, job_timeout_s=150)
    outcome = run(RunOptions(scenario=sc, seed=1, storage=str(tmp_path / "run"), out_dir=str(tmp_path / "out"),
                             script=FAKE_JOB, extra_args=("--step-s", "0.04"), reference="none"))
    report = outcome.report
    verdicts = {v["name"]: v for v in report["invariants"]}
    assert outcome.ok, json.dumps(report["invariants"], indent=1)
    skipped = [(f["kind"], f["skipped"]) for f in report["faults"] if not f["injected"]]
    assert report["kinds_injected"] == ["late_commit", "second_run"] and not skipped, skipped
    for name in ("intruders_refused", "no_committed_checkpoint_lost", "no_checkpoint_from_wrong_generation",
                 "faults_recovered"):
        assert verdicts[name]["status"] == "pass", verdicts[name]
    zombies = [f["detail"]["zombie"] for f in report["faults"] if f["kind"] == "late_commit"]
    assert sorted(z["phase"] for z in zombies) == ["check", "put"] and {z["outcome"] for z in zombies} == {"fenced"}
    history = [json.loads(line) for line in open(tmp_path / "out" / "history.jsonl")]
    assert any(e["type"] == "fence" for e in history)

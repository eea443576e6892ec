"""The run outlives its controller: SIGKILL of the controller's process mid-run, on a local Ray."""
from __future__ import annotations

import json
import os
import signal
import threading

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from elastic._worker.fault_gate import HoldAt
from run_file_schemas import validate_run
from support import pid_alive, read_json, wait_for

pytestmark = [pytest.mark.integration]

TINY = {"model_size": "tiny", "batch_size": 8}


class ControllerKiller(threading.Thread):
    """SIGKILL the controller's process once status.json shows the run past `at_step` (the ranks
    hold there until the kill: HoldAt), then release the ranks at once, so that they train on
    while no controller is there."""

    def __init__(self, run_dir: str, at_step: int, and_rank: int | None = None):
        """`and_rank`: SIGKILL that rank's worker too, while no controller is there."""
        super().__init__(daemon=True)
        self.run_dir, self.at_step, self.and_rank = run_dir, at_step, and_rank
        self.gate = run_dir.rstrip("/") + f".released-after-{at_step}"
        self.killed: int | None = None
        self.workers: list[int] = []
        self.step_seen: int | None = None

    def hold_config(self) -> dict:
        return HoldAt(self.at_step, self.gate).as_config()

    def run(self) -> None:
        try:
            def due():
                status = read_json(self.run_dir, "status.json") or {}
                ok = status.get("state") == "running" and status.get("step", 0) >= self.at_step
                return status if ok and status.get("controller") and status.get("workers") else None
            # The wait covers the run's start too: in CI's parallel pass on 2 cores, its workers
            # took 75 s to be ready (startup_wait_s allows 120), and 120 s here ran out as the
            # ranks reached the step.
            wait_for(due, 210, f"the run past step {self.at_step}")
            status = due()
            self.workers = sorted(w["pid"] for w in status["workers"])
            self.step_seen, self.killed = status["step"], status["controller"]["pid"]
            os.kill(self.killed, signal.SIGKILL)
            wait_for(lambda: not pid_alive(self.killed), 30, "the controller's process to die")
            if self.and_rank is not None:
                (pid,) = [w["pid"] for w in status["workers"] if w["rank"] == self.and_rank]
                os.kill(pid, signal.SIGKILL)
                self.workers.remove(pid)
        finally:
            open(self.gate, "w").close()


def fit(run_dir, killer, steps, strategy="ddp", workers=(2, 2)):
    killer.start()
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config={**TINY, **killer.hold_config()}, total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=workers[0], max_workers=workers[1], strategy=strategy, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=50),
        failure=FailureConfig(heartbeat_timeout_s=10.0, rendezvous_timeout_s=60.0)).fit()
    killer.join(timeout=5)
    assert killer.killed is not None, "the controller was never killed"
    assert result.ok and result.final_step == steps, (result.status, result.error)
    # Each step once in metrics.jsonl, those the ranks took while no controller was there too.
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    assert validate_run(run_dir)["metrics.jsonl"] == steps
    assert len(result.metrics.history["loss"]) == steps
    return result, result.summary


@pytest.mark.timeout(330)
def test_a_killed_controller_is_replaced_and_adopts_the_live_workers_losing_no_step(ray_session, run_dir):
    killer = ControllerKiller(run_dir, at_step=30)
    result, s = fit(run_dir, killer, steps=150)
    # Nothing was recovered: the generation went on, with the same processes.
    assert s["recoveries"] == [] and s["world_size_history"] == [[0, 2]]
    (restart,) = s["controller_restarts"]
    assert restart["kind"] == "running" and restart["adopted"] == 2 and restart["lost"] == restart["replaced"] == 0
    assert restart["pid"] != killer.killed and restart["without_controller_s"] > 0
    status = read_json(run_dir, "status.json")
    assert status["controller"]["restarts"] == 1 and status["controller"]["pid"] == restart["pid"]
    assert sorted(w["pid"] for w in status["workers"]) == killer.workers
    assert s["checkpoints"][-1] == 150 and s["samples_consumed"] == 150 * 16


@pytest.mark.timeout(330)
def test_an_fsdp_rank_killed_while_no_controller_is_there_is_recovered_once_the_replacement_is_up(
        ray_session, run_dir):
    killer = ControllerKiller(run_dir, at_step=30, and_rank=2)
    result, s = fit(run_dir, killer, steps=120, strategy="fsdp", workers=(2, 3))
    (restart,) = s["controller_restarts"]
    assert restart["kind"] == "running" and restart["adopted"] == 2 and restart["lost"] == 1
    # From the neighbours' host memory at the step the ranks held at; then the replacement grows it back.
    lost, *regrowth = s["recoveries"]
    assert lost["cause"] == "worker_died" and lost["rung"] == "memory" and lost["lost_steps"] == 0
    assert (lost["from_world"], lost["to_world"]) == (3, 2) and [r["cause"] for r in regrowth] in ([], ["scale_up"])
    # The survivors were never restarted: the adopted processes finished the run.
    status = read_json(run_dir, "status.json")
    assert set(killer.workers) <= {w["pid"] for w in status["workers"]} | {w["pid"] for w in status["spares"]}


DRIVER = """
import json, sys
sys.path[:0] = [{root!r}, {examples!r}]
import ray
import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
ray.init(address={address!r}, logging_level="WARNING")
result = ElasticTrainer(gpt.train_loop, train_loop_config={config!r}, total_steps={steps}, seed=0,
                        scaling=ScalingConfig(min_workers=2, max_workers=2, startup_wait_s=120),
                        checkpoint=CheckpointConfig(storage={storage!r}, every_n_steps=100),
                        failure=FailureConfig(rendezvous_timeout_s=60.0)).fit()
with open({out!r}, "w") as f:
    json.dump({{"status": result.status, "final_step": result.final_step, "ok": result.ok}}, f)
"""


def start_driver(tmp_path, ray_session, run_dir, name: str, steps: int):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script, out = tmp_path / f"{name}.py", tmp_path / f"{name}.json"
    script.write_text(DRIVER.format(root=root, examples=os.path.join(root, "examples"), storage=run_dir,
                                    address=ray_session.get_runtime_context().gcs_address, config=TINY,
                                    steps=steps, out=str(out)))
    log = open(tmp_path / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, str(script)], start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT), out


def end_the_run(ray_session, run_id: str | None) -> None:
    """Whatever the test did: the run's detached controller and workers go (the next tests share
    this Ray and need its CPUs)."""
    from elastic._run_names import NAMESPACE, RunNames, reap
    if run_id is None:
        return
    try:
        ray_session.kill(ray_session.get_actor(RunNames(run_id).controller(), namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass                                        # ended already
    reap(run_id)


@pytest.mark.timeout(240)
def test_the_run_outlives_its_driver_a_second_driver_attaches_and_sigterm_stops_it_cleanly(
        ray_session, run_dir, tmp_path):
    from checkpointing import RunConflictError
    steps = 3000
    first, _ = start_driver(tmp_path, ray_session, run_dir, "first", steps)
    second, run_id = None, None
    try:
        wait_for(lambda: (read_json(run_dir, "status.json") or {}).get("step", 0) >= 5, 120, "the run's 5th step")
        status = read_json(run_dir, "status.json")
        workers, killed_at = sorted(w["pid"] for w in status["workers"]), status["step"]
        run_id = status["run_id"]
        os.killpg(first.pid, signal.SIGKILL)           # the driver, and nothing else
        first.wait(timeout=10)
        # The run goes on without it.
        wait_for(lambda: (read_json(run_dir, "status.json") or {}).get("step", 0) >= killed_at + 30, 60,
                 "steps after the driver's death")
        # Another configuration on the live run's storage is refused, and told why.
        with pytest.raises(RunConflictError, match=r"total_steps \(3000 there, 3001 here\)"):
            ElasticTrainer(gpt.train_loop, train_loop_config=TINY, total_steps=steps + 1, seed=0,
                           scaling=ScalingConfig(min_workers=2, max_workers=2, startup_wait_s=120),
                           checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=100),
                           failure=FailureConfig(rendezvous_timeout_s=60.0)).fit()
        # The same command again attaches; SIGTERM to it (`ray job stop`) stops the run cleanly.
        second, out = start_driver(tmp_path, ray_session, run_dir, "second", steps)
        # SIGTERM once it follows the run (before, it is a driver that has not attached yet, and
        # Ray's own handler ends it: the run goes on, as after any driver's death).
        wait_for(lambda: b"following it to its end" in (tmp_path / "second.log").read_bytes(), 120,
                 "the second driver to attach")
        assert second.poll() is None
        os.killpg(second.pid, signal.SIGTERM)
        assert second.wait(timeout=90) == 0
        assert json.loads(out.read_text()) | {"final_step": None} == {"status": "stopped", "ok": True,
                                                                      "final_step": None}   # a stop asked for: ok
        summary = read_json(run_dir, "summary.json")
        assert summary["status"] == "stopped" and summary["recoveries"] == [] and summary["controller_restarts"] == []
        assert summary["checkpoints"][-1] == summary["final_step"] > killed_at
        final = read_json(run_dir, "status.json")
        assert sorted(w["pid"] for w in final["workers"]) == workers    # the same processes all along
        wait_for(lambda: not any(pid_alive(pid) for pid in workers), 30, "the workers to end with the run")
        assert not [entry for entry in ray_session.util.list_named_actors(all_namespaces=True)
                    if entry["name"].startswith(run_id)]
        from ray.util.placement_group import placement_group_table
        wait_for(lambda: all(entry["state"] == "REMOVED" for entry in placement_group_table().values()
                             if entry["name"].startswith(run_id)), 30, "the run's placement groups to be removed")
    finally:
        for driver in (first, second):
            if driver is not None and driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
        end_the_run(ray_session, run_id)

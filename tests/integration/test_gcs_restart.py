"""Ray's GCS restarted under a live run, with GCS fault tolerance (issue 32, docs/scale.md "The
head node"): the GCS keeps its tables in an external Redis (Debian's `redis-server`, started by
the test on loopback), its process is killed while the run trains and started again once the run
trained 20 steps without it. The run goes on through it and finishes: no recovery, no worker
restarted, no controller restarted (the controller's process lives in a raylet, not in the GCS),
each step once in metrics.jsonl.

Skipped where `redis-server` is not installed (`apt-get install redis-server`).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest

import gpt
from chaos.services import free_port, wait_until
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from elastic._worker.fault_gate import HoldAt
from support import read_json, wait_for

REDIS = shutil.which("redis-server")
pytestmark = [pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(300),
              pytest.mark.skipif(REDIS is None, reason="needs Debian's redis-server (apt-get install redis-server)")]

STEPS, HOLD = 400, 20
TRAINED_WHILE_DOWN = 20     # steps status.json shows past the hold before the GCS comes back


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def redis(tmp_path):
    port = free_port()
    assert REDIS is not None
    server = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _answers(port), 20, "redis-server to listen")
        yield f"127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait(timeout=30)


def test_the_run_goes_on_through_a_gcs_restart_with_no_worker_or_controller_restarted(
        ray_cluster, redis, run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_REDIS_ADDRESS", redis)      # the head's GCS keeps its tables there
    cluster, _ = ray_cluster(3)
    release = str(tmp_path / "release")
    outcome: dict = {}

    def train():
        try:
            outcome["result"] = ElasticTrainer(
                gpt.train_loop, train_loop_config={"model_size": "tiny", "batch_size": 8,
                                                   **HoldAt(HOLD, release).as_config()},
                total_steps=STEPS, seed=0, scaling=ScalingConfig(min_workers=2, max_workers=2, startup_wait_s=120),
                checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=100),
                failure=FailureConfig(heartbeat_timeout_s=20.0)).fit()
        except BaseException as error:   # noqa: BLE001 - reported by the assertion below
            outcome["error"] = error

    trainer = threading.Thread(target=train, daemon=True)     # the GCS is killed from the main thread
    trainer.start()
    wait_for(lambda: (read_json(run_dir, "status.json") or {}).get("step", 0) >= HOLD, 150,
             "the run to reach its hold step")
    before = read_json(run_dir, "status.json")
    pids = sorted(w["pid"] for w in before["workers"])
    cluster.head_node.kill_gcs_server()
    open(release, "w").close()
    down_at = time.time()
    # The workers train on with no GCS: their step exchange is theirs (gloo), and status.json is
    # the controller's, written to the run's storage (its journal's put waits on a thread of its
    # own: on the control loop's, status.json stood still for the whole outage).
    wait_for(lambda: (read_json(run_dir, "status.json") or {}).get("step", 0) >= HOLD + TRAINED_WHILE_DOWN, 60,
             "the run to train on while the GCS is down")
    during = read_json(run_dir, "status.json")
    cluster.head_node.start_gcs_server()
    up_at = time.time()
    trainer.join(timeout=240)
    assert not trainer.is_alive(), "the run did not end after the GCS came back"
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.status == "finished" and result.final_step == STEPS, (result.status, result.error)
    summary = result.summary
    assert summary["recoveries"] == [], summary["recoveries"]
    assert summary.get("controller_restarts", []) == [], summary.get("controller_restarts")
    last = read_json(run_dir, "status.json")
    assert sorted(w["pid"] for w in last["workers"]) == pids, "a worker was restarted"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    trained_while_down = [row["step"] for row in rows if down_at <= row["time"] <= up_at]
    print(f"GCS down {up_at - down_at:.1f}s: status.json went from step {before['step']} to {during['step']}, "
          f"{len(trained_while_down)} steps trained while it was down")
    assert len(trained_while_down) >= TRAINED_WHILE_DOWN

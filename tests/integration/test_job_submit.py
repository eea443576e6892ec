"""`ray job submit` end to end: a Ray head started with `ray start` on loopback, the main job
submitted with `--working-dir .`, a worker SIGKILLed from outside while it trains, the job
succeeding with the recovery recorded in summary.json.

The cluster is this test's alone: its own temp dir, ports and token (RAY_AUTH_MODE=token with a
fresh RAY_AUTH_TOKEN), and it is stopped by killing exactly its own processes (every process
whose environment carries this cluster's marker, and its raylets' agents). `ray stop` is not
used: it stops every Ray process on the machine, other users' clusters included.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid

import pytest

from chaos.services import free_port, wait_until
from elastic.local_ray import processes
from support import pid_alive, read_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(480)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)        # the venv's bin: ray, python
MARKER = "ELASTIC_TEST_RAY_CLUSTER"


def _cluster_pids(marker: str, marked: set[int]) -> list[int]:
    """Processes whose environment holds MARKER=marker: everything `ray start` spawned (GCS,
    raylet, dashboard, workers) and their children (the job's driver and actors); and the
    raylets' agents, which Ray may start with an environment that names only their raylet
    (elastic.local_ray.processes, the sweep a run's own local Ray is stopped with). `marked` keeps
    every pid seen with the marker, so an agent whose raylet has gone is still known."""
    return [pid for pid, _ in processes(marker, marked, variable=MARKER) if pid != os.getpid()]


def _stop_cluster(marker: str, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process of this cluster, SIGKILL what is left after `grace_s` (GCS, raylet
    and the agents were seen to outlive SIGTERM for 10 s); returns the pids still alive (none)."""
    marked: set[int] = set()

    def alive() -> list[int]:
        return [p for p in _cluster_pids(marker, marked) if pid_alive(p)]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 15.0)):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        with contextlib.suppress(TimeoutError):   # what is left gets the next signal, or is returned
            wait_until(lambda: not alive(), wait_s, "the test cluster's processes to exit", interval_s=0.2)
    return alive()


class Head:
    def __init__(self, env: dict, dashboard: str, token: str, temp_dir: str):
        self.env, self.dashboard, self.token, self.temp_dir = env, dashboard, token, temp_dir

    def get(self, path: str, auth: bool = True) -> dict:
        request = urllib.request.Request(self.dashboard + path)
        if auth:
            request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def ray(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([os.path.join(BIN, "ray"), *args], env=self.env, cwd=ROOT, text=True,
                              capture_output=True, timeout=timeout)


@pytest.fixture
def ray_head():
    """`ray start --head` on 127.0.0.1 with distinct ports and temp dir, token auth on; every
    process of it is stopped at the end, whatever the test did."""
    # Short: Ray's unix socket paths (<temp>/session_<date>_<pid>/sockets/...) must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    # The marker is the cluster's own temp dir: an agent whose process title overwrote its
    # environment is still found by the logs it holds open there (elastic.local_ray.processes).
    marker, token = temp_dir, secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env.update({MARKER: marker, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
                # As an activated venv: the job's `python` is the venv's (torch, elastic installed).
                "PATH": BIN + os.pathsep + env.get("PATH", ""), "PYTHONUNBUFFERED": "1"})
    gcs, dash = free_port(), free_port()
    cmd = [os.path.join(BIN, "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--num-cpus=4", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    head = Head(env, f"http://127.0.0.1:{dash}", token, temp_dir)
    try:
        started = subprocess.run(cmd, env=env, cwd=ROOT, text=True, capture_output=True, timeout=180)
        assert started.returncode == 0, f"ray start failed:\n{started.stdout[-3000:]}\n{started.stderr[-3000:]}"

        def dashboard_up() -> bool:
            try:
                return bool(head.get("/api/version"))
            except (OSError, ValueError):
                return False
        wait_for(dashboard_up, 120, "the Ray dashboard (job API) to answer")
        yield head
    finally:
        left = _stop_cluster(marker)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the test cluster still alive after SIGKILL: {left}"


def _job(head: Head, submission_id: str) -> dict:
    try:
        return head.get(f"/api/jobs/{submission_id}")
    except (OSError, ValueError):
        return {}


def test_job_submit_survives_a_killed_worker(ray_head, tmp_path):
    head = ray_head
    with pytest.raises(urllib.error.HTTPError) as denied:   # token auth is on for this cluster
        head.get("/api/version", auth=False)
    assert denied.value.code in (401, 403)

    storage = str(tmp_path / "run")
    steps = 300
    submission_id = f"elastic-{uuid.uuid4().hex[:8]}"
    submitted = head.ray(
        "job", "submit", f"--address={head.dashboard}", f"--submission-id={submission_id}", "--no-wait",
        "--working-dir", ".", "--", "python", "examples/pretrain.py", "--storage", storage, "--workers", "2:3",
        "--steps", str(steps), "--checkpoint-every", "25", "--model-size", "tiny", "--heartbeat-timeout", "30",
        "--quiet")
    assert submitted.returncode == 0, f"ray job submit failed:\n{submitted.stdout}\n{submitted.stderr}"

    def logs() -> str:
        try:
            return head.get(f"/api/jobs/{submission_id}/logs").get("logs", "")[-4000:]
        except (OSError, ValueError):
            return "(no logs)"

    # The uploaded package left out the venv and run outputs (.rayignore / .gitignore).
    packages = os.path.join(head.temp_dir, "session_latest", "runtime_resources", "working_dir_files")

    def unpacked() -> list[set[str]]:
        dirs = [os.path.join(packages, p) for p in os.listdir(packages)] if os.path.isdir(packages) else []
        return [set(os.listdir(d)) for d in dirs if os.path.isdir(d) and "examples" in os.listdir(d)]
    wait_for(unpacked, 120, "the working dir to be unpacked")
    for names in unpacked():
        assert "elastic" in names and not names & {".venv", "runs", ".git"}, names

    # Kill rank 1 from outside once the run trains at full size.
    victim: dict = {}

    def running_at_full_size() -> bool:
        status = read_json(storage, "status.json") or {}
        if _job(head, submission_id).get("status") in ("FAILED", "STOPPED", "SUCCEEDED"):
            raise AssertionError(f"job ended before the fault: {_job(head, submission_id)}\n{logs()}")
        workers = status.get("workers") or []
        if status.get("state") == "running" and status.get("world_size") == 3 and status.get("step", 0) >= 30:
            victim["pid"] = next(w["pid"] for w in workers if w["rank"] == 1)
            victim["step"] = status["step"]
            return True
        return False
    wait_for(running_at_full_size, 240, "the job to train with 3 workers")
    assert status_step_below(storage, steps), "the run finished before the fault could be injected"
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: not pid_alive(victim["pid"]), 30, "the killed worker to go")

    try:
        wait_for(lambda: _job(head, submission_id).get("status") in ("SUCCEEDED", "FAILED", "STOPPED"), 300,
                 "the job to end")
    except TimeoutError as error:   # say where it stood: the cluster and its logs go at teardown
        raise AssertionError(f"{error}\nstatus.json: {read_json(storage, 'status.json')}\n{logs()}") from None
    job = _job(head, submission_id)
    assert job["status"] == "SUCCEEDED", f"{job}\n{logs()}"

    summary = read_json(storage, "summary.json")
    assert summary is not None, logs()
    assert summary["status"] == "finished" and summary["final_step"] == steps, summary
    failures = [r for r in summary["recoveries"] if r["cause"] != "scale_up"]
    assert failures, f"no recovery recorded: {summary['recoveries']}"
    assert failures[0]["from_world"] == 3 and failures[0]["to_world"] >= 2, failures


def status_step_below(storage: str, steps: int) -> bool:
    status = read_json(storage, "status.json") or {}
    return status.get("step", 0) < steps and status.get("state") == "running"

"""Integration fixtures: one local Ray instance for the session, shut down even on failure."""
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest


@pytest.fixture(scope="session")
def _ray_shutdown_at_end():
    yield
    import ray
    ray.shutdown()


@pytest.fixture
def ray_session(_ray_shutdown_at_end):
    """A local Ray instance, started on first use and shared; a test that needs another
    cluster (tests/integration/test_node_loss.py) shuts it down and the next user restarts it."""
    import ray
    if not ray.is_initialized():
        # More logical CPUs than cores: up to 4 one-CPU workers fit on this 2-core machine.
        # address="local": always a new instance, never a cluster someone started on this machine.
        ray.init(address="local", num_cpus=6, include_dashboard=False, configure_logging=True,
                 logging_level="WARNING")
    return ray


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "run"
    return str(path)


@pytest.fixture(autouse=True)
def _no_stray_stopped_workers():
    """A test that SIGSTOPs a worker resumes it afterwards, so no process stays frozen."""
    stopped: list[int] = []
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    yield stopped
    import signal
    for pid in stopped:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    """A real S3 endpoint: moto's server on loopback, in its own process; always stopped."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError as error:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start: {log_path.read_text()[-2000:]}") from error
                time.sleep(0.1)  # polling interval of the readiness loop
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def s3_env(moto_endpoint, monkeypatch):
    """Standard AWS variables pointing at the moto endpoint, and a fresh bucket."""
    env = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    import boto3
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    return {"env": env, "bucket": bucket}


@pytest.fixture
def s3_url(s3_env):
    return f"s3://{s3_env['bucket']}/runs/x"

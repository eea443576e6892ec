"""Integration fixtures: one local Ray instance for the session, shut down even on failure."""
import os
import time
import uuid

import pytest

from chaos.services import MOTO_CREDENTIALS, MotoServer, ensure_bucket


@pytest.fixture(scope="session")
def _ray_shutdown_at_end():
    yield
    import ray
    ray.shutdown()


SESSION_CPUS = 6


def _cpus_back(ray, within_s: float = 15.0) -> bool:
    """Whether the shared Ray has all its CPUs free (waiting `within_s` for a finished test's
    actors and placement groups to go: their removal is asynchronous)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= SESSION_CPUS:
            return True
        time.sleep(0.5)
    return False


@pytest.fixture
def ray_session(_ray_shutdown_at_end, request):
    """A local Ray instance, started on first use and shared; a test that needs another
    cluster (tests/integration/test_node_loss.py) shuts it down and the next user restarts it.
    A test finds all its CPUs free: when an earlier test left something holding some (seen in
    CI, not yet explained: 4 CPUs held outside any placement group), the shared Ray is started
    again, and the log says so."""
    import ray
    if ray.is_initialized() and not _cpus_back(ray):
        print(f"\nray_session: {request.node.nodeid} found the shared Ray with "
              f"{ray.available_resources().get('CPU', 0.0)} of {SESSION_CPUS} CPUs free; restarting it", flush=True)
        ray.shutdown()
    if not ray.is_initialized():
        # More logical CPUs than cores: up to 4 one-CPU workers fit on this 2-core machine.
        # address="local": always a new instance, never a cluster someone started on this machine.
        ray.init(address="local", num_cpus=SESSION_CPUS, include_dashboard=False, configure_logging=True,
                 logging_level="WARNING")
    return ray


@pytest.fixture
def ray_cluster():
    """Starts a multi-node `ray.cluster_utils.Cluster` on this machine: `ray_cluster(*cpus)` adds
    a node of each CPU count beside a head without CPUs (the controller needs none), connects the
    driver, and returns (cluster, nodes). The shared local instance (ray_session) is shut down
    first; its next user restarts it. The cluster is always shut down."""
    import ray
    from ray.cluster_utils import Cluster
    started: list = []

    def start(*node_cpus: int):
        ray.shutdown()                  # one Ray per driver: leave the shared local instance
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        started.append(cluster)
        nodes = [cluster.add_node(num_cpus=cpus) for cpus in node_cpus]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        return cluster, nodes

    try:
        yield start
    finally:
        ray.shutdown()
        for cluster in started:
            cluster.shutdown()


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


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    """A real S3 endpoint: moto's server on loopback, in its own process; always stopped."""
    with MotoServer(str(tmp_path_factory.mktemp("moto") / "moto.log")) as moto:
        yield moto.endpoint


@pytest.fixture
def s3_env(moto_endpoint, monkeypatch):
    """Standard AWS variables pointing at the moto endpoint, and a fresh bucket."""
    env = {"AWS_ENDPOINT_URL": moto_endpoint, **MOTO_CREDENTIALS}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    ensure_bucket(f"s3://{bucket}", moto_endpoint)
    return {"env": env, "bucket": bucket}


@pytest.fixture
def s3_url(s3_env):
    return f"s3://{s3_env['bucket']}/runs/x"

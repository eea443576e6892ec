"""Integration fixtures: one local Ray instance for the session, shut down even on failure."""
import os

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray
    if not ray.is_initialized():
        # More logical CPUs than cores: up to 4 one-CPU workers fit on this 2-core machine.
        ray.init(num_cpus=6, include_dashboard=False, configure_logging=True, logging_level="WARNING")
    yield ray
    ray.shutdown()


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

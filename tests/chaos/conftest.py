"""Fixtures of the chaos suite's own tests: fake worker processes (always killed) and a moto
S3 server (always stopped)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from chaos.services import MOTO_CREDENTIALS, MotoServer

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def spawn_worker():
    """Start processes that look like Ray workers (command line "ray::FakeWorker"), so the
    injectors' safety check accepts them; every one is resumed and killed at teardown."""
    procs: list[subprocess.Popen] = []

    def spawn() -> subprocess.Popen:
        proc = subprocess.Popen(["ray::FakeWorker", "-c", "import time\nwhile True: time.sleep(0.05)"],
                                executable=sys.executable, start_new_session=True)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                break
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    with MotoServer(str(tmp_path_factory.mktemp("moto") / "moto.log")) as server:
        yield server.endpoint


@pytest.fixture
def s3_env(moto_endpoint, monkeypatch):
    for key, value in {**MOTO_CREDENTIALS, "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    return moto_endpoint

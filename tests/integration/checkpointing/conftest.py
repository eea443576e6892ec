"""Fixtures of the checkpointing integration tests: multi-process helpers and an S3 endpoint."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# ckpt_ranks.py / ckpt_rank_programs.py here, the shared conformance suite in the unit folder.
for p in (HERE, HERE.parents[1] / "unit" / "checkpointing"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402

import pytest  # noqa: E402

from ckpt_ranks import free_port  # noqa: E402


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    """A real S3 endpoint: moto's server on loopback, in its own process; always stopped."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [os.sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start: {log_path.read_text()[-2000:]}")
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
    env = {
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
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

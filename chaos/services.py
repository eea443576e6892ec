"""Local services a chaos run may need: an S3 endpoint (moto's server) and its bucket.

`MotoServer` is a context manager around `python -m moto.server` on loopback, in its own
process group, always stopped on exit. With it, `python -m chaos run ... --moto` needs no cloud
account and exercises the real S3 protocol (multipart uploads, 503 retries) end to end.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlsplit

MOTO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    """Poll `condition` until it holds; raise TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)   # polling interval of the condition, not a synchronisation sleep


class MotoServer:
    def __init__(self, log_path: str, host: str = "127.0.0.1"):
        self.host, self.log_path = host, log_path
        self.port = free_port(host)
        self.endpoint = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> MotoServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(self._ready, 60, f"moto server on {self.endpoint} (log: {self.log_path})")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        assert self.proc is not None, "started in __enter__"
        if self.proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {self.proc.returncode}; see {self.log_path}")
        try:
            urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __exit__(self, *exc) -> None:
        self.stop()


def ensure_bucket(url: str, endpoint: str | None) -> None:
    """Create the bucket of an s3:// URL if it does not exist (moto starts empty)."""
    import boto3
    bucket = urlsplit(url).netloc
    client = boto3.client("s3", endpoint_url=endpoint)
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)


def is_s3(url: str) -> bool:
    return urlsplit(url).scheme in ("s3", "s3a")

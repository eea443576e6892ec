"""The job under test: its command line, and the process that runs it (contract: docs/chaos.md)."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO

DEFAULT_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "pretrain.py")


@dataclass(frozen=True)
class JobSpec:
    storage: str
    workers: str = "3:3"
    steps: int = 1000
    checkpoint_every: int = 25
    seed: int = 0
    model_size: str | None = "tiny"
    strategy: str = "ddp"                      # the job's --strategy
    tp: int = 1                                # the job's --tp: tensor parallelism over replicas of T ranks
    pp: int = 1                                # the job's --pp: pipelines of P stages (replicas of T x P ranks)
    spare_workers: int = 0                     # the job's --spare-workers
    cpus_per_worker: float | None = None       # the job's --cpus-per-worker (None: its default)
    heartbeat_timeout_s: float | None = 10.0
    script: str = DEFAULT_SCRIPT
    extra_args: tuple[str, ...] = ()
    fail_at: tuple[int, int] | None = None     # (rank, step): the job's --fail-at
    bitflip_requests: str | None = None        # the job's --bitflip-requests (chaos.injectors.process.BitFlipInjector)

    def argv(self) -> list[str]:
        argv = [sys.executable, self.script, "--storage", self.storage, "--workers", self.workers,
                "--steps", str(self.steps), "--checkpoint-every", str(self.checkpoint_every),
                "--seed", str(self.seed), "--quiet"]
        if self.model_size:
            argv += ["--model-size", self.model_size]
        if self.strategy != "ddp":
            argv += ["--strategy", self.strategy]
        if self.tp != 1:
            argv += ["--tp", str(self.tp)]
        if self.pp != 1:
            argv += ["--pp", str(self.pp)]
        if self.spare_workers:
            argv += ["--spare-workers", str(self.spare_workers)]
        if self.cpus_per_worker is not None:
            argv += ["--cpus-per-worker", str(self.cpus_per_worker)]
        if self.heartbeat_timeout_s is not None:
            argv += ["--heartbeat-timeout", str(self.heartbeat_timeout_s)]
        if self.fail_at is not None:
            argv += ["--fail-at", f"{self.fail_at[0]}:{self.fail_at[1]}"]
        if self.bitflip_requests is not None:
            argv += ["--bitflip-requests", self.bitflip_requests]
        return argv + list(self.extra_args)

    def replace(self, **changes) -> JobSpec:
        return dataclasses.replace(self, **changes)

    def identity(self) -> dict:
        """What makes two runs comparable (everything but where they store)."""
        d = dataclasses.asdict(self)
        d.pop("storage")
        d.pop("fail_at")
        d.pop("bitflip_requests")
        return d


@dataclass
class JobProcess:
    spec: JobSpec
    env: dict[str, str]
    log_path: str
    prefix: list[str] = field(default_factory=list)    # e.g. `ip netns exec NS` (chaos.netns)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    _code: int | None = field(default=None, repr=False)

    def start(self) -> JobProcess:
        self._log = open(self.log_path, "ab")
        self.started_at = time.time()
        self.proc = subprocess.Popen(self.prefix + self.spec.argv(), env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def process(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError(f"the job {self.spec.script} was not started (JobProcess.start())")
        return self.proc

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.time()
        return code

    def stop(self, grace_s: float = 20.0) -> int:
        """SIGTERM to the job's whole process group, SIGKILL after `grace_s`. Idempotent."""
        if self._code is not None:
            return self._code
        if self.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Whatever it started in its session (an embedded Ray) goes with it.
        self._signal_group(signal.SIGKILL)
        code = self._code = self.process.wait(timeout=30)
        self.poll()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

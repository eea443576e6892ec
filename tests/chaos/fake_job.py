"""A stand-in for the main job, for testing the chaos runner itself: it follows the main job's
contract (flags, status.json, metrics.jsonl, checkpoints with COMMITTED manifests,
summary.json) in a few seconds, without Ray or torch. Its one "worker" is a child process
titled "ray::FakeWorker" that the injectors can signal; when it dies, the job records a
recovery and restarts it.

Like the runtime, it takes the storage's run lease first (a second start on a live run's
storage exits 4 with the RunConflictError message), renews it as it goes (about once a second,
on its one thread: it has nothing that stalls), fences each generation with the step it starts
from, and lets the lease go when it ends.

`--break MODE` makes it misbehave on purpose, so the invariants can be seen to catch it:
  rollback   after a lost worker, restart from step 0 although checkpoints are committed
  sha        end with a model hash that differs from a fault-free run's once it has recovered
  untyped    fail at the end without an error in summary.json
  nolease    take no lease: a second start trains on the same storage
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import types


def _bare_checkpointing_package() -> None:
    """Make `checkpointing.manifest` and `.storage` importable without the package's
    __init__, which imports torch for its CheckpointManager: that costs seconds of CPU per
    process on a loaded CI machine, and the chaos tests start this job dozens of times."""
    if "checkpointing" not in sys.modules:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        package = types.ModuleType("checkpointing")
        package.__path__ = [os.path.join(root, "checkpointing")]
        sys.modules["checkpointing"] = package


_bare_checkpointing_package()
import uuid  # noqa: E402

from checkpointing import manifest as mf  # noqa: E402 - after the bare package above
from checkpointing.errors import RunConflictError  # noqa: E402
from checkpointing.lease import acquire_run_lease  # noqa: E402
from checkpointing.storage import Storage  # noqa: E402

EXIT_STORAGE_IN_USE = 4
KEEP = 3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for flag in ("--storage", "--workers", "--model-size", "--fail-at", "--break"):
        p.add_argument(flag)
    for flag in ("--steps", "--checkpoint-every", "--seed"):
        p.add_argument(flag, type=int, default=0)
    p.add_argument("--heartbeat-timeout", type=float)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args()


class FakeRun:
    def __init__(self, args: argparse.Namespace):
        self.args, self.storage = args, Storage(args.storage)
        self.started = time.time()
        self.run_id = uuid.uuid4().hex
        self.lease = None if self.broken("nolease") else acquire_run_lease(args.storage, self.run_id)
        self.renewed_at = time.monotonic()
        committed = mf.list_committed(self.storage)
        self.resumed_from = committed[-1].step if committed else None
        self.step = self.resumed_from or 0
        fence = mf.read_fence(self.storage)
        self.generation = 0 if fence is None else fence + 1
        self.history, self.recoveries, self.metrics = [[self.step, 1]], [], {}
        if self.resumed_from:
            for line in self._read("metrics.jsonl").splitlines():
                row = json.loads(line)
                if row["step"] <= self.step:
                    self.metrics[row["step"]] = row
        self.worker = self._spawn()

    def broken(self, mode: str) -> bool:
        return self.args.__dict__["break"] == mode

    def _read(self, name: str) -> str:
        try:
            return self.storage.read_bytes(self.storage.path(name)).decode()
        except FileNotFoundError:
            return ""

    def _write(self, name: str, payload) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.storage.write_atomic(self.storage.path(name), data.encode())

    def _spawn(self) -> subprocess.Popen:
        if self.lease is not None:
            self.lease.fence(self.generation, start_step=self.step)
        else:
            mf.write_fence(self.storage, self.generation, start_step=self.step)
        return subprocess.Popen(["ray::FakeWorker", "-c", "import time\nwhile True: time.sleep(0.05)"],
                                executable=sys.executable)

    def status(self, state: str) -> None:
        committed = mf.list_committed(self.storage)
        self._write("status.json", {
            "state": state, "generation": self.generation, "step": self.step, "world_size": 1, "run_id": self.run_id,
            "last_committed_step": committed[-1].step if committed else None, "updated_at": time.time(),
            "workers": [{"rank": 0, "pid": self.worker.pid, "node_id": "fake", "actor_id": "fake"}]})

    def checkpoint(self) -> None:
        data_dir = mf.data_dir_name(self.generation)
        payload = f"model after step {self.step}".encode()
        sp = mf.step_path(self.storage, self.step)
        self.storage.write_atomic(f"{sp}/{data_dir}/shard", payload)
        files = {f"{data_dir}/shard": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}
        self.storage.write_atomic(f"{sp}/{mf.MANIFEST_NAME}",
                                  mf.encode_manifest(self.step, 1, self.generation, data_dir, files))
        for old in [c.step for c in mf.list_committed(self.storage)][:-KEEP]:
            self.storage.rm(f"{mf.step_path(self.storage, old)}/{mf.MANIFEST_NAME}")
            self.storage.rm(mf.step_path(self.storage, old))

    def recover(self) -> None:
        code = self.worker.wait()
        lost_at, t0 = self.step, time.time()
        self.generation += 1
        committed = mf.list_committed(self.storage)
        self.step = 0 if self.args.__dict__["break"] == "rollback" else (committed[-1].step if committed else 0)
        self.worker = self._spawn()
        self.history.append([self.step, 1])
        self.recoveries.append({"cause": "preempted" if code == -signal.SIGTERM else "worker_died",
                                "rung": "checkpoint", "detect_s": 0.0, "recover_s": round(time.time() - t0, 3),
                                "lost_steps": lost_at - self.step, "from_world": 1, "to_world": 1,
                                "step": self.step, "generation": self.generation})

    def summary(self, status: str, error: dict | None) -> None:
        self._write("metrics.jsonl", "".join(json.dumps(self.metrics[s]) + "\n" for s in sorted(self.metrics)))
        sha = hashlib.sha256(f"seed {self.args.seed} steps {self.step}".encode())
        if self.args.__dict__["break"] == "sha" and self.recoveries:
            sha.update(b"broken")             # as if a restore did not copy the state exactly
        self._write("summary.json", {
            "status": status, "final_step": self.step, "total_steps": self.args.steps,
            "world_size_history": self.history, "recoveries": self.recoveries,
            "checkpoints": [c.step for c in mf.list_committed(self.storage)], "loss_first": 1.0, "loss_last": 0.5,
            "model_sha256": sha.hexdigest() if status == "finished" else None,
            "wall_s": round(time.time() - self.started, 3), "goodput": 0.5, "resumed_from": self.resumed_from,
            "stragglers": [], "checkpoint_fallbacks": [], "config": {"checkpoint": {"keep": KEEP}},
            "error": error})

    def run(self) -> int:
        fail_at = tuple(int(x) for x in self.args.fail_at.split(":")) if self.args.fail_at else None
        while self.step < self.args.steps:
            if self.worker.poll() is not None:
                self.recover()
            time.sleep(self.args.step_s)     # the "training" of one step
            self.step += 1
            self.metrics[self.step] = {"step": self.step, "loss": 1.0 / self.step, "world_size": 1,
                                       "time": time.time(), "lr": 0.1, "global_batch": 8, "accum_steps": 1,
                                       "samples_seen": 8 * self.step}
            if fail_at and self.step == fail_at[1]:
                self.summary("failed", {"type": "InjectedUserError", "message": "--fail-at", "traceback": None,
                                        "ranks": [fail_at[0]]})
                self.status("failed")
                return 1
            if self.step % self.args.checkpoint_every == 0 or self.step == self.args.steps:
                self.checkpoint()
            if self.lease is not None and time.monotonic() - self.renewed_at >= 1.0:
                self.lease.renew()            # RunConflictError (taken over) ends the job, as it ends a run
                self.renewed_at = time.monotonic()
            self.status("running")
        self.status("finished")
        if self.args.__dict__["break"] == "untyped":
            self.summary("failed", None)
            return 1
        self.summary("finished", None)
        return 0


def main() -> int:
    try:
        run = FakeRun(parse_args())
    except RunConflictError as error:
        print(f"storage in use: {error}", file=sys.stderr)
        return EXIT_STORAGE_IN_USE
    try:
        return run.run()
    finally:
        run.worker.kill()
        run.worker.wait()
        if run.lease is not None:
            run.lease.release()


if __name__ == "__main__":
    sys.exit(main())

"""Test-only helpers shared by the unit, integration and GPU suites (`from support import ...`:
pytest puts tests/ on sys.path, see pyproject.toml's `pythonpath`).

What a test needs from a service (a free port, a moto S3 server and its bucket, waiting on a
condition with a deadline) is chaos.services', the shipped code the chaos suite runs with; this
module holds what only tests use:
- reading a run's files as they are being written (`read_json`);
- faults injected from outside, like an operator would: the target's pid comes from
  status.json, the signal from os.kill (`SignalAtStep`, with the framework's fault gate, and
  `SlowDown`), and a shrunk group held until its regrowth is ready (`ShrunkHold`);
- checks on processes (`pid_alive`, `no_children`), and code run in a fresh interpreter
  (`fresh_python`: what a new Ray worker or controller process imports, unseen by this one).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from chaos.services import wait_until
from elastic._worker.fault_gate import HoldAt

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- a run's files ------------------------------------------------------------------------------
def read_json(run_dir: str, name: str) -> dict | None:
    """A JSON file of the run's storage (a local path, or a URL read with this process's AWS
    variables); None while it is missing or half-written."""
    if "://" in run_dir:
        from checkpointing import CheckpointError
        from checkpointing.storage import Storage
        storage = Storage(run_dir)
        try:
            return json.loads(storage.read_bytes(storage.path(name)))
        except (CheckpointError, FileNotFoundError, json.JSONDecodeError):
            return None
    try:
        with open(os.path.join(run_dir, name)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """chaos.services.wait_until at the runtime tests' 50 ms poll (TimeoutError naming `what`)."""
    wait_until(condition, timeout_s, what, interval_s=0.05)


# ---- processes ----------------------------------------------------------------------------------
def fresh_python(code: str, *args: str, timeout_s: float, cwd: str = REPO_ROOT,
                 stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run `code` (`python -c code *args`) in a new interpreter that imports this checkout; its
    output is captured (bytes), its exit status left to the caller."""
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT}, timeout=timeout_s)


def pid_alive(pid: int) -> bool:
    """The process exists and is no zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:     # it ended between the two looks
        return False


def no_children(deadline_s: float = 10.0) -> bool:
    """Every child process of this one (DataLoader workers, ...) has ended within `deadline_s`."""
    try:
        wait_until(lambda: not multiprocessing.active_children(), deadline_s, "the child processes to end",
                   interval_s=0.01)
    except TimeoutError:
        return False
    return True


def run_processes(procs: list, timeout_s: float) -> None:
    """Start these multiprocessing processes, wait for each (`timeout_s` apiece) and require exit
    code 0; whatever happens, none is left running."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
            assert p.exitcode == 0, f"rank process exit code {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)


# ---- faults injected from outside ---------------------------------------------------------------
class SignalAtStep(threading.Thread):
    """Send `sig` to the worker with `rank` (None: to every worker at once) once status.json
    shows the run past `at_step`.

    Pass `hold_config()` in the run's `train_loop_config` and the framework's fault gate
    (elastic/_worker/fault_gate.py) holds every rank after `at_step` until the signal is sent (the
    gate file is created after it, and always when this thread ends): the fault lands at exactly
    that step however fast the machine. The examples' `--hold-at {at_step}:{gate}` sets the same
    gate. Without the hold it lands wherever the run is when the controller next reports (about
    once a second), and a short run may finish first; a save there may be where it lands.

    With `after_release_s`, the hold is released first and the signal follows that many seconds
    later: the fault lands mid-step a few steps past `at_step` (the ranks resume within the gate's
    10 ms poll), in a step's compute or sync rather than in the hold, with the steps between
    `at_step` and the next checkpoint as the margin."""

    def __init__(self, run_dir: str, at_step: int, sig: int, rank: int | None, timeout_s: float = 120.0,
                 gate: str | None = None, when: Callable[[dict], bool] = lambda status: True,
                 after_release_s: float | None = None):
        super().__init__(daemon=True)
        self.when = when                  # a further condition on status.json (e.g. a spare is ready)
        self.after_release_s = after_release_s
        self.run_dir, self.at_step, self.sig, self.rank, self.timeout_s = run_dir, at_step, sig, rank, timeout_s
        # A local file the workers can see (give one for a run on object storage).
        self.gate = gate or run_dir.rstrip("/") + f".released-after-{at_step}"
        self.pid: int | None = None
        self.sent_at: float | None = None
        self.step_seen: int | None = None
        self.status_seen: dict | None = None       # status.json as it was when the signal went

    def hold_config(self) -> dict:
        """The `train_loop_config` entry that sets the framework's hold at this fault's step."""
        return HoldAt(self.at_step, self.gate).as_config()

    def run(self) -> None:
        try:
            self._signal_at_step()
        finally:
            open(self.gate, "w").close()

    def _signal_at_step(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            status = read_json(self.run_dir, "status.json") or {}
            if status.get("state") == "running" and status.get("step", 0) >= self.at_step and self.when(status):
                pids = [w["pid"] for w in status.get("workers", []) if self.rank is None or w["rank"] == self.rank]
                if pids:
                    self.pid, self.step_seen, self.status_seen = pids[0], status["step"], status
                    if self.after_release_s is not None:
                        open(self.gate, "w").close()
                        time.sleep(self.after_release_s)    # the run's steps after the hold, not a wait for a state
                    self.sent_at = time.time()
                    for pid in pids:
                        os.kill(pid, self.sig)
                    return
            if status.get("state") in ("finished", "failed"):
                return
            time.sleep(0.02)   # polling interval of the condition, not a synchronisation sleep

    def fired(self) -> bool:
        return self.pid is not None


SHRUNK_HOLD_KEY = "tests_shrunk_hold"


class ShrunkHold:
    """Hold a shrunk group until its regrowth is ready, so that a run needs no hundreds of steps
    of margin for a replacement's start on a loaded machine: in a generation of `world_size`
    ranks (with `armed_file`, only once it exists), every rank waits after the generation's
    `after`-th step until `release_file` exists (at most HoldAt's limit: a release that never
    comes fails the run, not the test's timeout). Pass `as_config()` in the run's
    `train_loop_config` and call `ShrunkHold.wrap(ctx)` in the loop; `release_when` creates the
    file. The workers import neither this module nor a test's: a test using it registers both
    for pickling by value (`cloudpickle.register_pickle_by_value`)."""

    def __init__(self, world_size: int, after: int, release_file: str, armed_file: str | None = None):
        self.world_size, self.after, self.release_file, self.armed_file = world_size, after, release_file, armed_file

    def as_config(self) -> dict:
        return {SHRUNK_HOLD_KEY: self}

    @staticmethod
    def wrap(ctx):
        """The context as the loop sees it: the run's own, its report() holding as configured."""
        hold = ctx.config.get(SHRUNK_HOLD_KEY) if isinstance(ctx.config, dict) else None
        return ctx if hold is None else _ShrunkHoldContext(ctx, hold)

    def release_when(self, run_dir: str, condition: Callable[[dict], bool], timeout_s: float,
                     what: str) -> threading.Thread:
        """A started thread that creates the release file once `condition(status.json)` holds,
        and in any case when it ends (after `timeout_s`)."""
        def release() -> None:
            try:
                wait_for(lambda: condition(read_json(run_dir, "status.json") or {}), timeout_s, what)
            finally:
                open(self.release_file, "w").close()
        thread = threading.Thread(target=release, daemon=True)
        thread.start()
        return thread


class _ShrunkHoldContext:
    def __init__(self, ctx, hold: ShrunkHold):
        self._ctx, self._hold, self._reported = ctx, hold, 0

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def report(self, **metrics) -> None:
        self._ctx.report(**metrics)
        self._reported += 1
        hold = self._hold
        if self._reported == hold.after and self._ctx.world_size == hold.world_size \
                and (hold.armed_file is None or os.path.exists(hold.armed_file)):
            from elastic._protocol import ThreadPlace
            from elastic._worker import thread_position
            thread_position.mark(ThreadPlace.HELD)
            HoldAt(self._ctx.step, hold.release_file).wait()


class SlowDown(threading.Thread):
    """Steal a share of the wall time of the worker with `rank` once the run is past `at_step`:
    SIGSTOP/SIGCONT duty cycles, `slowdown` = period / running time (1.5: stopped a third of
    the time). The heal (SIGCONT) always runs: at `stop()`, or when the process is gone."""

    def __init__(self, run_dir: str, at_step: int, rank: int, slowdown: float, period_s: float = 0.03):
        super().__init__(daemon=True)
        self.run_dir, self.at_step, self.rank = run_dir, at_step, rank
        self.running_s = period_s / slowdown
        self.stopped_s = period_s - self.running_s
        self.pid: int | None = None
        self.started_at: float | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            status = read_json(self.run_dir, "status.json") or {}
            if status.get("state") in ("finished", "failed"):
                return
            if status.get("state") == "running" and status.get("step", 0) >= self.at_step:
                pids = [w["pid"] for w in status.get("workers", []) if w["rank"] == self.rank]
                if pids:
                    self.pid = pids[0]
                    break
            time.sleep(0.02)   # polling interval of the condition
        if self.pid is None:
            return
        self.started_at = time.time()
        try:
            while not self._halt.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.stopped_s)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(self.running_s)
        except ProcessLookupError:
            return                  # evicted and killed
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class FakeClock:
    """A clock that moves only when told (`advance`): parts that take a `clock=` in the tests."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

"""Attacks on the commit protocol from outside the run: a fenced writer's late commit, and a
second run on the same storage.

late_commit   A zombie process (chaos/zombie.py) plays rank 0 of the current generation: it
              writes a checkpoint of a step ahead of the run through the checkpointing package's
              own save path and stalls at its commit; the injector then kills the target workers,
              so the run re-forms under a newer generation (FENCE moves); the zombie then tries
              to commit, before its final fence check or with its PUT already past it (the
              fault's `phase`). Why a separate process and not the fault proxy holding a real
              rank 0's PUT: the proxy only exists for s3:// storage, and a held real PUT is
              judged by what the runtime happens to do next (a warm re-form from survivors that
              are past the step makes the late commit legitimately part of the timeline); the
              zombie is the same code path, on every storage, with the stall exactly where the
              fault says and a step the newer generation is known to restart before.
second_run    The job as the campaign runs it (same script, flags, storage, environment and
              cluster), started a second time while the first is live: it must be refused by the
              run lease within the fault's time, and the first run must go on untouched.

Both wait for their outcome inside `invoke` (the nemesis gates the next fault on it anyway), so
the whole story is in the invoke's `detail`; `acted_at` there is when the run was hit, which
is what a recovery is matched against. Their heals stop any process of theirs still alive.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from chaos.faults import Fault, LateCommit, SecondRun
from chaos.injectors import Active, Injector, Skip, Unsupported
from chaos.injectors.process import _detail
from chaos.job import JobProcess
from chaos.observe import fence_facts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_POLL_S = 0.1               # polling interval of the zombie's events and of the run's status
ZOMBIE_KEEP = 3             # the zombie manager's retention, CheckpointConfig's default
# How many checkpoint intervals past the run's step the zombie writes: the run re-forms after
# the kill at about the step it was at, and must restart before the zombie's step (else that
# step is legitimately on its timeline), from a fast run (tens of steps a second) too.
ZOMBIE_AHEAD = 5
DONE_GRACE_S = 30.0         # past within_s, for the zombie to finish its commit and report
# For the zombie's start (it imports torch: 10 s and more on a loaded CI machine) before it writes:
# its own `--within` clock starts after its imports, so the start does not count against within_s.
START_GRACE_S = 30.0
EXIT_GRACE_S = 15.0         # after its report, for the zombie to exit
FIRST_RUN_PROGRESS_S = 60.0  # after the second run exits, for the first to show a new step


def _status_facts(status: dict | None) -> dict[str, Any]:
    status = status or {}
    return {"state": status.get("state"), "generation": status.get("generation"), "step": status.get("step"),
            "run_id": status.get("run_id"), "updated_at": status.get("updated_at"),
            "pids": sorted(w.get("pid") for w in status.get("workers") or [] if isinstance(w, dict))}


def _scratch(env, name: str) -> str:
    directory = env.out_dir or tempfile.mkdtemp(prefix="chaos-")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, name)


class LateCommitInjector(Injector):
    kind = "late_commit"

    def setup(self) -> None:
        if self.env.job_spec is None:
            raise Unsupported("late_commit needs the job's checkpoint interval (the campaign's job spec)")

    def _endpoint(self) -> str | None:
        # Through the fault proxy, as the run's own workers reach the store.
        if self.env.proxy is not None:
            return self.env.proxy.endpoint
        return (self.env.view.storage_options or {}).get("endpoint_url")

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, LateCommit)
        status = self.env.view.status() or {}
        if status.get("state") != "running" or not self.env.view.workers():
            raise Skip(f"the run is not running (state {status.get('state')!r}): no generation to impersonate")
        events = _scratch(self.env, f"zombie-{time.time_ns()}.jsonl")
        argv = [sys.executable, "-m", "chaos.zombie", "--storage", self.env.view.url,
                "--every", str(self.env.job_spec.checkpoint_every), "--ahead", str(ZOMBIE_AHEAD),
                "--phase", fault.phase, "--within", str(fault.within_s), "--keep", str(ZOMBIE_KEEP),
                "--events", events]
        endpoint = self._endpoint()
        if endpoint:
            argv += ["--endpoint", endpoint]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        with open(events + ".log", "ab") as log:
            zombie = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return self._attack(fault, rng, zombie, events)
        except BaseException:
            _kill(zombie)
            raise

    def _attack(self, fault: LateCommit, rng: random.Random, zombie: subprocess.Popen, events: str) -> Active:
        deadline = time.monotonic() + fault.within_s
        seen = _wait_event(events, ("written", "done"), zombie, deadline + START_GRACE_S)
        if seen is None or seen["event"] == "done":
            _kill(zombie)
            why = (seen or {}).get("outcome") or "no report"
            raise Skip(f"the zombie did not get to its commit ({why}: {(seen or {}).get('error') or _tail(events)})")
        workers = self.targets(fault.target, rng)
        procs = self.procs(workers)
        sent = [p.signal(signal.SIGKILL) for p in procs]
        acted_at = round(time.time(), 3)
        done = _wait_event(events, ("done",), zombie, deadline + START_GRACE_S + DONE_GRACE_S)
        if done is None:
            _kill(zombie)
            waited = fault.within_s + START_GRACE_S + DONE_GRACE_S
            done = {"outcome": "timeout", "error": f"no outcome {waited:.0f}s after the zombie started; killed. "
                                                   f"Its log: {_tail(events)}"}
        try:
            zombie.wait(timeout=EXIT_GRACE_S)     # it exits right after reporting
        except subprocess.TimeoutExpired:
            _kill(zombie)
        report = {k: v for k, v in done.items() if k not in ("event", "t")}
        detail = _detail(workers, procs, sent)
        detail.update(acted_at=acted_at, zombie=report, written_at=seen.get("t"),
                      method=f"zombie process of generation {report.get('generation')} stalled at its commit "
                             f"({fault.phase}); the target workers killed to move the fence")
        return Active(fault, detail, state=zombie)

    def heal(self, active: Active) -> dict:
        return {"zombie_killed": _kill(active.state)}


class SecondRunInjector(Injector):
    kind = "second_run"

    def setup(self) -> None:
        if self.env.job_spec is None:
            raise Unsupported("second_run needs the job as the campaign runs it (its job spec)")

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, SecondRun)
        view = self.env.view
        status = view.status() or {}
        if status.get("state") != "running":
            raise Skip(f"the run is not running (state {status.get('state')!r}): no live run to conflict with")
        fence_before, status_before = fence_facts(view.fence()), _status_facts(status)
        summary_before = view.read_json("summary.json")
        # Another configuration (its seed): the same one would attach to the live run and follow it.
        spec = self.env.job_spec.replace(fail_at=None, seed=self.env.job_spec.seed + 1)
        log_path = _scratch(self.env, f"second-run-{time.time_ns()}.log")
        job = JobProcess(spec, dict(self.env.job_env or os.environ), log_path,
                         prefix=list(self.env.exec_prefix or [])).start()
        acted_at = round(time.time(), 3)
        try:
            deadline = time.monotonic() + fault.within_s
            while job.poll() is None and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            timed_out = job.poll() is None
            code = job.stop(grace_s=10.0)
        except BaseException:
            job.stop(grace_s=0.0)
            raise
        elapsed = round((job.ended_at or time.time()) - job.started_at, 2)
        fence_after, status_after = fence_facts(view.fence()), _status_facts(view.status())
        summary_after = view.read_json("summary.json")
        went_on = self._first_run_goes_on(status_after)
        with open(log_path, errors="replace") as f:
            output = f.read()
        conflict_lines = [line for line in output.splitlines() if "in use by" in line or "RunConflictError" in line]
        detail = {"acted_at": acted_at, "argv": spec.argv(), "exit_code": code, "timed_out": timed_out,
                  "elapsed_s": elapsed, "within_s": fault.within_s, "log": log_path,
                  "live_run": (fence_before or {}).get("run_id") or status_before["run_id"],
                  "conflict_message": conflict_lines[-1][-1000:] if conflict_lines else None,
                  "output_tail": output[-1500:],
                  "fence_before": fence_before, "fence_after": fence_after,
                  "status_before": status_before, "status_after": status_after,
                  "summary_written": summary_after is not None and summary_after != summary_before,
                  # The first run completed its steps before the second was judged: the second may
                  # then rightly take the storage over, and nothing is proven either way.
                  "first_run_finished": status_after["state"] == "finished",
                  "first_run_went_on": went_on}
        return Active(fault, detail, state=job)

    def _first_run_goes_on(self, at_exit: dict) -> dict:
        """Whether the first run trains on after the refusal: a newer step, or its own end."""
        deadline = time.monotonic() + FIRST_RUN_PROGRESS_S
        while time.monotonic() < deadline:
            now = _status_facts(self.env.view.status())
            if (now["step"] or 0) > (at_exit["step"] or 0) or now["state"] in ("finished", "failed"):
                return {"ok": True, "status": now}
            time.sleep(_POLL_S)
        return {"ok": False, "status": _status_facts(self.env.view.status()),
                "why": f"no new step within {FIRST_RUN_PROGRESS_S:.0f}s of the second run's exit"}

    def heal(self, active: Active) -> dict:
        job: JobProcess = active.state
        alive = job.poll() is None
        job.stop(grace_s=0.0)
        return {"second_run_stopped": alive}


def _wait_event(path: str, names: tuple[str, ...], proc: subprocess.Popen, deadline: float) -> dict | None:
    """The first event of `names` in the zombie's events file; None at the deadline, or when the
    zombie died without it."""
    while time.monotonic() < deadline:
        for event in _events(path):
            if event.get("event") in names:
                return event
        if proc.poll() is not None:
            return next((e for e in _events(path) if e.get("event") in names), None)
        time.sleep(_POLL_S)
    return None


def _events(path: str) -> list[dict]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue    # a line being written
    return out


def _tail(events: str) -> str:
    try:
        with open(events + ".log", errors="replace") as f:
            return f.read()[-600:]
    except FileNotFoundError:
        return ""


def _kill(proc: subprocess.Popen | None) -> bool:
    """SIGKILL the process (its session) if it is still running; whether it was."""
    if proc is None or proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=30)
    return True

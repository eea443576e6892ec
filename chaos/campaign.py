"""A campaign: the job's attempts under the nemesis, in the environment they need.

    environment  a Ray cluster when the scenario removes or cuts off nodes; the S3 fault proxy
                 in front of s3:// storage; the commit watcher
    attempts     an attempt armed with a user error runs first, without other faults: it must
                 fail fast, naming the rank. After a typed failure the scenario allows (that
                 one, or the failure policy giving up), the job is restarted on the same
                 storage and resumes. When the job finishes before the schedule does, it is run
                 again with more steps (the contract's "run again with a larger --steps"), so a
                 campaign's length follows its schedule on a fast machine as on a slow one
    final heal   always, in `finally`: faults healed, workers resumed, job, watcher, proxy and
                 cluster stopped, worker processes the faults touched killed if still alive
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from chaos.cluster import LocalCluster
from chaos.faults import UserError
from chaos.history import History
from chaos.injectors import Env, build_injectors
from chaos.job import JobProcess, JobSpec
from chaos.nemesis import CommitWatcher, Nemesis
from chaos.observe import RunView
from chaos.procs import resume_and_kill
from chaos.proxy import FaultProxy
from chaos.scenarios import Scenario
from chaos.schedule import Schedule
from chaos.services import wait_until

log = logging.getLogger("chaos.campaign")

STARTUP_TIMEOUT_S = 300.0
RESTARTABLE_ERRORS = ("TooManyFailuresError", "FailureRateError", "NoProgressError", "InsufficientWorkersError")
MAX_EXTENSIONS = 20


class Campaign:
    def __init__(self, sc: Scenario, spec: JobSpec, schedule: Schedule, view: RunView, history: History, *,
                 out_dir: str, upstream: str | None, timeout_s: float | None,
                 on_running: Callable[[], None] | None = None):
        self.sc, self.spec, self.schedule, self.view, self.history = sc, spec, schedule, view, history
        self.on_running = on_running        # called once, when the job first trains (its first attempt)
        self.out_dir, self.upstream, self.timeout_s = out_dir, upstream, timeout_s or sc.job_timeout_s
        self.attempts: list[dict] = []
        self.info: dict[str, Any] = {"unsupported": {}, "proxy_counts": None,
                                     "cluster": "embedded Ray (started by the job)"}
        self.env = Env(view=view, driver_pid=self._driver_pid)
        self.cluster: Any = None          # LocalCluster / NetnsCluster, when the scenario has nodes
        self.proxy: FaultProxy | None = None
        self.job: JobProcess | None = None
        # Drivers a kill_driver fault took out during the attempt, replaced by `job`: their process
        # groups may still hold the run's own Ray, which goes with the attempt's end.
        self.left_drivers: list[JobProcess] = []
        self.attempt_spec = spec
        self.watcher: CommitWatcher | None = None
        self.nemesis: Nemesis | None = None
        self.job_env: dict[str, str] = {}
        self.deadline = 0.0
        self.t0: float | None = None            # when training first ran: schedule times count from it
        self.down_since: float | None = None     # when the last attempt ended (restarts do not count)

    def run(self) -> JobSpec:
        """Runs every attempt; returns the job as last run (its --steps may have grown)."""
        try:
            self._setup()
            return self._attempts()
        finally:
            self._teardown()

    # ---- environment ---------------------------------------------------------------------------
    def _setup(self) -> None:
        self.cluster, self.info["cluster"] = start_cluster(self.sc, self.out_dir)
        if getattr(self.cluster, "heal_command", None):
            # Recorded as it starts: a runner killed later leaves this for the operator's heal.
            self.history.record("cluster", id=self.cluster.id, description=self.info["cluster"],
                                heal=self.cluster.heal_command)
        self.job_env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.cluster is not None:
            self.job_env.update(self.cluster.env())
        if self.upstream and self.upstream.startswith("http://"):
            self.proxy = proxy = FaultProxy(self.upstream, host=getattr(self.cluster, "host_ip", "127.0.0.1"))
            self.job_env["AWS_ENDPOINT_URL"] = proxy.endpoint
            self.job_env.pop("AWS_ENDPOINT_URL_S3", None)
        self.env.cluster, self.env.proxy = self.cluster, self.proxy
        self.env.job_spec, self.env.job_env, self.env.out_dir = self.spec, self.job_env, self.out_dir
        self.env.exec_prefix = self.cluster.exec_prefix() if self.cluster is not None else []
        self.watcher = watcher = CommitWatcher(self.view, self.history)
        watcher.start()
        self.nemesis = nemesis = Nemesis(self.schedule, build_injectors(self.env), self.view, self.history,
                                         total_steps=self.spec.steps, heartbeat_timeout_s=self.sc.heartbeat_timeout_s,
                                         job_alive=self._job_alive, commits=watcher, cluster=self.cluster)
        nemesis.setup()
        self.info["unsupported"] = dict(nemesis.unsupported)

    def _teardown(self) -> None:
        """Every step runs even when one before it fails, or a Ctrl-C/SIGTERM lands meanwhile:
        the first error is raised once all of them have run."""
        errors: list[BaseException] = []
        for step in (self._final_heal, self._stop_job, self._stop_watcher, self._teardown_injectors,
                     self._close_proxy, self._stop_cluster, self._kill_leftovers):
            try:
                step()
            except BaseException as e:   # re-raised below, after the other steps
                log.exception("teardown step %s failed", step.__name__)
                errors.append(e)
        if errors:
            raise errors[0]

    def _final_heal(self) -> None:
        if self.nemesis is not None:
            self.nemesis.heal_all(self.env.touched)             # whatever happened to the run

    def _stop_job(self) -> None:
        for job in [*self.left_drivers, self.job]:
            if job is not None:
                job.stop()
        self.left_drivers = []

    def _stop_watcher(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    def _teardown_injectors(self) -> None:
        if self.nemesis is not None:
            self.nemesis.teardown()

    def _close_proxy(self) -> None:
        if self.proxy is not None:
            self.info["proxy_counts"] = self.proxy.snapshot()
            self.proxy.close()

    def _stop_cluster(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()

    def _kill_leftovers(self) -> None:
        left = resume_and_kill(self.env.touched)
        if left:
            self.history.record("cleanup", killed_leftover_workers=left)

    def _running(self) -> tuple[Nemesis, JobProcess]:
        """The nemesis and the attempt's job, once set up and started."""
        if self.nemesis is None or self.job is None:
            raise RuntimeError("the campaign is not set up, or no attempt has started")
        return self.nemesis, self.job

    def _job_alive(self) -> bool:
        self._replace_killed_driver()
        return self.job is not None and self.job.poll() is None and time.time() < self.deadline

    def _driver_pid(self) -> int | None:
        return self.job.process.pid if self.job is not None and self.job.poll() is None else None

    def _replace_killed_driver(self) -> None:
        """A driver that a kill_driver fault took out does not end the attempt: the same job is
        started again, to attach to the live run (the nemesis goes on with its schedule)."""
        job = self.job
        if job is None or job.poll() is None or job.process.pid not in self.env.drivers_killed:
            return
        self.left_drivers.append(job)
        n = len(self.attempts)
        log_path = os.path.join(self.out_dir, f"job-{n}-driver-{len(self.left_drivers)}.log")
        self.job = JobProcess(self.attempt_spec, self.job_env, log_path,
                              prefix=self.cluster.exec_prefix() if self.cluster is not None else []).start()
        self.history.record("driver_replaced", attempt=n, killed=job.process.pid, pid=self.job.process.pid)

    # ---- attempts ------------------------------------------------------------------------------
    def _attempts(self) -> JobSpec:
        armed = next((f for f in self.schedule.launch_faults if isinstance(f, UserError)), None)
        spec, restarts_left, extensions_left = self.spec, self.sc.restarts, MAX_EXTENSIONS
        while True:
            attempt = self._attempt(spec.replace(fail_at=(armed.rank, armed.step) if armed else None), armed)
            nemesis, _ = self._running()
            summary = attempt["summary"] or {}
            error = (summary.get("error") or {}).get("type")
            pending = nemesis.next_index < len(self.schedule.entries)
            if attempt["timed_out"]:
                break
            if summary.get("status") == "failed":
                restartable = (armed is not None and error) or error in RESTARTABLE_ERRORS
                if not restartable or restarts_left <= 0:
                    break
                restarts_left -= 1
            elif summary.get("status") == "finished":
                if not pending or extensions_left <= 0:
                    break
                extensions_left -= 1
                spec = spec.replace(steps=self._extended_steps(spec, summary))
            else:
                break
            armed = None
            nemesis.heal_all(self.env.touched)
        self._running()[0].skip_rest("the run had ended")
        return spec

    def _attempt(self, spec: JobSpec, armed: UserError | None) -> dict:
        n = len(self.attempts)
        self.deadline = time.time() + self.timeout_s
        self.env.job_spec, self.attempt_spec = spec.replace(fail_at=None), spec
        self.job = JobProcess(spec, self.job_env, os.path.join(self.out_dir, f"job-{n}.log"),
                              prefix=self.cluster.exec_prefix() if self.cluster is not None else []).start()
        nemesis, job = self._running()
        nemesis.total_steps = spec.steps
        self.history.record("job_start", attempt=n, argv=spec.argv())
        if armed is not None:
            self.history.record("invoke", index=len(self.schedule.entries), fault=armed.to_dict(),
                                detail={"armed": f"--fail-at {armed.rank}:{armed.step}", "ranks": [armed.rank]},
                                run={"generation": -1}, committed_newest=None)
        if self._wait_running():
            now = time.time()
            self.history.record("running", attempt=n)
            if self.on_running is not None:
                on_running, self.on_running = self.on_running, None
                on_running()
            # An armed attempt runs alone: other faults would move it past the generation in
            # which the user error is armed.
            if armed is None:
                self.t0 = now if self.t0 is None else self.t0 + (now - (self.down_since or now))
                nemesis.run(self.t0)
        nemesis.wait_heals(lambda: not self._job_alive())
        first, job = job, self._running()[1]
        timed_out = job.poll() is None
        code = job.stop()
        for left in self.left_drivers:      # the run's own Ray, if it is still in a killed driver's group
            left.stop()
        self.left_drivers = []
        self.down_since = time.time()
        status, summary = self.view.status() or {}, self.view.summary()
        if self.attempts and summary == self.attempts[-1]["summary"]:
            summary = None              # the previous attempt's: this one wrote none
        attempt = {"summary": summary, "exit_code": code, "timed_out": timed_out,
                   "fail_at": list(spec.fail_at) if spec.fail_at else None, "steps": spec.steps,
                   "started_at": first.started_at, "ended_at": job.ended_at or self.down_since}
        self.attempts.append(attempt)
        self._keep_copy(n)
        self.history.record("job_exit", attempt=n, exit_code=code, timed_out=timed_out, steps=spec.steps,
                            status=(summary or {}).get("status"), run_id=status.get("run_id"),
                            error=((summary or {}).get("error") or {}).get("type"))
        return attempt

    def _wait_running(self) -> bool:
        _, job = self._running()
        try:
            wait_until(lambda: job.poll() is not None or (self.view.status() or {}).get("state") == "running",
                       STARTUP_TIMEOUT_S, "the run to start training")
        except TimeoutError:
            return False
        return job.poll() is None

    def _extended_steps(self, spec: JobSpec, summary: dict) -> int:
        """More steps for the rest of the schedule, at the pace the last attempt trained."""
        start = summary.get("resumed_from") or 0
        rate = max(0.1, (summary.get("final_step", spec.steps) - start) / max(1.0, summary.get("wall_s") or 1.0))
        remaining_s = self.schedule.entries[-1].at_s - (time.time() - (self.t0 or time.time()))
        # Each pending fault waits for a commit by the generation it hits (Nemesis._gate): up to
        # checkpoint_every steps of every new generation, however late the schedule already is.
        pending = len(self.schedule.entries) - self._running()[0].next_index
        # A little more than the rest of the schedule; if recoveries eat it, one more extension.
        extra = int((max(0.0, remaining_s) * 1.2 + 10.0) * rate) + (pending + 1) * spec.checkpoint_every
        log.info("the job finished before the schedule: running it again with %d more steps", extra)
        return spec.steps + extra

    def _keep_copy(self, n: int) -> None:
        """summary.json and metrics.jsonl are rewritten by each attempt (and may live in a store
        that goes away with the run): keep each attempt's next to the report."""
        summary = self.view.summary()
        if summary is not None:
            with open(os.path.join(self.out_dir, f"summary-{n}.json"), "w") as f:
                json.dump(summary, f, indent=1)
        with open(os.path.join(self.out_dir, f"metrics-{n}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.view.metrics())


def start_cluster(sc: Scenario, out_dir: str) -> tuple[Any, str]:
    """The Ray cluster a scenario needs (None: the job starts its own), and how to describe it."""
    if not sc.nodes:
        return None, "embedded Ray (started by the job)"
    if sc.namespaced:
        from chaos.netns import NetnsCluster, netns_unsupported_reason
        reason = netns_unsupported_reason()
        if reason is None:
            cluster = NetnsCluster(sc.nodes, log_dir=os.path.join(out_dir, "ray-nodes"))
            try:
                cluster.start()
                return cluster, (f"{sc.nodes} Ray nodes in network namespaces (id {cluster.id}, "
                                 f"{cluster.cidr}, token auth)")
            except BaseException:
                cluster.shutdown()
                raise
        log.warning("network namespaces unavailable (%s): plain local cluster, partitions skipped", reason)
    local = LocalCluster(sc.nodes)
    try:
        return local.start(), f"ray.cluster_utils.Cluster with {sc.nodes} one-CPU nodes"
    except BaseException:
        local.shutdown()
        raise

"""The Ray actor hosting the controller, its worker group and the run's record."""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic._controller.adoption import judge, restart_record
from elastic._controller.background_read import BackgroundRead
from elastic._controller.commit_watch import CommitWatch
from elastic._controller.controller import Controller, run_loop
from elastic._controller.feed import Event, RunFeed
from elastic._controller.journal import BackgroundPuts, Journal, JournalEntry, RayJournal
from elastic._controller.run_record import RunRecorder
from elastic._controller.states import RunState
from elastic._controller.worker_group import RayWorkerGroup
from elastic._credentials import MaskingFormatter, quiet_credential_notices
from elastic._protocol import RunSpec
from elastic._ray_metrics import RayMetricsListener
from elastic._run_names import RunNames
from elastic.config import LOG_FORMAT, LOG_LEVEL_ENV
from elastic.errors import UserCodeError
from elastic.local_ray import stop_own_ray

if TYPE_CHECKING:
    from checkpointing.lease import LeaseKeeper

FULL_LISTING_EVERY_S = 30.0     # committed_since lists at least this often, whatever the hint says
STOP_POLL_S = 1.0               # how often the STOP request (elastic stop) is read: one GET, and the stop's latency
GC_YOUNG_THRESHOLD = 20_000     # allocations between collections of the youngest generation (CPython: 700)
LINGER_S = 60.0                 # how long an ended run's controller keeps its outcome for a driver


class RunEndedError(RuntimeError):
    """A controller restarted after its run ended (its journal says so): the record is on storage."""


def tune_gc() -> None:
    """The controller's process collects cyclic garbage less often than CPython's default.

    Why: it holds a few objects per worker (slot, view, report, plan: ~170,000 at 10,000 workers)
    and builds a view per worker at every tick, freed by reference counting at the next. With the
    default threshold those short-lived views set off collections that promote them, and a full
    collection of everything falls every few ticks, most often in the one that allocates a plan per
    worker: at 10,000 workers the re-form tick took 180-205 ms instead of ~85 (BENCHMARKS S1).
    Cycles are still collected, a few times less often; the controller runs in its own process."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(GC_YOUNG_THRESHOLD, young), middle, old)


class CheckpointView:
    """What the controller needs from committed checkpoints; it is not in any process group."""

    def __init__(self, url: str, storage_options: dict | None, keep: int | None, run_id: str | None = None):
        from checkpointing import CheckpointManager
        self._storage_options = storage_options
        self._run_id = run_id          # the run holding the storage's lease: fencing checks it is still this one
        self._manager = CheckpointManager(url, keep=keep, storage_options=storage_options, async_save=False)
        self._listed_at = -float("inf")     # monotonic time committed_since last listed the manifests
        # The STOP request is read on a thread of its own (started by the first stop_request()):
        # the controller's tick reads what it found, never storage.
        self._stop = BackgroundRead("stop-request-reader", self._read_stop, STOP_POLL_S, None,
                                    what="the stop request (elastic stop)")

    def latest_step(self) -> int | None:
        latest = self._manager.latest()
        return latest.step if latest is not None else None

    def committed_steps(self) -> list[int]:
        return [info.step for info in self._manager.committed()]

    def committed_since(self, step: int | None) -> list[int]:
        """Steps committed after `step`, oldest first (reads only their manifests). When the
        newest-commit hint names `step` itself, nothing is new: one small GET instead of a
        listing. The hint only saves work: the manifests are listed when it names another
        step, and at least every FULL_LISTING_EVERY_S whatever it says (its write may fail)."""
        now = time.monotonic()
        if step is not None and now - self._listed_at < FULL_LISTING_EVERY_S:
            try:
                if self._manager.latest_hint() == step:
                    return []
            except Exception:   # noqa: BLE001 - a hint: list instead
                pass
        self._listed_at = now
        return [info.step for info in self._manager.committed_since(step)]

    def fence(self, generation: int, start_step: int | None = None) -> None:
        """FENCE to `generation` (a compare-and-swap; FencedError if it is past it already,
        RunConflictError if another run took the storage over), with the step it starts from."""
        self._manager.set_generation(generation, start_step=start_step, run_id=self._run_id)

    def current_fence(self) -> int | None:
        from checkpointing import read_fence
        return read_fence(self._manager.url, self._storage_options)

    def stop_request(self) -> dict | None:
        """The STOP request (`elastic stop`) as last read, or None: no storage call here. It is
        read every STOP_POLL_S on the "stop-request-reader" thread, from the first call on (a
        storage error reads as no news: the last value stays and it is read again)."""
        self._stop.start()
        return self._stop.value

    def _read_stop(self) -> dict | None:
        from elastic.stop_request import read_stop
        return read_stop(self._manager.storage)

    def close(self) -> None:
        """Stop reading the STOP request."""
        self._stop.close()


def ray_node_id() -> str:
    import ray
    return ray.get_runtime_context().get_node_id()


def run_status(finished: bool, step: int, total_steps: int) -> str:
    """summary.json's status: a loop that returned before total_steps stopped early, which is
    not a finish (a later resume trains on to total_steps)."""
    if not finished:
        return "failed"
    return "finished" if step >= total_steps else "stopped_early"


class ControllerActor:
    # What run() closes at the end; defaults for an actor a test builds without __init__.
    _lease: LeaseKeeper | None = None
    _journal: Journal | None = None
    _ended_before = False
    _loop: threading.Thread | None = None
    _outcome: dict[str, Any] | BaseException | None = None
    _closers: tuple[Callable[[], None], ...] = ()

    def __init__(self, spec: RunSpec, config: dict[str, Any], failure_policy, scaling_policy, feed: bool = False,
                 run_id: str | None = None):
        """`spec`: the run, its configs whole (the same the workers get); `config`: the effective
        configuration as plain JSON, for summary.json."""
        handler = logging.StreamHandler()
        handler.setFormatter(MaskingFormatter(LOG_FORMAT))   # no URL password in a traceback either
        logging.basicConfig(level=logging.INFO, handlers=[handler])
        quiet_credential_notices()
        tune_gc()
        # LoggingConfig's level, from the driver through the runtime env.
        logging.getLogger("elastic").setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO"))
        spec.apply_storage_env()     # the driver's credentials, before anything here opens storage
        scaling, failure, checkpoint, total_steps = spec.scaling, spec.failure, spec.checkpoint, spec.total_steps
        options = dict(checkpoint.storage_options) or None
        # The driver's callbacks drain the feed (`events`); without callbacks nobody would.
        self._feed = RunFeed() if feed else None
        if run_id is not None:
            # The lease fit() took in the driver, renewed from now on by a thread of its own.
            from checkpointing.lease import LeaseKeeper, RunLease
            self._lease = LeaseKeeper(RunLease(url=checkpoint.storage, run_id=run_id, generation=None,
                                               storage_options=options))
        self._recorder = RunRecorder(checkpoint.storage, options, total_steps=total_steps, config=config,
                                     background=True, feed=self._feed,
                                     listeners=[RayMetricsListener(run=checkpoint.storage)], run_id=run_id,
                                     holds_storage=self._lease.holds if self._lease is not None else None,
                                     kept_through=spec.kept_through)
        self._checkpoints = CheckpointView(checkpoint.storage, options, checkpoint.keep, run_id)
        commits = CommitWatch(self._checkpoints)
        commits.start()
        self._closers = (commits.close, self._checkpoints.close)
        self._run_id, self._url, self._options, self._config = run_id, checkpoint.storage, options, config
        self._started = time.time()
        self._started_lock, self._done, self._collected = threading.Lock(), threading.Event(), threading.Event()
        # A run's workers belong to the run, not to this process: named, detached, and adopted by
        # the controller Ray restarts in this actor's place if this process dies (adoption).
        names = RunNames(run_id) if run_id is not None else None
        self._journal = Journal(BackgroundPuts(RayJournal(run_id))) if run_id is not None else None
        # A run id is new with each fit(): a journal entry or a named worker of it means that this
        # process replaces a lost controller of the run (Ray restarted the actor).
        resumed, self._ended_before = self._journal.opening() if self._journal is not None else (None, False)
        replacing = not self._ended_before and (resumed is not None or (names is not None and bool(names.workers())))
        group = RayWorkerGroup(spec, names=names)
        self._controller = Controller(
            group, self._recorder, self._checkpoints, scaling=scaling,
            failure=failure, total_steps=total_steps, failure_policy=failure_policy, scaling_policy=scaling_policy,
            commits=commits, lease=self._lease, journal=self._journal, resumed=resumed)
        self._recorder.controller_is(os.getpid(), ray_node_id(), self._started)
        if replacing:
            self._take_over(group, resumed)
            self.start()           # no driver may be there to start it: the run goes on by itself
        elif self._ended_before:
            # Restarted after its run ended (it died while keeping the outcome): a driver that waits
            # reads the record on storage; nothing else is left to do here.
            threading.Thread(target=self._end_later, name="controller-end", daemon=True).start()

    def _take_over(self, group: RayWorkerGroup, entry: JournalEntry | None) -> None:
        """Replace the lost controller: adopt its workers (adoption), record the restart."""
        after = entry.record.metrics_step if entry is not None else 0
        found = group.adopt(after_step=after, next_wid=entry.next_wid if entry is not None else 0)
        adoption = judge(entry, {wid: report for wid, (report, _) in found.items()})
        now = time.time()
        # The lost controller's last sign of life: its journal's newest entry, or its last poll.
        lost_at = max([entry.written_at if entry is not None else 0.0]
                      + [now - since for _, since in found.values()])
        self._controller.take_over(adoption, entry)
        record = restart_record(adoption, lost_at=lost_at, adopted_at=time.time(), pid=os.getpid(),
                                node=ray_node_id())
        self._recorder.on_controller_restart(record)
        logging.getLogger("elastic.controller").warning(
            "this controller replaced a lost one, %.1fs without a controller: %s", record["without_controller_s"],
            adoption.reason)

    def start(self) -> None:
        """Run the loop on a thread of its own (once): the run goes on whether a driver waits for
        it or not. The driver's `wait` starts it; a replacing controller starts it itself."""
        with self._started_lock:
            if self._loop is not None:
                return
            self._loop = threading.Thread(target=self._run_to_end, name="controller-loop", daemon=True)
            self._loop.start()

    def wait(self) -> dict[str, Any]:
        """Start the run if it is not going yet (`start`), and return its outcome (`run`'s) once it
        ended. A controller restarted after the run ended has none: RunEndedError, and the driver
        reads the run's record on storage."""
        if self._ended_before:
            raise RunEndedError("the run ended before this controller started: its record is on storage")
        self.start()
        self._done.wait()
        self._collected.set()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def _run_to_end(self) -> None:
        try:
            self._outcome = self.run()
        except BaseException as error:   # noqa: BLE001 - run() returns; a bug that escapes still ends the wait
            self._outcome = error
        finally:
            self._done.set()
        # Nobody may collect the outcome (the driver left): the actor ends itself a while after,
        # without a restart (it is detached: nothing else would end it). A driver that collected
        # it ends the actor itself once the answer has reached it; should that driver die first,
        # the actor ends after LINGER_S more.
        if self._collected.wait(LINGER_S):
            time.sleep(LINGER_S)
        self._end_now()

    def _end_later(self) -> None:
        time.sleep(LINGER_S)
        self._end_now()

    @staticmethod
    def _end_now() -> None:
        """End this actor for good (no restart), and with it the run's own local Ray when it
        runs on one (elastic.local_ray: the driver that started it is gone, or would have ended
        this actor before now)."""
        stop_own_ray()
        try:
            import ray
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        except Exception:   # not in an actor (the unit tests), or Ray going down
            logging.getLogger("elastic.controller").debug("could not end the controller's actor", exc_info=True)

    def run(self) -> dict[str, Any]:
        controller = self._controller
        try:
            run_loop(controller)
        except BaseException as crash:   # a controller bug must still end in a summary
            logging.getLogger("elastic.controller").exception("controller crashed")
            controller.crashed(crash)
        try:
            controller.flush_logs()
        except Exception:   # the summary matters more than a last log line
            logging.getLogger("elastic.controller").exception("could not record the last ctx.log values")
        for close in self._closers:      # the background reads: the run's last files are written below
            close()
        finished = controller.state.state == RunState.FINISHED
        error = controller.error
        try:
            checkpoints = self._checkpoints.committed_steps()
        except Exception:   # noqa: BLE001 - listing may fail when storage is the thing that broke
            checkpoints = []
        self._recorder.on_commits(checkpoints)     # the final commit, too recent for the status listing
        summary = self._recorder.write_summary(
            status="stopped" if controller.state.state == RunState.STOPPED
            else run_status(finished, controller.step, controller.total_steps), final_step=controller.step,
            checkpoints=checkpoints,
            model_sha256=controller.model_sha256,
            error=None if error is None else {k: error[k] for k in ("type", "message", "traceback", "ranks")})
        try:
            # The newest commit as the final listing found it: the commit watch looks every few
            # seconds on its own thread, and is closed by now (the final commit is often newer).
            self._recorder.write_status(force=True, state=controller.state.state.value,
                                        last_committed_step=checkpoints[-1] if checkpoints else None)
        except Exception:   # the outcome must reach the driver: fit() returns, never raises
            logging.getLogger("elastic.controller").exception("could not write the final status.json")
        if self._journal is not None:
            self._journal.end()          # the run ended: a restart of this actor adopts nothing
        if self._lease is not None:
            self._lease.close()          # renewed up to here: the final status.json says the run ended
        if self._run_id is not None:
            try:   # the next run on this storage needs no wait and no takeover
                from checkpointing import release_run_lease
                release_run_lease(self._url, self._run_id, storage_options=self._options)
            except Exception:   # a final status.json already says the run ended
                logging.getLogger("elastic.controller").warning("could not release the storage lease", exc_info=True)
        exception = None
        if error is not None:
            exception = error.get("exception") or UserCodeError(f"{error['type']}: {error['message']}")
        return {"status": summary["status"], "final_step": controller.step, "summary": summary,
                "metrics": self._recorder.user_metrics(), "error": exception,
                "traceback": error.get("traceback") if error else None}

    def config(self) -> dict[str, Any]:
        """The run's effective configuration (what a driver that attaches compares with its own)."""
        return self._config

    def events(self, after: int) -> list[Event]:
        """The driver's callbacks' events after number `after` (see elastic._controller.feed)."""
        return self._feed.after(after) if self._feed is not None else []

    def snapshot(self) -> dict[str, Any]:
        c = self._controller
        return {"state": c.state.state.value, "step": c.step, "total_steps": c.total_steps,
                "generation": c.generation, "world_size": c.world_size,
                "last_committed_step": c.status.last_committed, "failures": len(c.failures),
                "loss": self._recorder.last_loss, "elapsed_s": time.time() - self._started}

"""The run's record on storage: status.json (live), metrics.jsonl (per step), summary.json (end).

Owned by the controller, which tells `RunRecorder` the run's events. The recorder composes three
parts, one role each, and hands each event to the parts it concerns, then to the driver's feed
(elastic._controller.feed) and to the run's listeners (`RunListener`, e.g. the Ray metrics):
- `MetricsLog` (elastic._controller.metrics_log): metrics.jsonl and the run's metrics (Result.metrics);
- `StatusWriter` (elastic._controller.status_writer): status.json, throttled, and when the lines are flushed,
  on a thread of its own with `background=True`;
- `RunSummary` (elastic._controller.run_summary): the pure accumulator behind summary.json, with
  the run's time ledger (elastic._controller.time_ledger).

The time ledger needs one event the controller tells nobody else: the end of the wait for workers.
It is read from the status the controller hands over at each transition (`write_status`'s
`state`): the first state after `scheduling`. A recovery is told to the feed and the listeners
when it closes; its own time ledger is known only at the re-formed group's first step (it
reaches summary.json, and the listeners' `on_time_ledger` then).

status.json and summary.json are rewritten whole and atomically (one PUT on S3), so a reader
never sees a torn file. Every file here is strict JSON: a non-finite value is written `null`, and
carries its `format` version (elastic.schemas, where the JSON Schema of each file ships).

Threads: every event comes on the controller's thread, and so do the listeners' calls (the new
commits too: the commit watch finds them on its own thread, the controller announces them). The
writes of status.json and the flush of metrics.jsonl run on the status writer's thread.

The files are the run's only while it holds the storage's lease (`holds_storage`, the lease
keeper's plain answer): once another run has taken the storage over, nothing more is written
(status.json, metrics.jsonl, summary.json are that run's now); the summary is still built and
returned.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from checkpointing.storage import Storage
from elastic._controller.feed import FeedKind, RunFeed
from elastic._controller.journal import RecordState
from elastic._controller.metrics_log import MetricsLog
from elastic._controller.run_summary import RunSummary, earlier_invocations
from elastic._controller.status_writer import StatusWriter
from elastic._protocol import StepRecord
from elastic.schemas import dumps, status_doc, strict

log = logging.getLogger("elastic.record")


class RunRecord(Protocol):
    """What the controller, its report intake and its status report tell the run's record
    (`RunRecorder`; in the unit tests, fakes.FakeRecorder). All on the controller's thread."""

    @property
    def resumed_from(self) -> int | None: ...      # the step the run resumed from (summary.json)

    def resumed(self, step: int) -> None: ...
    def on_generation_start(self, step: int, world_size: int) -> None: ...
    def correct_generation_start(self, step: int, *, resumed: bool = False) -> None: ...
    def on_step(self, record: StepRecord) -> None: ...
    def on_log(self, record: StepRecord) -> None: ...
    def rollback_to(self, step: int) -> None: ...
    def on_final_data(self, samples_consumed: int, data_order: str | None) -> None: ...
    def on_recovery(self, recovery: dict[str, Any]) -> None: ...
    def on_commits(self, steps: list[int]) -> None: ...
    def on_straggler(self, flag: dict[str, Any]) -> None: ...
    def on_checkpoint_fallback(self, fallback: dict[str, Any]) -> None: ...
    def write_status(self, *, force: bool = False, **status: Any) -> None: ...
    def journal_state(self) -> RecordState: ...
    def restore_journal(self, state: RecordState) -> None: ...


class RunListener(Protocol):
    """Told of the run's events after the record has them, on the controller's thread. A
    listener that raises is logged and skipped: it never breaks the record."""

    def on_step(self, record: StepRecord) -> None:
        """A completed step (the kept attempt so far: a step may be told again when redone)."""

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        """A closed recovery, as summary.json lists it (`cause`, `recover_s`, ...; its own
        `time_ledger` comes later, at the re-formed group's first step)."""

    def on_time_ledger(self, parts: dict[str, float]) -> None:
        """The run's time ledger so far (seconds per part; see elastic._controller.time_ledger),
        when a recovery's parts are known, every LEDGER_EVERY_S of steps and at the end.
        Optional: the record skips a listener without it."""


LEDGER_EVERY_S = 10.0     # how often the listeners hear the time ledger while steps go on


class RunRecorder:
    def __init__(self, url: str, storage_options: dict | None, *, total_steps: int,
                 config: dict[str, Any], min_interval_s: float = 1.0, background: bool = False,
                 feed: RunFeed | None = None, listeners: Iterable[RunListener] = (), run_id: str | None = None,
                 clock: Callable[[], float] = time.time, holds_storage: Callable[[], bool] | None = None,
                 kept_through: Callable[[int], int] | None = None):
        self._url = url
        self._holds_storage = holds_storage            # None: no lease kept (the files are always this run's)
        self._let_go = False                           # the files are not written now (said once per change)
        self._run_id = run_id                          # in every status.json: the storage lease's holder
        self._storage = Storage(url, storage_options)      # shared by the parts that write
        self.metrics_log = MetricsLog(self._storage)
        self._clock = clock                            # wall clock: the summary's and its time ledger's
        self.summary = RunSummary(total_steps=total_steps, config=config, clock=clock)
        self._scheduling = True                        # the controller has not left SCHEDULING yet
        self._ledger_told_at = -float("inf")
        self.status_writer = StatusWriter(self._write_status_file, self.flush_metrics,
                                          min_interval_s=min_interval_s, background=background,
                                          name=self._storage.display_url)
        self._feed = feed                             # the driver's callbacks' events (None: no callbacks)
        # The newest step no recovery but a storage fallback takes back, given the newest step
        # completed (RunSpec.kept_through); None: a step is kept once completed.
        self._kept_through = kept_through
        self._kept = 0                                # the newest kept step the feed announced
        self._kept_lock = threading.Lock()            # steps (controller's thread) and commits announce it
        self._listeners = list(listeners)
        self._commits_lock = threading.Lock()         # on_commits: the controller's thread, then the run's end
        self._newest_commit = 0                       # newest committed step the feed announced (or resumed)
        self._controller: dict[str, Any] | None = None   # status.json's "controller" (pid, node, since)

    @property
    def url(self) -> str:
        return self._url

    @property
    def last_loss(self) -> float | None:
        return self.summary.last_loss

    @property
    def resumed_from(self) -> int | None:
        """The step the run resumed from (summary.json reports it)."""
        return self.summary.resumed_from

    def resumed(self, step: int) -> None:
        """The run resumes from `step` (the newest checkpoint as planned): summary.json says so,
        carries on the earlier invocations' entries, and the previous run's metrics lines up to
        it are kept."""
        self.summary.resumed_from = step
        self.summary.earlier = earlier_invocations(self._previous_summary())
        self.load_previous_metrics(step)

    def _previous_summary(self) -> dict[str, Any] | None:
        """The summary.json the previous invocation left (None: none, or unreadable: the history
        then starts here, and the log says why)."""
        path = self._storage.path("summary.json")
        try:
            if not self._storage.exists(path):
                return None
            return json.loads(self._storage.read_bytes(path))
        except Exception:
            log.warning("could not read the previous summary.json under %s: its invocations are not carried on",
                        self._storage.display_url, exc_info=True)
            return None

    def load_previous_metrics(self, up_to_step: int) -> None:
        """On resume, keep the lines of the previous run up to the step we resume from (their
        metrics start the run's history: Result.metrics covers the steps before the resume too)."""
        with self._commits_lock:
            self._newest_commit = max(self._newest_commit, up_to_step)     # the previous run's commit
        self.metrics_log.load_previous(up_to_step)

    # ---- events ------------------------------------------------------------------------
    def on_generation_start(self, step: int, world_size: int) -> None:
        self.summary.on_generation_start(step, world_size)

    def correct_generation_start(self, step: int, *, resumed: bool = False) -> None:
        """The generation that just started restored `step`, not the planned one (a corrupt
        newest checkpoint); `resumed`: it is the run's first after a resume, which it resumed from."""
        self.summary.correct_generation_start(step)
        if resumed and self.summary.resumed_from is not None:
            self.summary.resumed_from = step

    def on_step(self, record: StepRecord) -> None:
        line = self.metrics_log.append_step(record)
        first = self.summary.newest_step == 0       # this invocation's first step (a replacement's summary has some)
        if self.summary.on_step(record) is not None:
            self._tell_ledger()            # a recovery's time is known: the run's parts moved
        if self._feed is not None:
            if first:
                self._feed.put(FeedKind.START, self._start_info(record))
            self._feed.put(FeedKind.STEP, dict(line))
            self._announce_kept(record.step if self._kept_through is None else self._kept_through(record.step))
        for listener in self._listeners:
            _tell(listener, listener.on_step, record)
        if self._clock() - self._ledger_told_at >= LEDGER_EVERY_S:
            self._tell_ledger()

    def _start_info(self, first: StepRecord) -> dict[str, Any]:
        """What a callback's `on_start` gets: enough to go on with the same tracker run on a resume."""
        return {"run_id": self._run_id, "storage": self._storage.display_url, "config": self.summary.config,
                "resumed_from": self.summary.resumed_from, "total_steps": self.summary.total_steps,
                "step": first.step, "world_size": first.world_size}

    def on_log(self, record: StepRecord) -> None:
        """`ctx.log(...)` values at `record.step`: a line of their own, counting no step."""
        line = self.metrics_log.append_log(record)
        if self._feed is not None:
            self._feed.put(FeedKind.LOG, dict(line))

    def rollback_to(self, step: int) -> None:
        """The steps after `step` were lost: their attempts leave the record."""
        self.metrics_log.rollback_to(step)
        self.summary.rollback_to(step)

    def on_final_data(self, samples_consumed: int, data_order: str | None) -> None:
        """The run finished (rank 0's data): a recovery still open ends here."""
        self.summary.on_final_data(samples_consumed, data_order)
        self.summary.settle()

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        """A closed recovery (its `time_ledger` is added to it at the re-formed group's first step)."""
        self.summary.on_recovery(recovery)
        if self._feed is not None:
            self._feed.put(FeedKind.RECOVERY, dict(recovery))
        for listener in self._listeners:
            _tell(listener, listener.on_recovery, recovery)

    def _tell_ledger(self, parts: dict[str, float] | None = None) -> None:
        self._ledger_told_at = self._clock()
        parts = self.summary.time_ledger if parts is None else parts
        for listener in self._listeners:
            # Optional: a listener written before the ledger existed has no such hook.
            hook = getattr(listener, "on_time_ledger", None)
            if hook is not None:
                _tell(listener, hook, parts)

    def on_commits(self, steps: list[int]) -> None:
        """The committed steps as listed now: the feed announces those newer than any before.
        (Listed every few seconds: a commit that `keep` already removed again is not announced.)"""
        with self._commits_lock:
            new = sorted(step for step in steps if step > self._newest_commit)
            if new:
                self._newest_commit = new[-1]
        if len(steps) >= 2:
            # A recovery restores the newest commit, or one before it (a corrupt newest one, or a
            # silent corruption older than it): the steps before the second newest stay.
            self.summary.forget_through(sorted(steps)[-2])
        if self._feed is not None:
            for step in new:
                self._feed.put(FeedKind.CHECKPOINT, {"step": step, "url": checkpoint_url(self._url, step)})
            if new:
                self._announce_kept(new[-1])

    def _announce_kept(self, step: int) -> None:
        """The feed's KEPT event, when the kept step moved on (it never moves back: see
        RunSpec.kept_through for the recoveries that go further back)."""
        with self._kept_lock:
            if self._feed is None or step <= self._kept:
                return
            self._kept = step
            self._feed.put(FeedKind.KEPT, {"step": step})

    def on_straggler(self, flag: dict[str, Any]) -> None:
        self.summary.on_straggler(flag)

    def on_checkpoint_fallback(self, fallback: dict[str, Any]) -> None:
        """A committed checkpoint failed verification on load and an older one was used."""
        self.summary.on_checkpoint_fallback(fallback)

    def user_metrics(self) -> dict[str, Any]:
        """Result.metrics (see MetricsLog.user_metrics)."""
        return self.metrics_log.user_metrics()

    # ---- a controller's replacement -------------------------------------------------------
    def journal_state(self) -> RecordState:
        """The record's part of the controller's journal (elastic._controller.journal)."""
        with self._commits_lock:
            newest_commit = self._newest_commit
        return RecordState(summary=self.summary, metrics_step=self.metrics_log.newest_step,
                           pending_lines=self.metrics_log.pending(), newest_commit=newest_commit,
                           feed_next=self._feed.next if self._feed is not None else 1)

    def restore_journal(self, state: RecordState) -> None:
        """Continue a lost controller's record from its journal: its summary, its metrics lines up
        to the step the summary had taken (those it had not written yet, too; the lines after it
        on storage go: the workers' records of those steps are replayed), its commits announced,
        and its feed's numbering."""
        self.summary = state.summary
        self._scheduling = False
        with self._commits_lock:
            self._newest_commit = max(self._newest_commit, state.newest_commit)
        self.metrics_log.continue_from(state.metrics_step, state.pending_lines)
        if self._feed is not None:
            self._feed.continue_after(state.feed_next)

    # ---- files -------------------------------------------------------------------------
    def controller_is(self, pid: int, node: str, since: float) -> None:
        """The process that controls the run (status.json names it, with its restarts so far)."""
        self._controller = {"pid": pid, "node": node, "since": round(since, 3)}

    def on_controller_restart(self, record: dict[str, Any]) -> None:
        """This controller replaced a lost one (adoption.restart_record; summary.json lists them)."""
        self.summary.on_controller_restart(record)

    def write_status(self, *, force: bool = False, **status: Any) -> None:
        """status.json's newest fields (see StatusWriter.update: throttled unless `force`)."""
        if self._run_id is not None:
            status.setdefault("run_id", self._run_id)
        if self._controller is not None:
            status.setdefault("controller", {**self._controller,
                                             "restarts": len(self.summary.controller_restarts)})
        if self._scheduling and status.get("state", "scheduling") != "scheduling":
            self._scheduling = False
            self.summary.on_placed()
        self.status_writer.update(force=force, **status)

    def flush_metrics(self) -> None:
        """Append the new metrics lines now, on the caller's thread (see MetricsLog.flush)."""
        if self._writes():
            self.metrics_log.flush()

    def _writes(self) -> bool:
        """Whether this run writes its files now: not once another run took its storage over, nor
        while its lease is unconfirmed (storage stalled past the renewals' deadline); the metrics
        lines wait in memory meanwhile and are written when the lease is confirmed again."""
        holds = self._holds_storage is None or self._holds_storage()
        if holds == self._let_go:
            self._let_go = not holds
            if holds:
                log.warning("the lease on %s is confirmed again: status.json and metrics.jsonl are written again",
                            self._storage.display_url)
            else:
                log.warning("this run does not hold the lease on %s now (another run took the storage over, or "
                            "no renewal went through in time): no status.json, metrics.jsonl or summary.json is "
                            "written there meanwhile", self._storage.display_url)
        return holds

    def close(self) -> None:
        """Stop the writer thread and write the newest status and lines; later writes are inline."""
        self.status_writer.close()

    def write_summary(self, *, status: str, final_step: int, checkpoints: list[int],
                      model_sha256: str | None, error: dict[str, Any] | None) -> dict[str, Any]:
        summary = self.summary.build(status=status, final_step=final_step, checkpoints=checkpoints,
                                     model_sha256=model_sha256, error=error,
                                     metrics=self.user_metrics()["last"])
        self._tell_ledger(summary["time_ledger"])
        # The last metrics lines go first (a reader that sees summary.json finds them all), but
        # only best effort: a storage that fails them (full disk, lost credentials) must not
        # cost the run its summary, nor make the controller raise instead of returning it.
        try:
            self.close()
            self.flush_metrics()
            if self._writes():
                self.metrics_log.compact()
        except Exception:
            log.exception("could not write the last metrics.jsonl lines under %s; summary.json is written anyway",
                          self._storage.display_url)
        self._write_json("summary.json", summary)
        return strict(summary)      # as on storage

    def _write_status_file(self, status: dict[str, Any]) -> None:
        self._write_json("status.json", status_doc(**status))

    def _write_json(self, name: str, payload: dict[str, Any]) -> None:
        if not self._writes():
            return
        try:
            self._storage.write_atomic(self._storage.path(name), dumps(payload, indent=1).encode())
        except Exception:   # a status write must not kill the run; the next one retries
            log.exception("could not write %s under %s", name, self._storage.display_url)


def _tell(listener: RunListener, event: Callable[[Any], None], payload: Any) -> None:
    try:
        event(payload)
    except Exception:   # a listener (metrics export) must not break the record
        log.exception("run listener %s failed in %s", type(listener).__name__, event.__name__)


def checkpoint_url(storage_url: str, step: int) -> str:
    """The URL of the checkpoint of `step` under the run's storage (see checkpointing's layout)."""
    return f"{storage_url.rstrip('/')}/checkpoints/step_{step:08d}"

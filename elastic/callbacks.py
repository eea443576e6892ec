"""Driver-side callbacks: hooks the user's code gets in the driver as the run goes.

`ElasticTrainer(..., callbacks=[...])` calls, in the driver's process and in the order the
controller recorded things (a log line comes after its step's line, maybe after later steps'):

- `on_step(step_info)`: once per metrics.jsonl step line, with that line as a dict (`step`,
  `loss`, `world_size`, `time`, `lr`, `global_batch`, `accum_steps`, `samples_seen`,
  `compute_s` and every metric the loop reported, rank mean). A non-finite value is a float
  here (the file has `null`). A step lost in a failure is redone and comes again after the
  recovery that lost it (`on_recovery`'s `step` is the step training went on from): the
  recovery takes the steps after its `step` back. A callback with `kept_steps_only = True` (the
  MLflow and W&B ones: a tracker that cannot take a point back) gets a step only once no
  recovery can take it back, so each step once (see Callback).
- `on_log(log_info)`: once per `ctx.log(...)` line: `{"step", "kind": "log", "time", <metrics>}`.
- `on_recovery(recovery)`: a recovery as summary.json lists it (`cause`, `rung`, `detect_s`,
  `recover_s`, `lost_steps`, `from_world`, `to_world`, `step`, ...), when the re-formed group
  completes its first step, before that step's `on_step`.
- `on_checkpoint(commit)`: `{"step", "url"}` of a checkpoint committed during the run. Commits
  are listed every couple of seconds: with `CheckpointConfig.keep` and commits more frequent
  than that, one already removed again may go unannounced.
- `on_end(result)`: the `Result`, once, after the run ended (finished or failed).

The events travel from the controller's actor in order, numbered, each delivered once (see
elastic._controller.feed); they reach the driver about once a second. A callback that raises does not stop
the run: its first error is logged with the traceback, later ones are counted and summed up at
the end.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from elastic._controller.feed import Event, FeedKind
from elastic.errors import ConfigError

if TYPE_CHECKING:
    from elastic.result import Result

log = logging.getLogger("elastic.callbacks")

LOG_KEYS_KEPT = 1024     # log lines remembered for the events a replacing controller sends again

HOOKS = ("on_start", "on_step", "on_log", "on_recovery", "on_checkpoint", "on_end")
_HOOK_OF = {FeedKind.START: "on_start", FeedKind.STEP: "on_step", FeedKind.LOG: "on_log",
            FeedKind.RECOVERY: "on_recovery", FeedKind.CHECKPOINT: "on_checkpoint"}


class Callback:
    """Base class of driver-side callbacks: override the hooks you need (the others do nothing).

    `kept_steps_only`: False (the default), `on_step` and `on_log` come as soon as the step
    completed, and a recovery that goes back takes the steps after its `step` back: they come again,
    redone, after `on_recovery`. True, for a tracker that cannot take a point back (MLflow,
    W&B): they come once no recovery can take their step back (elastic._protocol.RunSpec.kept_through:
    a few steps later with copies in memory, at the next checkpoint under FSDP without them), each
    step once, in step order; `on_recovery` may then come before the kept steps from before it."""

    kept_steps_only: bool = False

    def on_start(self, start_info: dict[str, Any]) -> None:
        """The run trains, before its first step of this invocation is delivered, once per
        `fit()`: {"run_id", "storage", "config" (the effective configuration, secrets masked),
        "resumed_from" (the step a resume restored, or None), "total_steps", "step" (the first
        step), "world_size"}. A tracker resumes its run of the same storage from here."""

    def on_step(self, step_info: dict[str, Any]) -> None:
        """A step completed: its metrics.jsonl line."""

    def on_log(self, log_info: dict[str, Any]) -> None:
        """`ctx.log(...)` values: their metrics.jsonl line."""

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        """A recovery completed (the re-formed group made its first step)."""

    def on_checkpoint(self, commit: dict[str, Any]) -> None:
        """A checkpoint was committed: {"step", "url"}."""

    def on_end(self, result: Result) -> None:
        """The run ended; `result` is what `fit()` returns."""


def check_callbacks(callbacks: Any) -> tuple[Any, ...]:
    """`callbacks` as a tuple, or a ConfigError that says what is wrong."""
    if callbacks is None:
        return ()
    if isinstance(callbacks, (str, bytes, Callback)) or not isinstance(callbacks, Iterable):
        raise ConfigError(f"callbacks must be a list of elastic.Callback objects, got {type(callbacks).__name__}")
    callbacks = tuple(callbacks)
    for index, callback in enumerate(callbacks):
        if isinstance(callback, type) or not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            raise ConfigError(f"callbacks[{index}] ({callback!r}) has none of the hooks {', '.join(HOOKS)}; "
                              f"pass an instance of a subclass of elastic.Callback")
    return callbacks


class CallbackRunner:
    """The driver's end of the feed: fetches the events after the last one delivered and calls
    the hooks; a raising hook is logged, never raised. The steps and log lines of the callbacks
    with `kept_steps_only` wait here until the feed says their step is kept (FeedKind.KEPT)."""

    def __init__(self, callbacks: Iterable[Any]):
        self._callbacks = tuple(callbacks)
        self._holding = tuple(bool(getattr(callback, "kept_steps_only", False)) for callback in self._callbacks)
        self._delivered = 0                       # number of the newest event delivered
        self._errors: dict[int, int] = {}         # callback index -> errors raised
        # What was delivered, for the events a replacing controller sends again (its feed replays
        # the steps after its journal: elastic._controller.feed.RESTART_GAP).
        self._step = 0                            # the newest step delivered (a recovery: the step it restored)
        self._logs: dict[tuple, None] = {}        # (step, line keys) of the log lines delivered since
        self._commit = 0                          # the newest commit delivered
        self._recoveries: set[Any] = set()        # the recoveries delivered (by detection time)
        self._started = False                     # on_start delivered (once per fit())
        # The kept-steps-only callbacks' side: (hook, line) not kept yet, in arrival order.
        self._held: list[tuple[str, dict[str, Any]]] = []
        self._kept = 0                            # the newest kept step the feed announced
        self._released = 0                        # the newest step line they were given

    @property
    def delivered(self) -> int:
        return self._delivered

    def poll(self, fetch: Callable[[int], list[Event]]) -> int:
        """Deliver what `fetch(after)` returns after the last delivered event; returns how many
        new events it took (delivered, or skipped as told already)."""
        count = 0
        for number, kind, payload in fetch(self._delivered):
            if number <= self._delivered:
                continue           # delivered already (an answer that crossed a retry)
            self._delivered = number
            count += 1
            kind = FeedKind(kind)
            if kind == FeedKind.KEPT:
                self._release(int(payload["step"]))
            elif not self._repeated(kind, payload):
                self._deliver(kind, payload)
        return count

    def _deliver(self, kind: FeedKind, payload: dict[str, Any]) -> None:
        hook = _HOOK_OF[kind]
        if kind not in (FeedKind.STEP, FeedKind.LOG):
            if kind == FeedKind.RECOVERY:        # the lines it takes back are never given to the holding ones
                step = payload.get("step", 0)
                self._held = [(name, line) for name, line in self._held if line.get("step", 0) <= step]
            self._call(hook, payload)
            return
        self._call(hook, payload, holding=False)
        step = payload.get("step", 0)
        if kind == FeedKind.STEP and step <= self._released:
            return     # redone after a storage fallback: the tracker keeps the first attempt (never twice)
        if step <= self._kept:
            self._call(hook, payload, holding=True)     # a log line of a kept step, come late
        else:
            self._held.append((hook, payload))

    def _release(self, kept: int) -> None:
        """Give the held lines of the steps up to `kept` to the kept-steps-only callbacks, in step order."""
        self._kept = max(self._kept, kept)
        ready = sorted((entry for entry in self._held if entry[1].get("step", 0) <= self._kept),
                       key=lambda entry: entry[1].get("step", 0))
        if not ready:
            return
        self._held = [entry for entry in self._held if entry[1].get("step", 0) > self._kept]
        for hook, line in ready:
            if hook == "on_step":
                self._released = max(self._released, line.get("step", 0))
            self._call(hook, line, holding=True)

    def _repeated(self, kind: FeedKind, payload: dict[str, Any]) -> bool:
        """Whether the event tells what was delivered already (a replacing controller's replay):
        a step at or before the newest one (a recovery's redone steps come after it, and it moves
        the newest back to the step it restored), a log line of a step and keys delivered since,
        a commit or a recovery delivered, the start once delivered."""
        step = payload.get("step", 0)
        if kind == FeedKind.START:
            if self._started:
                return True     # a run rolled back to its start tells it again
            self._started = True
        elif kind == FeedKind.STEP:
            if step <= self._step:
                return True
            self._step = step
        elif kind == FeedKind.LOG:
            key = (step, tuple(sorted(payload)))
            if key in self._logs:
                return True
            self._logs[key] = None
            while len(self._logs) > LOG_KEYS_KEPT:
                del self._logs[next(iter(self._logs))]
        elif kind == FeedKind.CHECKPOINT:
            if step <= self._commit:
                return True
            self._commit = step
        elif kind == FeedKind.RECOVERY:
            detected = payload.get("detected_at")
            if detected is not None and detected in self._recoveries:
                return True
            self._recoveries.add(detected)
            self._step = min(self._step, step)
            self._logs = {key: None for key in self._logs if key[0] <= step}
        return False

    def drain(self, fetch: Callable[[int], list[Event]]) -> None:
        """Deliver every event left (the run has ended: no new ones come)."""
        while self.poll(fetch):
            pass

    def end(self, result: Result) -> None:
        """The run ended. Finished or stopped, nothing takes a held step back: they are given. A
        failed run's held steps are not: its resume redoes them from its newest checkpoint."""
        if self._held and result.ok:
            self._release(max(line.get("step", 0) for _, line in self._held))
        self._held = []
        self._call("on_end", result)
        for index, errors in self._errors.items():
            if errors > 1:
                log.warning("callback %r raised %d times in this run (the first is logged above)",
                            self._callbacks[index], errors)

    def _call(self, hook: str, argument: Any, *, holding: bool | None = None) -> None:
        """Call `hook` of every callback, or of those that do (`holding` True) or do not hold
        their lines for kept steps."""
        for index, callback in enumerate(self._callbacks):
            if holding is not None and self._holding[index] != holding:
                continue
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(argument)
            except Exception:   # a user's callback must not end the run
                self._errors[index] = self._errors.get(index, 0) + 1
                if self._errors[index] == 1:
                    log.exception("callback %r raised in %s; the run goes on (later errors of this "
                                  "callback are only counted)", callback, hook)


class TensorBoardCallback(Callback):
    """Writes the run's metrics as TensorBoard scalars under `log_dir` (in the driver).

    Every metric of a step line and of a `ctx.log` line is a scalar under its own name at its
    step (loss, lr, the loop's metrics); the framework's counts go under `elastic/`
    (world_size, global_batch, accum_steps, samples_seen), and each recovery as
    `elastic/recovery_s` and `elastic/lost_steps` at the step training went on from, with a text
    line under `elastic/recoveries`. A recovery also writes TensorBoard's restart marker (the one
    `SummaryWriter(purge_step=...)` writes) at the step after it: TensorBoard hides the points the
    lost attempts left past it, and the redone steps take their place.

    Needs the `tensorboard` package: `pip install elastic-train[tensorboard]`.
    """

    FRAMEWORK = ("world_size", "global_batch", "accum_steps", "samples_seen")
    NOT_SCALARS = ("step", "time", "compute_s", "kind")

    def __init__(self, log_dir: str, *, flush_secs: int = 10):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ConfigError("TensorBoardCallback needs the tensorboard package: "
                              "pip install elastic-train[tensorboard]") from error
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)

    def on_step(self, step_info: dict[str, Any]) -> None:
        self._scalars(step_info)

    def on_log(self, log_info: dict[str, Any]) -> None:
        self._scalars(log_info)

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        step = int(recovery.get("step") or 0)
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        self._writer._get_file_writer().add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
        for name in ("recover_s", "lost_steps"):
            value = recovery.get(name)
            if isinstance(value, (int, float)):
                tag = "elastic/recovery_s" if name == "recover_s" else "elastic/lost_steps"
                self._writer.add_scalar(tag, value, step)
        self._writer.add_text("elastic/recoveries", (
            f"{recovery.get('cause')} ({recovery.get('rung')}): world {recovery.get('from_world')} -> "
            f"{recovery.get('to_world')}, {recovery.get('lost_steps')} steps lost, "
            f"recovered in {recovery.get('recover_s')} s"), step)

    def on_end(self, result: Result) -> None:
        self.close()

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()

    def _scalars(self, line: dict[str, Any]) -> None:
        step, walltime = int(line["step"]), line.get("time")
        for name, value in line.items():
            if name in self.NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            tag = f"elastic/{name}" if name in self.FRAMEWORK and line.get("kind") is None else name
            self._writer.add_scalar(tag, float(value), step,
                                    walltime=walltime if isinstance(walltime, float) and math.isfinite(walltime)
                                    else None)

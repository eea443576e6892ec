"""The run's time ledger: every second of the run's wall time in exactly one part.

One role: a pure accounting of where the wall time went (summary.json `time_ledger`, and each
recovery's own `time_ledger`). No Ray, no storage, no clock of its own: the run summary
(elastic._controller.run_summary) feeds it the run's events with their times, in the
controller's wall-clock seconds, the clock the step records carry too.

How it accounts: a cursor walks from the run's start to its end, and each event hands the
seconds between the cursor and itself to one part (or splits them), then moves the cursor. An
event that comes with a time before the cursor hands over nothing, so the parts always sum to
the wall time, whatever the order of events or the skew between clocks.

- waiting: the run's start to the first state after SCHEDULING (workers placed and ready).
- startup: from there to the first step of the run (fence, resume plan, group, restore, step 1).
- productive: a kept step's seconds (from the previous step's end), less its checkpoint stall.
- checkpoint_stall: the seconds a rank's report() was blocked saving the previous step's
  checkpoint (the step's record carries them), and the tail after the last step of a run that
  ended with its final commit (finished or stopped).
- redone: the seconds of steps computed and later rolled back (a recovery restored an older
  step), and of the step in flight when a failure struck (its end to the failure). A
  preemption notice loses no step: from the last step to the controller hearing that the
  group left (a commit, if the group made one, and leaving the loop) is re-form.
- detection: the failure to its detection (the recovery's `detect_s`).
- restore: of a recovery, the seconds the re-formed group's rank spent in ctx.restore (the
  first record of a generation carries them: a warm broadcast or a checkpoint load).
- reform: the rest of a recovery, from detection to the re-formed group's first step: the
  survivors leaving the broken group, a replacement's start, the fence, the new group and its
  wrappers, and the first step's excess over an ordinary step (the first step itself, up to the
  smoothed duration of the steps before, is productive). Whatever of a recovery the workers'
  own durations do not explain is re-form. A run that failed ends in re-form too.

The restore seconds are one rank's (whichever rank's record of the first step the controller
kept, rank 0's as a rule): the restore is a collective in which the ranks wait for each other,
so one rank's time is the group's. A recovery's parts (detection, reform, restore, redone) are
the run's seconds it cost; they are added to the run's parts, not counted twice.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class LedgerPart(enum.StrEnum):
    """The parts of a run's wall time (summary.json `time_ledger` keys)."""

    PRODUCTIVE = "productive"
    REDONE = "redone"
    DETECTION = "detection"
    REFORM = "reform"
    RESTORE = "restore"
    CHECKPOINT_STALL = "checkpoint_stall"
    STARTUP = "startup"
    WAITING = "waiting"


# The parts a recovery's own ledger has (summary.json `recoveries[].time_ledger`).
RECOVERY_PARTS = (LedgerPart.DETECTION, LedgerPart.REFORM, LedgerPart.RESTORE, LedgerPart.REDONE)

# How a run ended, as far as its tail (after its last step) goes.
_FINAL_COMMIT_STATUSES = frozenset({"finished", "stopped", "stopped_early"})

_SMOOTHING = 0.2          # weight of a new step in the smoothed step time


@dataclass
class _PendingRecovery:
    """A recovery the controller closed, waiting for the re-formed group's first step."""

    detected_at: float      # wall clock
    detect_s: float
    redone: float           # seconds of steps it rolled back so far
    in_flight_kept: bool    # the group left at a step boundary (a preemption notice): nothing was in flight


@dataclass(frozen=True)
class _KeptStep:
    """What a kept step put into the ledger: moved to `redone` if it is rolled back."""

    productive: float
    stall: float


class TimeLedger:
    """Seconds per part of the run's wall time, from the run's events (see the module)."""

    def __init__(self, started_at: float):
        self._parts = dict.fromkeys(LedgerPart, 0.0)
        self._cursor = started_at               # everything before it is accounted
        self._placed = False                    # the wait for workers is over
        self._stepped = False                   # the run completed a step
        self._generation_at: float | None = None   # the newest generation's start, until its first step
        self._step_s: float | None = None       # smoothed seconds of an ordinary step
        self._kept: dict[int, _KeptStep] = {}   # step -> its seconds, while it may be rolled back
        self._pending: _PendingRecovery | None = None
        self._redone_open = 0.0                 # rolled back since the last recovery closed
        self._newest = 0                        # the newest step taken

    # ---- events ----------------------------------------------------------------------
    def placed(self, at: float) -> None:
        """The controller left SCHEDULING: what came before was waiting for workers."""
        if not self._placed:
            self._placed = True
            self._advance(at, LedgerPart.WAITING)

    def generation_started(self, at: float) -> None:
        """The controller handed a generation its plans (before its members join the group)."""
        self._generation_at = at

    def recovery_closed(self, detected_at: float, detect_s: float, *, in_flight_kept: bool = False) -> None:
        """A recovery closed: the re-formed group's first step comes next (or the run ends).
        Its seconds are counted when that step comes (`step`), or at the end (`close`).
        `in_flight_kept`: the group left at a step boundary and kept its steps (a preemption
        notice), so the time from its last step to the detection is re-form, not redone."""
        if self._pending is not None:          # closed twice with no step between: the first ends here
            self._resolve(detected_at, restore_s=0.0)
        self._pending = _PendingRecovery(detected_at, max(0.0, detect_s), self._redone_open, in_flight_kept)
        self._redone_open = 0.0

    def step(self, step: int, end: float, *, stall_s: float = 0.0,
             restore_s: float = 0.0) -> dict[str, float] | None:
        """A kept step ended at `end` (`stall_s`: seconds its rank was blocked in a checkpoint
        save since its previous step; `restore_s`: on a generation's first step, its rank's
        seconds in ctx.restore). Returns the parts of the recovery this step ended, if any."""
        if step <= self._newest:
            self.rollback_to(step - 1)        # a step redone: the attempts from it on were lost
        self._newest = step
        parts = None
        if self._pending is not None:
            parts = self._resolve(end, restore_s=restore_s, step=step)
        elif not self._stepped:
            self._advance(end, LedgerPart.STARTUP)
        elif self._generation_at is not None:
            # A new generation with no recovery open (none is known to have cost anything).
            self._first_step(step, end, restore_s)
        else:
            seconds = self._advance(end, LedgerPart.PRODUCTIVE)
            stall = min(max(0.0, stall_s), seconds)
            self._move(LedgerPart.PRODUCTIVE, LedgerPart.CHECKPOINT_STALL, stall)
            self._kept[step] = _KeptStep(seconds - stall, stall)
            ordinary = seconds - stall
            self._step_s = ordinary if self._step_s is None else \
                (1 - _SMOOTHING) * self._step_s + _SMOOTHING * ordinary
        self._generation_at = None
        self._stepped = True
        return parts

    def rollback_to(self, step: int) -> None:
        """The steps after `step` were lost: their seconds are redone."""
        self._newest = min(self._newest, step)
        for lost in [s for s in self._kept if s > step]:
            kept = self._kept.pop(lost)
            self._move(LedgerPart.PRODUCTIVE, LedgerPart.REDONE, kept.productive)
            self._move(LedgerPart.CHECKPOINT_STALL, LedgerPart.REDONE, kept.stall)
            if self._pending is not None:
                self._pending.redone += kept.productive + kept.stall
            else:
                self._redone_open += kept.productive + kept.stall

    def forget_through(self, step: int) -> None:
        """The steps up to `step` can no longer be lost: their seconds stay productive for good and
        need no entry (the ledger is pickled into the controller's journal every second, so what
        it keeps must not grow with the run)."""
        for kept in [s for s in self._kept if s <= step]:
            del self._kept[kept]

    def settle(self, at: float) -> dict[str, float] | None:
        """The run ended (or finished within a recovery): a recovery still waiting for its first
        step ends at `at`. Returns its parts, if one was waiting."""
        if self._pending is None:
            return None
        return self._resolve(at, restore_s=0.0)

    def close(self, at: float, status: str) -> dict[str, float]:
        """The run ended at `at` with `status` (summary.json's): the tail after the last event
        is accounted and the parts returned (seconds, rounded to ms)."""
        self.settle(at)
        if not self._placed:
            tail = LedgerPart.WAITING
        elif not self._stepped:
            tail = LedgerPart.STARTUP
        elif status in _FINAL_COMMIT_STATUSES:
            tail = LedgerPart.CHECKPOINT_STALL     # the final commit and the model's hash
        else:
            tail = LedgerPart.REFORM               # a run that failed: in a recovery that never ended
        self._advance(at, tail)
        return self.parts()

    def parts(self) -> dict[str, float]:
        """The seconds accounted so far, per part (rounded to ms)."""
        return {part.value: round(seconds, 3) for part, seconds in self._parts.items()}

    # ---- accounting ------------------------------------------------------------------
    def _advance(self, to: float, part: LedgerPart) -> float:
        """Hand the seconds from the cursor to `to` to `part`; returns them."""
        seconds = max(0.0, to - self._cursor)
        self._parts[part] += seconds
        self._cursor = max(self._cursor, to)
        return seconds

    def _move(self, source: LedgerPart, target: LedgerPart, seconds: float) -> None:
        seconds = min(seconds, self._parts[source])
        self._parts[source] -= seconds
        self._parts[target] += seconds

    def _first_step(self, step: int, end: float, restore_s: float) -> dict[str, float]:
        """A generation's first step, from the cursor (the previous generation's last step or
        the failure's detection) to `end`: restore, one ordinary step, the rest re-form."""
        generation_at = self._generation_at if self._generation_at is not None else self._cursor
        span = max(0.0, end - max(self._cursor, generation_at))
        restore = min(max(0.0, restore_s), span)
        productive = min(self._step_s or 0.0, span - restore)
        reform = max(0.0, end - self._cursor) - restore - productive
        self._advance(end, LedgerPart.REFORM)
        self._move(LedgerPart.REFORM, LedgerPart.RESTORE, restore)
        self._move(LedgerPart.REFORM, LedgerPart.PRODUCTIVE, productive)
        self._kept[step] = _KeptStep(productive, 0.0)
        return {LedgerPart.REFORM.value: reform, LedgerPart.RESTORE.value: restore}

    def _resolve(self, end: float, *, restore_s: float, step: int | None = None) -> dict[str, float]:
        """The pending recovery ends at `end`: from the cursor (the last step before it) the
        step in flight is redone up to the failure, then detection, then (with the re-formed
        group's first step `step`, if it came) restore, the step itself and re-form."""
        pending = self._pending
        assert pending is not None
        self._pending = None
        failed_at = min(max(pending.detected_at - pending.detect_s, self._cursor), end)
        detected_at = min(max(pending.detected_at, failed_at), end)
        # Before the run's first step, the step in flight is still start-up.
        in_flight_part = LedgerPart.STARTUP if not self._stepped else \
            LedgerPart.REFORM if pending.in_flight_kept else LedgerPart.REDONE
        in_flight = self._advance(failed_at, in_flight_part)
        detection = self._advance(detected_at, LedgerPart.DETECTION)
        if step is not None:
            split = self._first_step(step, end, restore_s)
            reform, restore = split[LedgerPart.REFORM.value], split[LedgerPart.RESTORE.value]
        else:
            reform, restore = self._advance(end, LedgerPart.REFORM), 0.0
        if in_flight_part == LedgerPart.REFORM:
            reform += in_flight
        redone = pending.redone + (in_flight if in_flight_part == LedgerPart.REDONE else 0.0)
        return {LedgerPart.DETECTION.value: round(detection, 3), LedgerPart.REFORM.value: round(reform, 3),
                LedgerPart.RESTORE.value: round(restore, 3), LedgerPart.REDONE.value: round(redone, 3)}

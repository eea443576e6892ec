"""The controller's two ledgers: which steps the run keeps, and the recovery that is open.

Both are plain objects the controller composes (no Ray, no storage): the `StepLedger` decides
which step records count (a step recorded by a generation that a later one rolled back does
not) and smooths the step time; the `RecoveryLedger` owns the open recovery, from the failure
or resize that opens it, through the failures it absorbs meanwhile, to the re-formed group's
first step that closes it into a summary.json entry.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic._protocol import RestoreKind, StepRecord
from elastic.policies import Cause


class Rung(enum.StrEnum):
    """The rung of the recovery ladder a recovery took (summary.json `rung`)."""

    WARM = "warm"              # survivors kept their state; one broadcast it
    MEMORY = "memory"          # FSDP: shards rebuilt from the copies in the members' host memory
    CHECKPOINT = "checkpoint"  # every rank loaded the last committed checkpoint
    COLD = "cold"              # survivors that could not leave were killed and replaced, then a load


@dataclass
class OpenRecovery:
    """A recovery in progress, closed when the re-formed group completes its first step."""

    cause: Cause
    detected_at: float         # controller clock
    detect_s: float            # failure to detection
    from_world: int
    max_step: int              # newest step any member had reached: what is lost is counted from it
    rung: Rung = Rung.WARM
    reason: str = ""           # why this rung (e.g. why not from memory)
    to_world: int = 0
    restored_step: int = 0
    failures: list[dict] = field(default_factory=list)   # every failure it absorbed: {cause, ranks, detected_at}


class RecoveryLedger:
    """Owns the open recovery (at most one)."""

    def __init__(self, clock: Callable[[], float], wall_clock: Callable[[], float]):
        self._clock, self._wall_clock = clock, wall_clock
        self.open: OpenRecovery | None = None

    @property
    def current(self) -> OpenRecovery:
        """The recovery being carried out (the controller's RECOVERING state always has one)."""
        assert self.open is not None, "recovering without an open recovery"
        return self.open

    def begin(self, cause: Cause, from_world: int, max_step: int, detect_s: float = 0.0,
              failed_ranks: list[int] | None = None, why: str = "", step: int | None = None) -> OpenRecovery:
        """A failure (with its ranks) or a resize (without): opens a recovery, or is absorbed
        by the open one (the re-formed group has not completed a step yet)."""
        if self.open is None:
            self.open = OpenRecovery(cause, self._clock(), round(detect_s, 3), from_world, max_step)
        self.open.max_step = max(self.open.max_step, max_step)
        if failed_ranks is not None:
            self.note(cause, failed_ranks, why, step=step)
        return self.open

    def note(self, cause: Cause, ranks: list[int], why: str = "", step: int | None = None) -> None:
        """A further failure while the recovery is open (a survivor lost meanwhile); `why`: how
        it was found (e.g. which hang rule fired), when known; `step`: the step it names (a
        silent corruption's, whose fingerprints disagreed)."""
        if self.open is not None:
            entry: dict[str, Any] = {"cause": cause, "ranks": ranks, "detected_at": round(self.wall(self._clock()), 3)}
            if why:
                entry["why"] = why
            if step is not None:
                entry["step"] = step
            self.open.failures.append(entry)

    def reached(self, step: int) -> None:
        """A member of the broken group had reached `step`: the lost steps are counted from the newest."""
        self.current.max_step = max(self.current.max_step, step)

    def escalate_cold(self) -> None:
        """A survivor could not leave the broken group and is replaced: whatever the restore, the
        recovery is cold."""
        self.current.rung = Rung.COLD

    def planned(self, kind: RestoreKind, reason: str) -> None:
        """The re-form's restore is chosen: its rung (unless already cold) and why."""
        recovery = self.current
        if recovery.rung != Rung.COLD:
            recovery.rung = {RestoreKind.BROADCAST: Rung.WARM, RestoreKind.MEMORY: Rung.MEMORY}.get(
                kind, Rung.CHECKPOINT)
        recovery.reason = reason

    def formed(self, world: int, step: int) -> None:
        """The re-formed generation started at this size from this step (as planned)."""
        if self.open is not None:
            self.open.to_world, self.open.restored_step = world, step

    def confirmed(self, step: int) -> None:
        """The re-formed generation's rank 0 reported the step it really restored."""
        if self.open is not None:
            self.open.restored_step = step

    def close(self, generation: int) -> dict[str, Any] | None:
        """The re-formed group completed its first step (or finished): the summary.json entry."""
        recovery, self.open = self.open, None
        if recovery is None:
            return None
        now = self._clock()
        return {"cause": recovery.cause, "rung": recovery.rung, "reason": recovery.reason,
                "detect_s": recovery.detect_s,
                "recover_s": round(now - recovery.detected_at, 3),
                "lost_steps": max(0, recovery.max_step - recovery.restored_step),
                "from_world": recovery.from_world, "to_world": recovery.to_world,
                "step": recovery.restored_step, "generation": generation,
                "detected_at": round(self.wall(recovery.detected_at), 3), "recovered_at": round(self.wall(now), 3),
                "failures": list(recovery.failures)}

    def wall(self, t: float) -> float:
        """Unix seconds of the controller clock's time `t`."""
        return self._wall_clock() - (self._clock() - t)


class StepLedger:
    """Which steps count: each is taken once, from whichever rank has it, unless a later
    generation restored an earlier step (its record was lost with the failure)."""

    def __init__(self) -> None:
        self.recorded_step = 0                   # newest step handed to the run record
        self.step_s = 0.0                        # smoothed seconds per step
        self._restored: dict[int, int] = {}      # generation -> the step it restored
        self._last_time: float | None = None

    def kept(self, record: StepRecord) -> bool:
        """False for a step that a later generation discarded (it restored an earlier step)."""
        return all(record.step <= step for generation, step in self._restored.items() if generation > record.generation)

    def is_new(self, record: StepRecord) -> bool:
        return record.step > self.recorded_step and self.kept(record)

    def resume(self, step: int) -> None:
        """The run continues a previous one from its checkpoint of `step`: the steps up to it are
        recorded (the previous run's)."""
        self.recorded_step = step

    def restore(self, generation: int, step: int) -> bool:
        """Generation `generation` starts from `step`. True when steps recorded past it must
        be rolled back."""
        self._restored[generation] = step
        if step < self.recorded_step:
            self.recorded_step = step
            return True
        return False

    def take(self, record: StepRecord, current_step: int) -> None:
        """A new step is kept: it is now the newest, and its duration feeds the step time."""
        if self._last_time is not None and record.step == current_step + 1:
            self.step_s = 0.8 * self.step_s + 0.2 * (record.time - self._last_time)
        self._last_time = record.time
        self.recorded_step = record.step

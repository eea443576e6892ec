"""The run's summary: what summary.json says of the run, accumulated from the run's events.

One role: a pure accumulator. It keeps the world size of each generation, the closed recoveries,
the stragglers flagged, the checkpoint fallbacks, the losses, the data consumed and the step a
resume started from, and builds summary.json's fields from them (with its `format`:
elastic.schemas). The time ledger (elastic._controller.time_ledger: seconds per part of the wall
time, for the run and for each recovery) is fed from the same events, on the same clock; the
goodput is its productive share of the wall time. It touches no storage and runs no thread: the
controller's thread feeds it through the run record (elastic._controller.run_record), which
writes what `build` returns.

The goodput was once the kept steps' durations over the wall time, each measured from the end
of the step before or from its generation's start: a re-formed group's first step then carried
its whole start (joining, the wrappers, the restore) as kept time, so a faster re-form barely
moved it (the mixed campaign: 0.882 and 0.885 before and after halving its re-form time, while
its productive share went from 0.81 to 0.84). The ledger counts of that first step only what an
ordinary step takes, and leaves checkpoint stalls out.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from elastic._controller.time_ledger import LedgerPart, TimeLedger
from elastic._protocol import StepRecord
from elastic.layout import Layout
from elastic.policies import Cause
from elastic.schemas import summary_doc

log = logging.getLogger("elastic.record")


class RunSummary:
    def __init__(self, *, total_steps: int, config: dict[str, Any], clock: Callable[[], float] = time.time):
        self._total_steps = total_steps
        self._config = config
        self._clock = clock                         # wall-clock seconds (step records carry the same)
        self._started_at = clock()
        self._world_size_history: list[list[int]] = []     # [start step, world size] per generation
        # Ranks per stage and stages per replica, for each generation's layout (summary.json's
        # layout_history).
        scaling = (config or {}).get("scaling") or {}
        self._tp = int(scaling.get("tensor_parallel_size", 1))
        self._pp = int(scaling.get("pipeline_parallel_size", 1))
        self._newest_step = 0                       # highest step kept
        # The first and newest losses only: the summary is pickled into the controller's journal
        # every second (elastic._controller.journal), so nothing in it grows with the steps.
        self._loss_first: float | None = None
        self._loss_last: float | None = None
        self._recoveries: list[dict[str, Any]] = []
        self._stragglers: list[dict[str, Any]] = []
        self._fallbacks: list[dict[str, Any]] = []
        self.controller_restarts: list[dict[str, Any]] = []   # adoption.restart_record, one per restart
        self._data: tuple[int, str | None] | None = None   # (samples_seen, data_order) after the newest step
        self.resumed_from: int | None = None        # the step the run resumed from (None: a fresh start)
        # The entries of the earlier invocations this one resumed (summary.json's `invocations`,
        # oldest first): a run killed, stopped and resumed keeps the history of each part.
        self.earlier: list[dict[str, Any]] = []
        self._ledger = TimeLedger(self._started_at)
        # The newest recovery, until the re-formed group's first step gives its time ledger.
        self._unsettled: dict[str, Any] | None = None

    @property
    def config(self) -> dict[str, Any]:
        """The run's effective configuration (summary.json's `config`)."""
        return self._config

    @property
    def total_steps(self) -> int:
        return self._total_steps

    @property
    def newest_step(self) -> int:
        """The highest step this invocation kept (0: none yet)."""
        return self._newest_step

    @property
    def last_loss(self) -> float | None:
        return self._loss_last

    @property
    def time_ledger(self) -> dict[str, float]:
        """Seconds per part of the wall time accounted so far (summary.json's when the run ends)."""
        return self._ledger.parts()

    def on_placed(self) -> None:
        """The controller left SCHEDULING: the wait for workers is over."""
        self._ledger.placed(self._clock())

    def on_generation_start(self, step: int, world_size: int) -> None:
        self._world_size_history.append([step, world_size])
        self._ledger.generation_started(self._clock())

    def correct_generation_start(self, step: int) -> None:
        """The generation really started from `step` (its restore fell back to an older one)."""
        if self._world_size_history:
            self._world_size_history[-1][0] = step

    def on_step(self, record: StepRecord) -> dict[str, Any] | None:
        """A kept step. Returns the recovery it ended, now with its time ledger, if any."""
        if record.step <= self._newest_step:          # a step redone: the attempts from it on were lost
            self.rollback_to(record.step - 1)
        # A worker's clock ahead of this one's must not push the ledger past the present.
        parts = self._ledger.step(record.step, min(record.time, self._clock()),
                                  stall_s=record.checkpoint_stall_s, restore_s=record.restore_s)
        self._newest_step = record.step
        self._data = (record.samples_seen, record.data_order)
        if record.loss is not None:
            self._loss_first = record.loss if self._loss_first is None else self._loss_first
            self._loss_last = record.loss
        return self._settled(parts)

    def rollback_to(self, step: int) -> None:
        """The steps after `step` were lost: the ledger moves their time from productive to redone."""
        self._newest_step = min(self._newest_step, step)
        self._ledger.rollback_to(step)

    def on_final_data(self, samples_consumed: int, data_order: str | None) -> None:
        """The finished run's data as rank 0 holds it (authoritative over step records)."""
        self._data = (samples_consumed, data_order)

    def on_recovery(self, recovery: dict[str, Any]) -> dict[str, Any] | None:
        """A closed recovery (ledgers.RecoveryLedger's entry). Its `time_ledger` is added when
        the re-formed group's first step comes (`on_step`), or when the run ends (`settle`).
        Returns the recovery before it if that one was still waiting (it ends now)."""
        previous = self.settle()
        self._recoveries.append(recovery)
        detected_at = recovery.get("detected_at")
        self._ledger.recovery_closed(self._clock() if detected_at is None else detected_at,
                                     recovery.get("detect_s") or 0.0,
                                     in_flight_kept=recovery.get("cause") == Cause.PREEMPTED)
        self._unsettled = recovery
        return previous

    def settle(self, at: float | None = None) -> dict[str, Any] | None:
        """No step will end the newest recovery (the run finished or ends): it ends now (`at`).
        Returns it, with its time ledger, if it was waiting."""
        return self._settled(self._ledger.settle(self._clock() if at is None else at))

    def _settled(self, parts: dict[str, float] | None) -> dict[str, Any] | None:
        recovery, self._unsettled = self._unsettled, (None if parts is not None else self._unsettled)
        if parts is None or recovery is None:
            return None
        recovery["time_ledger"] = parts
        return recovery

    def forget_through(self, step: int) -> None:
        """No recovery restores a step before `step` any more (an older commit is gone or a newer
        one stands): the ledger lets go of the steps up to it (see TimeLedger.forget_through)."""
        self._ledger.forget_through(step)

    def on_controller_restart(self, record: dict[str, Any]) -> None:
        """A controller replaced a lost one (adoption.restart_record)."""
        self.controller_restarts.append(record)

    def on_straggler(self, flag: dict[str, Any]) -> None:
        self._stragglers.append(flag)

    def on_checkpoint_fallback(self, fallback: dict[str, Any]) -> None:
        """A committed checkpoint failed verification on load and an older one was used (each
        rank reports it: kept once)."""
        if fallback not in self._fallbacks:
            log.warning("checkpoint fallback: %s", fallback)
            self._fallbacks.append(fallback)

    def build(self, *, status: str, final_step: int, checkpoints: list[int], model_sha256: str | None,
              error: dict[str, Any] | None, metrics: dict[str, Any]) -> dict[str, Any]:
        """summary.json's fields; `metrics` is the last value of each of the run's metrics."""
        now = self._clock()
        wall_s = now - self._started_at
        self.settle(now)
        time_ledger = self._ledger.close(now, status)
        doc = summary_doc(
            status=status, final_step=final_step, total_steps=self._total_steps,
            world_size_history=self._world_size_history, recoveries=self._recoveries, checkpoints=checkpoints,
            layout_history=[[step, Layout.of(world, self._tp, self._pp).to_dict()]
                            for step, world in self._world_size_history],
            loss_first=self._loss_first, loss_last=self._loss_last,
            model_sha256=model_sha256, wall_s=wall_s, time_ledger=time_ledger, metrics=metrics,
            # The share of the wall time spent computing the steps kept (see the module docstring).
            goodput=round(min(1.0, time_ledger[LedgerPart.PRODUCTIVE] / wall_s), 4) if wall_s > 0 else None,
            resumed_from=self.resumed_from, stragglers=self._stragglers, checkpoint_fallbacks=self._fallbacks,
            samples_consumed=self._data[0] if self._data else None,
            data_order_sha256=self._data[1] if self._data else None, config=self._config, error=error,
            controller_restarts=self.controller_restarts)
        doc["invocations"] = [*self.earlier, invocation_entry(doc, started_at=round(self._started_at, 3))]
        return doc


def earlier_invocations(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The invocation entries a resume carries on from the summary.json it found (None: none):
    its own `invocations`, or, from a summary written before they existed, one entry made of
    its top-level fields."""
    if not isinstance(previous, dict):
        return []
    if isinstance(previous.get("invocations"), list) and previous["invocations"]:
        return list(previous["invocations"])
    return [invocation_entry(previous, started_at=None)]


def invocation_entry(summary: dict[str, Any], *, started_at: float | None) -> dict[str, Any]:
    """One invocation's entry in summary.json's `invocations`, from its summary's top-level
    fields (this invocation's, or a summary written before invocations were kept)."""
    error = summary.get("error")
    return {"started_at": started_at, "status": summary.get("status"), "resumed_from": summary.get("resumed_from"),
            "final_step": summary.get("final_step"), "wall_s": summary.get("wall_s"),
            "loss_first": summary.get("loss_first"), "loss_last": summary.get("loss_last"),
            "recoveries": summary.get("recoveries") or [], "time_ledger": summary.get("time_ledger"),
            "controller_restarts": summary.get("controller_restarts") or [],
            "error": {k: error.get(k) for k in ("type", "message")} if isinstance(error, dict) else None}

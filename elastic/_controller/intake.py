"""What the controller takes in from its workers' reports each tick, into the ledgers and the
run record: the step each generation really restored, the step records (each step once, from
whichever rank has it), `ctx.log` records, straggler scores and checkpoint fallbacks; and what
those learn when a run resumes, a generation starts and the run finishes.

Per-rank compute times come on every rank's record of a step up to `COMPUTE_TIMES_PER_LINE`
ranks, on rank 0's only above: a step's times are scored once, from whichever record carries
them, whichever tick it arrives in. They reach metrics.jsonl on a sample of the steps only above
that many ranks, so that a line's size does not grow with the world size.

It records; it decides nothing and acts on no worker (the controller does both).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from elastic._controller.ledgers import RecoveryLedger, StepLedger
from elastic._controller.log_records import LogRecordPicker
from elastic._controller.slot_table import DEAD, WorkerView
from elastic._controller.states import Running
from elastic._controller.stragglers import StragglerDetector
from elastic._protocol import (
    COMPUTE_TIMES_PER_LINE,
    RestoreKind,
    RestorePlan,
    StepRecord,
    WorkerPhase,
    WorkerReport,
)
from elastic.config import FailureConfig

if TYPE_CHECKING:
    from elastic._controller.forming import GenerationStarted
    from elastic._controller.run_record import RunRecord

log = logging.getLogger("elastic.controller")

SCORED_KEPT = 256        # steps remembered as scored: times that come later than this are stale


def carries_compute_times(step: int, world_size: int) -> bool:
    """Whether step `step`'s metrics line keeps the per-rank compute times (see COMPUTE_TIMES_PER_LINE)."""
    every = -(-world_size // COMPUTE_TIMES_PER_LINE)
    return every <= 1 or step % every == 0


@dataclass(frozen=True)
class IntakePosition:
    """Where the intake stands (the controller's journal keeps it for a replacing controller)."""

    step: int
    first_generation: int
    start_step: int
    confirmed_generation: int | None


class ReportIntake:
    """Turns worker reports into the run's record. `step` is the newest step the run keeps."""

    def __init__(self, recorder: RunRecord, steps: StepLedger, recoveries: RecoveryLedger,
                 stragglers: StragglerDetector, failure: FailureConfig):
        self.recorder, self.steps, self.recoveries, self.stragglers = recorder, steps, recoveries, stragglers
        self._failure = failure              # the controller's FailureConfig
        self._logs = LogRecordPicker()       # ctx.log records held until the lowest rank's is known
        self._views: dict[int, WorkerView] = {}
        self.step = 0
        self.first_generation = 0            # this run's first (later ones re-form after failures)
        # Steps whose compute times were scored (recent ones only): a set, not a high-water mark,
        # because a step's times may come after a later step's (from the one rank that sends them,
        # in a later tick than another rank's record of the step).
        self._scored: set[int] = set()
        # The newest generation's restored step: as planned (restore), then as rank 0 reported it
        # (a corrupt checkpoint makes it older than the newest manifest the controller planned with).
        self.start_step = 0
        self._confirmed_generation: int | None = None

    def position(self) -> IntakePosition:
        return IntakePosition(self.step, self.first_generation, self.start_step, self._confirmed_generation)

    def continue_from(self, position: IntakePosition) -> None:
        """A replacing controller's intake goes on from its predecessor's position (its journal's)."""
        self.step, self.first_generation = position.step, position.first_generation
        self.start_step, self._confirmed_generation = position.start_step, position.confirmed_generation

    def resume(self, first_generation: int, step: int | None) -> None:
        """The run continues a previous one on its storage: its first generation is
        `first_generation`, and the steps up to `step` (its checkpoint; None: a fresh start) are
        the previous run's, kept as recorded."""
        self.first_generation = first_generation
        if step is not None:
            self.steps.resume(step)
            self.step = step

    def resumed(self, plan: RestorePlan, first_generation: int) -> None:
        """The run's first generation (`first_generation`) restores by `plan`: what the run keeps
        of the previous run on its storage (its steps and metrics lines up to the checkpoint)."""
        self.resume(first_generation=first_generation, step=plan.step)
        if plan.kind == RestoreKind.CHECKPOINT:
            self.recorder.resumed(plan.step)

    def generation_started(self, started: GenerationStarted) -> None:
        """Every ledger that counts per generation starts over from the new one, here and only here."""
        self.recoveries.formed(started.world_size, started.step)
        self.recorder.on_generation_start(started.step, started.world_size)
        self.restore(started.generation, started.step)
        self.stragglers.reset(started.world_size)

    def finished(self, report: WorkerReport, generation: int) -> None:
        """The run finished in `generation`; rank 0's `report` holds the data consumed. A recovery
        still open (the re-formed group finished without another step) is recorded too."""
        self.close_recovery(generation)
        self.recorder.on_final_data(report.samples_seen, report.data_order)

    def restore(self, generation: int, step: int) -> None:
        """Generation `generation` starts from `step`: the steps recorded past it are discarded."""
        if self.steps.restore(generation, step):
            self.recorder.rollback_to(step)
        self.step = self.start_step = step
        self._scored = {s for s in self._scored if s <= step}

    def absorb(self, views: dict[int, WorkerView], state: Any, members: list[int], generation: int) -> None:
        self._views = views
        if isinstance(state, Running):
            self._confirm_restore(state)
            self._logs.note_members(state.generation, state.members)
        fresh: dict[int, StepRecord] = {}
        timed: dict[int, StepRecord] = {}    # steps not scored yet: a record with their compute times
        for view in views.values():
            if view.report is not None:
                for fallback in view.report.checkpoint_fallbacks:
                    self.recorder.on_checkpoint_fallback(fallback)
            # Every rank reports every step it completed: take each step once, from whichever
            # rank has it (rank 0 may have died with steps it never reported).
            for record in view.records:
                if record.kind == "log":
                    self._logs.offer(view.wid, record)
                    continue
                if record.compute_s and record.step not in self._scored and record.step not in timed:
                    timed[record.step] = record
                if self.steps.is_new(record):
                    taken = fresh.setdefault(record.step, record)
                    if not taken.compute_s and record.compute_s:
                        fresh[record.step] = record    # the same step, with the compute times
        for step in sorted(fresh):
            record = fresh[step]
            self.steps.take(record, self.step)
            # The recovery is told before the step that closes it: a callback hears of the
            # recovery (and of the steps it lost) before the redone steps come.
            if isinstance(state, Running) and self.recoveries.open is not None \
                    and record.step > self.recoveries.open.restored_step:
                self.close_recovery(generation)
            if record.compute_s and not carries_compute_times(record.step, len(record.compute_s)):
                record = replace(record, compute_s=())
            self.recorder.on_step(record)
            self._score_stragglers(state, timed.pop(step, fresh[step]))
            self.step = record.step
        # Compute times of steps taken in an earlier tick, from a rank whose record came late.
        for step in sorted(timed):
            if step not in self._scored and step <= self.step and self.steps.kept(timed[step]):
                self._score_stragglers(state, timed[step])
        self._release_logs()

    def close_recovery(self, generation: int) -> None:
        entry = self.recoveries.close(generation)
        if entry is not None:
            log.info("recovery done: %s", entry)
            self.recorder.on_recovery(entry)

    def flush_logs(self) -> None:
        """The run ended: the log records still held go as they are."""
        self._release_logs(everything=True)

    def _confirm_restore(self, st: Running) -> None:
        """The step the new generation really restored (a corrupt checkpoint makes it older
        than the newest manifest the controller planned with)."""
        if self._confirmed_generation == st.generation:
            return
        report = self._views[st.members[0]].report
        if report is None or report.generation != st.generation or report.restored_step is None:
            return
        self._confirmed_generation = st.generation
        step = self.start_step = report.restored_step
        self.recorder.correct_generation_start(step, resumed=st.generation == self.first_generation)
        self.recoveries.confirmed(step)
        self.restore(st.generation, step)

    def _release_logs(self, everything: bool = False) -> None:
        """`ctx.log` records go to the run record once no lower rank can send its own (see
        _log_records). They count no step and feed neither straggler scores nor step times."""
        for record in self._logs.release(self._sent_all_of, everything=everything):
            if self.steps.kept(record):
                self.recorder.on_log(record)

    def _sent_all_of(self, wid: int, record: StepRecord) -> bool:
        """Whether worker `wid` can send no more records of `record`'s generation and step: its
        records come in order and it has reported a later step or left that generation's loop."""
        view = self._views.get(wid)
        if view is None or view.status == DEAD:
            return True
        report = view.report
        if report is None or report.generation < record.generation:
            return False
        return (report.generation > record.generation or report.step > record.step
                or report.phase != WorkerPhase.RUNNING)

    def _score_stragglers(self, st: Any, record: StepRecord) -> None:
        if record.compute_s:                # a step's times are scored once, wherever they came from
            self._scored.add(record.step)
            if len(self._scored) > SCORED_KEPT:
                self._scored = {s for s in self._scored if s > record.step - SCORED_KEPT}
        # The first step of a generation carries its restore: not a step time.
        if (not isinstance(st, Running) or self._failure.straggler_threshold is None
                or record.generation != st.generation or len(record.compute_s) != len(st.members)
                or record.step <= self.start_step + 1):
            return
        for flag in self.stragglers.observe(record.step, record.compute_s):
            log.warning("straggler: rank %d (worker %d) computes %.2fx the other ranks' median over the last "
                        "%d steps (step %d)", flag.rank, st.members[flag.rank], flag.score,
                        self._failure.straggler_window, flag.step)
            self.recorder.on_straggler(flag.as_json())

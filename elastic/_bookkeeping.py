"""The controller's bookkeeping: steps, recoveries, straggler flags and status.json.

A mixin of Controller (it reads and updates the controller's fields); kept apart so that
`_controller` holds only the state machine's decisions.
"""
from __future__ import annotations

import contextlib
import logging
import time

from elastic._protocol import WorkerPhase
from elastic._ray_group import DEAD, READY, SLOW_TICK_S
from elastic._states import PendingRecovery, Running

log = logging.getLogger("elastic.controller")


class Bookkeeping:
    @contextlib.contextmanager
    def _warn_if_slow(self):
        """Detection waits for the tick: say so when one took seconds (storage calls for
        status.json and checkpoints, or Ray calls, can block it)."""
        started = time.monotonic()
        yield
        took = time.monotonic() - started
        if took > SLOW_TICK_S:
            log.warning("controller tick took %.1fs in state %s: failures were not detected meanwhile",
                        took, self.state.state.value)

    def _confirm_restore(self) -> None:
        """The step the new generation really restored (a corrupt checkpoint makes it older
        than the newest manifest the controller planned with)."""
        st = self.state
        if not isinstance(st, Running) or st.restore_confirmed:
            return
        report = self.views[st.members[0]].report
        if report is None or report.generation != st.generation or report.restored_step is None:
            return
        st.restore_confirmed = True
        step = st.start_step = report.restored_step
        self.recorder.correct_generation_start(step)
        if st.generation == self._first_generation and self.recorder.resumed_from is not None:
            self.recorder.resumed_from = step
        if st.recovery is not None:
            st.recovery.restored_step = step
        self.step = step
        self._note_restore(st.generation, step)

    def _absorb_records(self) -> None:
        members = set(self._current_members())
        if isinstance(self.state, Running):
            self._log_records.note_members(self.state.generation, self.state.members)
        fresh = {}
        for view in self.views.values():
            if view.report is not None:
                for fallback in view.report.checkpoint_fallbacks:
                    self.recorder.on_checkpoint_fallback(fallback)
                if view.report.preempted and view.status == READY and view.wid not in members:
                    self.group.kill(view.wid, "preempted while spare")
            # Every rank reports every step it completed: take each step once, from whichever
            # rank has it (rank 0 may have died with steps it never reported).
            for record in view.records:
                if record.kind == "log":
                    self._log_records.offer(view.wid, record)
                elif record.step > self._recorded_step and self._kept(record):
                    fresh.setdefault(record.step, record)
        for step in sorted(fresh):
            record = fresh[step]
            if self._last_record_time is not None and record.step == self.step + 1:
                self._step_s = 0.8 * self._step_s + 0.2 * (record.time - self._last_record_time)
            self._last_record_time = record.time
            st = self.state
            # The recovery is told before the step that closes it: a callback hears of the
            # recovery (and of the steps it lost) before the redone steps come.
            if isinstance(st, Running) and st.recovery is not None and record.step > st.recovery.restored_step:
                self._close_recovery(st.recovery)
                st.recovery = None
            self.recorder.on_step(record)
            self._score_stragglers(record)
            self.step = self._recorded_step = record.step
        self._release_logs()

    def _release_logs(self, everything: bool = False) -> None:
        """`ctx.log` records go to the run record once no lower rank can send its own (see
        _log_records). They count no step and feed neither straggler scores nor step times."""
        for record in self._log_records.release(self._sent_all_of, everything=everything):
            if self._kept(record):
                self.recorder.on_log(record)

    def flush_logs(self) -> None:
        """The run ended: the log records still held go as they are."""
        self._release_logs(everything=True)

    def _sent_all_of(self, wid: int, record) -> bool:
        """Whether worker `wid` can send no more records of `record`'s generation and step: its
        records come in order and it has reported a later step or left that generation's loop."""
        view = self.views.get(wid)
        if view is None or view.status == DEAD:
            return True
        report = view.report
        if report is None or report.generation < record.generation:
            return False
        return (report.generation > record.generation or report.step > record.step
                or report.phase != WorkerPhase.RUNNING)

    def _kept(self, record) -> bool:
        """False for a step that a later generation discarded (it restored an earlier step)."""
        return all(record.step <= step for generation, step in self._restored.items() if generation > record.generation)

    def _note_restore(self, generation: int, step: int) -> None:
        """Generation `generation` starts from `step`: the steps recorded past it are discarded."""
        self._restored[generation] = step
        if step < self._recorded_step:
            self._recorded_step = step
            self.recorder.rollback_to(step)

    def _score_stragglers(self, record) -> None:
        st = self.state
        # The first step of a generation carries its restore: not a step time.
        if (not isinstance(st, Running) or self.failure.straggler_threshold is None
                or len(record.compute_s) != len(st.members) or record.step <= st.start_step + 1):
            return
        for flag in self.stragglers.observe(record.step, record.compute_s):
            log.warning("straggler: rank %d (worker %d) computes %.2fx the other ranks' median over the last "
                        "%d steps (step %d)", flag.rank, st.members[flag.rank], flag.score,
                        self.failure.straggler_window, flag.step)
            self.recorder.on_straggler(flag.as_json())

    def _recovery_for(self, failure, from_world: int, max_step: int, detect_s: float) -> PendingRecovery:
        """The recovery that handles `failure`: the one still open (the re-formed group has not
        completed a step yet) absorbs it, else a new one."""
        recovery = getattr(self.state, "recovery", None)
        if recovery is None:
            recovery = PendingRecovery(failure.cause, self.clock(), round(detect_s, 3), from_world, max_step)
        recovery.max_step = max(recovery.max_step, max_step)
        self._note_failure(recovery, failure.cause, list(failure.ranks))
        return recovery

    def _lost_while_recovering(self, st, wid: int) -> None:
        """A survivor died or hung during the recovery: kill it (hung) and note the failure once."""
        if wid in st.lost:
            return
        st.lost.add(wid)
        view = self.views[wid]
        if view.status == DEAD:
            cause = "node_lost" if (view.death or "").startswith("node lost") else "worker_died"
        else:
            cause = "hang"
            self.group.kill(wid, "hang during recovery")
            st.recovery.rung = "cold"
        rank = view.report.rank if view.report is not None else None
        self._note_failure(st.recovery, cause, [] if rank is None else [rank])

    def _note_failure(self, recovery: PendingRecovery, cause: str, ranks: list) -> None:
        recovery.failures.append({"cause": cause, "ranks": ranks, "detected_at": round(self._wall(self.clock()), 3)})

    def _wall(self, t: float) -> float:
        """Unix seconds of the controller clock's time `t`."""
        return self.wall_clock() - (self.clock() - t)

    def _close_recovery(self, recovery: PendingRecovery) -> None:
        now = self.clock()
        entry = {"cause": recovery.cause, "rung": recovery.rung, "detect_s": recovery.detect_s,
                 "recover_s": round(now - recovery.detected_at, 3),
                 "lost_steps": max(0, recovery.max_step - recovery.restored_step),
                 "from_world": recovery.from_world, "to_world": recovery.to_world,
                 "step": recovery.restored_step, "generation": self.generation,
                 "detected_at": round(self._wall(recovery.detected_at), 3), "recovered_at": round(self._wall(now), 3),
                 "failures": list(recovery.failures)}
        log.info("recovery done: %s", entry)
        self.recorder.on_recovery(entry)

    def _committed_for_status(self) -> int | None:
        """The newest committed step, listed at most every 2 s. The recorder calls it when it
        writes status.json (in its writer thread): a listing that stalls does not stall the loop."""
        now = self.clock()
        if now - self._last_committed_at > 2.0:
            self._last_committed_at = now
            try:
                committed = self.checkpoints.committed_steps()
                self._last_committed = committed[-1] if committed else None
                self.recorder.on_commits(committed)        # the callbacks' on_checkpoint
            except Exception:   # noqa: BLE001 - status is best effort; storage errors surface in saves
                log.debug("could not read the latest checkpoint", exc_info=True)
        return self._last_committed

    def _write_status(self, force: bool) -> None:
        if force:
            self._last_committed_at = -1e9       # a transition: list again when status is written
        members = self._current_members()
        workers = [{"rank": rank, "pid": v.info.pid, "node_id": v.info.node_id, "actor_id": v.info.actor_id}
                   for rank, wid in enumerate(members) if (v := self.views.get(wid)) and v.info]
        # Ready workers outside the group: hot spares, or replacements waiting for the next re-form.
        spares = [{"pid": v.info.pid, "node_id": v.info.node_id, "actor_id": v.info.actor_id}
                  for wid in self._ready_ids() if wid not in members and (v := self.views[wid]).info]
        if isinstance(self.state, Running):
            self.world_size = len(members)
        self.recorder.write_status(force=force, state=self.state.state.value, generation=self.generation,
                                   step=self.step, world_size=self.world_size,
                                   last_committed_step=self._committed_for_status, workers=workers, spares=spares)

"""A worker's checkpoint session: its CheckpointManager and what this rank knows of its saves.

It lives in the worker across generations (the manager keeps its side group, its upload thread
and its failure count), and holds the rules a rank follows around commits: never commit a step
whose loss was not finite, make sure a commit taken before the group changes did commit, confirm
the final commit before a run counts as finished, and tell Ray's metrics of commits (rank 0).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("elastic.context")


@dataclass
class CheckpointSession:
    """This rank's view of the run's checkpoints."""

    manager: Any = None                        # checkpointing.CheckpointManager, created lazily
    last_saved_step: int | None = None
    unconfirmed_save: int | None = None        # step of the latest save issued here, until its commit is seen
    save_started: dict[int, float] = field(default_factory=dict)   # step -> wall time its save began
    exported_commit: int | None = None         # newest commit exported to Ray metrics
    resumed_from: int | None = None            # step the run's first generation loaded
    load_fallbacks: list[dict] = field(default_factory=list)   # committed checkpoints skipped as corrupt
    nonfinite_step: int | None = None          # newest step whose loss was NaN/inf: never committed

    @property
    def _url(self) -> str | None:
        return self.manager.url if self.manager is not None else None

    def open(self, spec: Any) -> Any:
        """The manager, made on first use from the run's spec."""
        if self.manager is None:
            from checkpointing import CheckpointManager
            c = spec.checkpoint
            self.manager = CheckpointManager(
                c.storage, keep=c.keep, storage_options=c.storage_options or None, async_save=c.async_save,
                max_consecutive_failures=c.max_consecutive_failures,
                collective_timeout_s=spec.failure.collective_timeout_s, write_process=c.write_process)
        return self.manager

    def save(self, spec: Any, step: int, payload: dict[str, Any], *, generation: int, wait: bool,
             meta: dict[str, Any] | None = None) -> bool:
        """Collective: save `payload` as step `step`. False (nothing saved) for a step whose
        loss was not finite: such a state must never replace the last good checkpoint."""
        if self.nonfinite_step == step:
            log.warning("no checkpoint of step %d, whose loss was not finite", step)
            return False
        manager = self.open(spec)
        self.save_started[step] = time.time()
        manager.save(step, payload, generation=generation, meta=meta)
        self.last_saved_step = self.unconfirmed_save = step
        if wait:
            manager.wait()
        return True

    def check_committed(self, step: int) -> None:
        """After a waited save the group must not leave without: raise unless `step` committed."""
        commit = self.manager.last_commit if self.manager is not None else None
        if self.nonfinite_step == step or (commit is not None and commit.step == step):
            return
        from checkpointing import CheckpointError
        error = self.manager.last_error if self.manager is not None else None
        self.last_saved_step = commit.step if commit is not None else None
        raise CheckpointError(f"the checkpoint of step {step}, taken before the group changes, was not "
                              f"committed: {error}", url=self._url) from error

    def confirm_final(self, step: int) -> None:
        """A run is finished only once its final state is committed. Every rank learns the
        commit's outcome from rank 0 (checkpointing broadcasts it): if rank 0 was lost mid-commit
        or storage refused it, this rank reports that failure instead of a finish, and the run
        recovers and commits the final step again."""
        if self.unconfirmed_save != step:
            return
        commit = self.manager.last_commit
        if commit is None or commit.step != step:
            self.last_saved_step = commit.step if commit is not None else None
            from checkpointing import CheckpointError
            raise self.manager.last_error or CheckpointError(
                f"the final checkpoint of step {step} was not committed", url=self._url)
        self.unconfirmed_save = None

    def export_commit(self) -> None:
        """Rank 0: checkpoint seconds and bytes of a commit it has learnt of, to Ray metrics."""
        commit = self.manager.last_commit if self.manager is not None else None
        if commit is None or commit.step == self.exported_commit:
            return
        self.exported_commit = commit.step
        started = self.save_started.pop(commit.step, commit.committed_at)
        self.save_started = {s: t for s, t in self.save_started.items() if s > commit.step}
        try:
            from elastic._ray_metrics import checkpoint_committed
            checkpoint_committed(self.manager.url, commit.committed_at - started, commit.total_bytes)
        except Exception:   # metrics are best effort; never fail a step for them
            log.debug("exporting checkpoint metrics failed", exc_info=True)

    def settle(self, *, peers_alive: bool) -> None:
        """Before the group changes: finish the in-flight upload when every peer can, else drop
        it (its collectives would wait for a dead peer until collective_timeout_s)."""
        if self.manager is None:
            return
        if peers_alive:
            self.manager.wait()
        else:
            self.manager.abandon()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()

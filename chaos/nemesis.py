"""The nemesis: executes a schedule against a live run, heals what it broke, and records it all.

Runs in the runner's main thread (Ray's node management must). Each fault waits for its time;
with `wait_for_recovery` it also waits until the run is training again after the previous
fault's recovery, so every fault hits a healthy run and has its own recovery. Heals fall due
while waiting and are applied in between. `heal_all` is the final heal: the runner calls it in
a `finally`, so nothing stays frozen, cut off or refused, whatever happened to the run.

A watcher thread records the set of committed checkpoints whenever it changes: the history
then shows which steps were durable when, for the invariants.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from chaos.faults import Fault
from chaos.history import History
from chaos.injectors import Active, Injector, Skip, Unsupported
from chaos.observe import RunView, fence_facts
from chaos.schedule import Schedule

log = logging.getLogger("chaos.nemesis")

POLL_S = 0.1              # polling interval of run-state conditions
END_MARGIN = 0.97         # this close to its last step, the next fault waits for the next attempt
MAINTAIN_RETRY_S = 30.0   # after a node replacement failed, the next try waits this long


class Nemesis:
    def __init__(self, schedule: Schedule, injectors: dict[str, Injector], view: RunView, history: History, *,
                 total_steps: int, heartbeat_timeout_s: float, job_alive: Callable[[], bool],
                 gate_timeout_s: float = 240.0, commits: CommitWatcher | None = None, cluster=None):
        self.schedule, self.injectors, self.view, self.history = schedule, injectors, view, history
        self.total_steps, self.heartbeat_timeout_s = total_steps, heartbeat_timeout_s
        self.job_alive, self.gate_timeout_s, self.commits = job_alive, gate_timeout_s, commits
        self.cluster = cluster        # its maintain() replaces nodes that died on their own
        self.unsupported: dict[str, str] = {}
        self.active: list[tuple[float, int, Active]] = []     # (heal at, index, fault)
        self.next_index = 0
        self._last: tuple[int, bool, float] | None = None   # (generation, needs recovery, unix time) of the last fault
        self._maintain_after = 0.0    # monotonic time before which no node replacement is tried again

    # ---- life cycle ------------------------------------------------------------------------
    def setup(self) -> None:
        for kind in self.schedule.kinds():
            injector = self.injectors.get(kind)
            if injector is None:
                continue
            try:
                injector.setup()
            except Unsupported as e:
                self.unsupported[kind] = str(e)
                log.warning("fault kind %s is unsupported here: %s", kind, e)

    def teardown(self) -> None:
        for kind in self.schedule.kinds():
            if kind in self.injectors and kind not in self.unsupported:
                try:
                    self.injectors[kind].teardown()
                except Exception:   # teardown of one must not stop the others
                    log.exception("teardown of %s failed", kind)

    # ---- the schedule ------------------------------------------------------------------------
    def run(self, t0: float) -> None:
        """Inject the faults from `next_index` on, timed from `t0` (unix seconds); returns when
        the schedule is done, or the job has ended or is about to (the rest can go on in the
        next attempt)."""
        entries = self.schedule.entries
        while self.next_index < len(entries):
            index, entry = self.next_index, entries[self.next_index]
            if entry.fault.kind in self.unsupported:
                self._skip(index, entry.fault, f"unsupported: {self.unsupported[entry.fault.kind]}")
                self.next_index += 1
                continue
            if not self._wait_until(t0 + entry.at_s):
                return
            if self.schedule.wait_for_recovery and not self._gate():
                if not self.job_alive():
                    return
                self._skip(index, entry.fault, f"run not training again {self.gate_timeout_s:.0f}s after the "
                                               "previous fault")
            else:
                if self._ending():
                    return      # left for the next attempt (the runner runs the job longer)
                self._inject(index, entry.fault)
            self.next_index += 1

    def skip_rest(self, reason: str) -> None:
        for index in range(self.next_index, len(self.schedule.entries)):
            self._skip(index, self.schedule.entries[index].fault, reason)
        self.next_index = len(self.schedule.entries)

    def _ending(self) -> bool:
        status = self.view.status() or {}
        return status.get("state") in ("finished", "failed") or status.get("step", 0) >= END_MARGIN * self.total_steps

    def _inject(self, index: int, fault: Fault) -> None:
        status = self.view.status() or {}
        committed = self._newest_committed()
        try:
            active = self.injectors[fault.kind].invoke(fault, self.schedule.target_rng(index))
        except Skip as e:
            return self._skip(index, fault, str(e))
        except Exception as e:   # an injector bug is recorded, the campaign goes on
            log.exception("invoking %s failed", fault.describe())
            return self._skip(index, fault, f"injector error: {type(e).__name__}: {e}")
        self.history.record("invoke", index=index, fault=fault.to_dict(), detail=active.detail,
                            run=_run_state(status), committed_newest=committed)
        expectation = fault.expectation(self.heartbeat_timeout_s)
        self._last = (status.get("generation", -1), expectation.required, time.time())
        self.active.append((time.monotonic() + fault.duration_s, index, active))
        self._heal_due()

    def _skip(self, index: int, fault: Fault, reason: str) -> None:
        log.info("fault %d %s skipped: %s", index, fault.kind, reason)
        self.history.record("skip", index=index, fault=fault.to_dict(), reason=reason)

    def _newest_committed(self) -> int | None:
        try:
            committed = self.view.committed()
        except Exception:   # noqa: BLE001 - unreadable store: the invariant treats it as unknown
            return None
        return committed[-1].step if committed else None

    # ---- waiting -----------------------------------------------------------------------------
    def _wait_until(self, t: float) -> bool:
        while time.time() < t:
            self._heal_due()
            if not self.job_alive():
                return False
            time.sleep(min(POLL_S, max(0.0, t - time.time())))
        return self.job_alive()

    def _gate(self) -> bool:
        """Wait until the run trains again: state running, past the previous fault's generation
        when that fault needed a recovery, a checkpoint committed since that fault, and one
        committed by the current generation. A generation's first save builds its checkpoint
        group: a rank lost while that group forms leaves the survivors waiting in the store for
        the whole collective timeout, so hitting that moment is left to storms (the first fault
        of a run waits for it too)."""
        deadline = time.monotonic() + self.gate_timeout_s
        first_step = None
        while time.monotonic() < deadline and self.job_alive():
            self._heal_due()
            status = self.view.status() or {}
            healthy = status.get("state") == "running" and not self.active
            if healthy and self._last is not None and self._last[1]:
                healthy = status.get("generation", -1) > self._last[0]
            if healthy and self.commits is not None:
                healthy = status.get("generation") in self.commits.generations and (
                    self._last is None or self.commits.newest_at > self._last[2])
            if healthy:
                first_step = status.get("step", 0) if first_step is None else first_step
                if status.get("step", 0) > first_step:      # training, not just re-formed
                    return True
            time.sleep(POLL_S)
        return False

    # ---- heals -------------------------------------------------------------------------------
    def _heal_due(self) -> None:
        if self.cluster is not None and time.monotonic() >= self._maintain_after:
            try:
                for node in self.cluster.maintain():
                    self.history.record("node_replaced", node=node)
            except Exception as e:   # a machine the "autoscaler" could not start: recorded, tried again later
                # A replacement's `ray start` can fail (on a loaded machine its raylet times out
                # registering); the run goes on with fewer nodes, as a cloud short of machines
                # leaves it, and the next try waits so that due heals are not held up by it.
                log.exception("replacing a dead node failed")
                self.history.record("node_replace_failed", error=f"{type(e).__name__}: {e}")
                self._maintain_after = time.monotonic() + MAINTAIN_RETRY_S
        now = time.monotonic()
        for entry in [e for e in self.active if e[0] <= now]:
            self._heal(entry, final=False)

    def _heal(self, entry: tuple[float, int, Active], final: bool) -> None:
        _, index, active = entry
        if entry in self.active:
            self.active.remove(entry)
        if active.healed:
            return
        try:
            detail = self.injectors[active.fault.kind].heal(active)
            error = None
        except Exception as e:   # recorded; the final heal retries what it can
            log.exception("healing %s failed", active.fault.describe())
            detail, error = {}, f"{type(e).__name__}: {e}"
        active.healed = error is None
        self.history.record("heal", index=index, kind=active.fault.kind, detail=detail, final=final,
                            error=error, run=_run_state(self.view.status() or {}))

    def wait_heals(self, job_done: Callable[[], bool]) -> None:
        """Apply heals as they fall due until the job ends."""
        while not job_done():
            self._heal_due()
            time.sleep(POLL_S)

    def heal_all(self, touched: list | None = None) -> None:
        """The final heal: every active fault, now, whatever state the run is in; then SIGCONT
        to every worker process a fault touched, in case a heal could not run."""
        for entry in list(self.active):
            self._heal(entry, final=True)
        for proc in touched or ():
            proc.signal(signal.SIGCONT)


class CommitWatcher(threading.Thread):
    """Records the committed checkpoints (step and generation) in the history whenever they
    change, with the manifests the fence history rejects; and FENCE whenever it changes."""

    def __init__(self, view: RunView, history: History, interval_s: float = 0.5):
        super().__init__(name="chaos-commit-watcher", daemon=True)
        self.view, self.history, self.interval_s = view, history, interval_s
        self._halt = threading.Event()
        self.newest_at = 0.0          # unix time when a new commit (step, generation) was last seen
        self.generations: set[int] = set()    # generations seen committing at least once

    def run(self) -> None:
        last, last_fence = None, None
        while not self._halt.is_set():
            try:
                fence, steps, rejected = self.view.manifests()
            except Exception:   # noqa: BLE001 - a listing that fails is retried next interval
                self._halt.wait(self.interval_s)
                continue
            facts = fence_facts(fence)
            if facts is not None and facts != last_fence:
                self.history.record("fence", **facts)
                last_fence = facts
            if (steps, rejected) != last:
                fields = {"rejected": [[s, rejected[s]] for s in sorted(rejected)]} if rejected else {}
                event = self.history.record("commits", steps=sorted(steps),
                                            generations=[steps[s] for s in sorted(steps)],
                                            newest=max(steps) if steps else None, **fields)
                if set(steps.items()) - set((last or ({}, {}))[0].items()):
                    self.generations.update(steps.values())
                    self.newest_at = event["t"]
                last = (steps, rejected)
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def _run_state(status: dict) -> dict:
    return {k: status.get(k) for k in ("state", "generation", "step", "world_size", "last_committed_step")}

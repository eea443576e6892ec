"""A zombie writer: a process that plays rank 0 of the run's current generation and commits late.

Started by the late_commit injector (chaos/injectors/commit.py) as `python -m chaos.zombie`.
It stands outside the run like a worker the controller has given up on (partitioned away,
frozen, its actor declared dead while its thread still runs), and saves through the
checkpointing package's own path: `CheckpointManager.save(step, state, generation=G)`, sync, on
a one-rank gloo group, with the manager's retention pass after a commit. What is under test is
therefore the commit protocol exactly as workers run it (fence check, shards under g<G>/,
final fence check, conditional PUT of COMMITTED, retention), not a copy of it.

The zombie settles on the generation G that FENCE and status.json agree on, picks a step S past
the run's current step by `--ahead` checkpoint intervals or LEAD_S seconds at the run's measured
pace, whichever is more (a step the run has not committed, and that a generation re-formed
after the kill, restarting near the step the run had then, will not start past), writes
a small state of its own as step S, and then stalls at its commit until FENCE has moved past G
(with the new generation's start step recorded):

  --phase check   stalls before the commit's final fence check (SaveJob.before_commit)
  --phase put     stalls inside the COMMITTED PUT, after that check passed (the F1 window),
                  until the newer generation has committed step S too, or `--within` runs out;
                  it never lets a PUT out whose step the newer generation started at or past
                  (its fake state would then be a legitimate part of the timeline)

It reports on `--events` (one JSON object per line): "ready" (settled: G and S), "written"
(the shards are durable and the commit is stalled: the injector now makes a new generation),
and "done" with the outcome:

  fenced          the commit was refused with FencedError (the expected end)
  landed          the late COMMITTED was written; `rejected_by_fence` says whether the fence
                  history makes readers and collectors ignore it (it must)
  fenced_early    FENCE moved before the zombie wrote anything (nothing was attacked)
  not_settled     no running generation to impersonate
  no_fence_change FENCE did not move within `--within`: the zombie gave up without committing
  aborted         the newer generation started at or past step S: no PUT was let out
  error           anything else (with the error)

plus what it deleted (its retention pass must delete nothing of a newer generation), the
manifest generation at S before its PUT and afterwards, and FENCE as it found it at the end.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

POLL_S = 0.1                # polling interval of FENCE, status.json and step S's manifest
PACE_S = 2.0                # the run's pace is measured over this long
LEAD_S = 15.0               # the zombie's step is at least this far ahead at the run's pace
START_STEP_GRACE_S = 15.0   # after FENCE moved, how long to wait for the new generation's start step


def zombie_step(run_step: int, every: int, ahead: int, pace: float) -> int:
    """The checkpoint step the zombie writes: the first multiple of `every` at least `ahead`
    intervals, and LEAD_S seconds at `pace` steps a second, past `run_step`."""
    lead = max(ahead * every, math.ceil(pace * LEAD_S))
    return -(-(run_step + lead) // every) * every


class _GiveUp(Exception):
    """Stops the save before its commit; `outcome` names why."""

    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m chaos.zombie", description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", required=True)
    p.add_argument("--endpoint", help="S3 endpoint URL (storage option endpoint_url)")
    p.add_argument("--every", type=int, required=True, help="the run's checkpoint interval in steps")
    p.add_argument("--ahead", type=int, default=5, help="checkpoint intervals past the run's step")
    p.add_argument("--phase", choices=("check", "put"), required=True)
    p.add_argument("--within", type=float, default=90.0, help="seconds for FENCE to move (and, put, the newer commit)")
    p.add_argument("--keep", type=int, default=3, help="retention of the zombie's manager (as the run's)")
    p.add_argument("--events", required=True, help="file the events are appended to")
    return p.parse_args(argv)


class Zombie:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.deadline = time.monotonic() + args.within
        self.options = {"endpoint_url": args.endpoint} if args.endpoint else None
        self.generation = -1       # the generation impersonated and the step written, once settled
        self.step = -1
        self.report: dict = {"deleted": [], "phase": args.phase}
        self.gave_up: _GiveUp | None = None

    # ---- events ----------------------------------------------------------------------------
    def emit(self, event: str, **fields) -> None:
        with open(self.args.events, "a") as f:
            f.write(json.dumps({"event": event, "t": round(time.time(), 3), **fields}, default=str) + "\n")

    # ---- the attack --------------------------------------------------------------------------
    def run(self) -> dict:
        import torch
        import torch.distributed as dist

        from checkpointing import CheckpointManager, FencedError
        from checkpointing import manifest as mf
        self.mf = mf
        try:
            # A one-rank gloo group, as a worker's manager has one (its side group is built on it).
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.report["group"] = "gloo, 1 rank"
        except Exception as e:   # noqa: BLE001 - the manager also saves without a group
            self.report["group"] = f"none ({type(e).__name__}: {e})"
        mgr = CheckpointManager(self.args.storage, keep=self.args.keep, storage_options=self.options,
                                async_save=False, max_consecutive_failures=1_000)
        self.storage = mgr.storage
        self._watch_deletions(mgr.storage)
        if not self._settle():
            return self.report
        self.emit("ready", generation=self.generation, step=self.step)
        if self.args.phase == "check":
            mgr._before_commit = self._stall_before_check
        else:
            self._stall_inside_put(mgr.storage)
        state = {"zombie": torch.full((256,), float(self.generation)), "zombie_step": torch.tensor(self.step)}
        try:
            mgr.save(self.step, state, generation=self.generation,
                     meta={"zombie": True, "generation": self.generation})
        except FencedError as e:                 # refused up front by the manager
            mgr.last_error = e
        except Exception as e:                   # noqa: BLE001 - reported, never raised
            mgr.last_error = e
        self._outcome(mgr, FencedError)
        self._aftermath()
        return self.report

    def _status(self) -> dict:
        try:
            status = json.loads(self.storage.read_bytes(self.storage.path("status.json")))
        except (FileNotFoundError, ValueError):
            return {}
        return status if isinstance(status, dict) else {}

    def _pace(self, first: dict) -> float:
        """The run's steps per second, from two status.json versions PACE_S apart (their own
        `updated_at`); 0.0 when it cannot tell."""
        deadline = time.monotonic() + 3 * PACE_S
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            second = self._status()
            t0, t1 = first.get("updated_at"), second.get("updated_at")
            if isinstance(t0, (int, float)) and isinstance(t1, (int, float)) and t1 - t0 >= PACE_S:
                return max(0.0, ((second.get("step") or 0) - (first.get("step") or 0)) / (t1 - t0))
        return 0.0

    def _settle(self) -> bool:
        """The generation to impersonate (FENCE's, running per status.json) and the step: at
        least `--ahead` intervals, and LEAD_S of the run's pace, past its step, so that the
        generation the kill makes restarts before it."""
        fence = self.mf.read_fence_doc(self.storage)
        status = self._status()
        if fence is None or fence.generation is None or status.get("state") != "running" \
                or status.get("generation") != fence.generation:
            self.report.update(outcome="not_settled", error=(
                f"FENCE at generation {None if fence is None else fence.generation}, status.json "
                f"{status.get('state')!r} at generation {status.get('generation')}: no running generation"))
            return False
        pace = self._pace(status)
        status = self._status() or status
        self.generation = fence.generation
        self.step = zombie_step(int(status.get("step") or 0), self.args.every, self.args.ahead, pace)
        self.report.update(generation=self.generation, step=self.step, run_step=status.get("step"),
                           run_pace=round(pace, 2), run_id=fence.run_id)
        return status.get("generation") == fence.generation or self._not_settled(status)

    def _not_settled(self, status: dict) -> bool:
        self.report.update(outcome="not_settled", error=f"the run moved to generation {status.get('generation')} "
                                                        f"while the zombie measured its pace")
        return False

    def _watch_deletions(self, storage) -> None:
        """Record every deletion the manager makes (its retention pass after a commit)."""
        rm, rmdir = storage.rm, storage.rmdir_if_empty

        def logged_rm(path, recursive=True):
            self.report["deleted"].append(storage.url_for(path))
            return rm(path, recursive=recursive)

        def logged_rmdir(path):
            before = storage.exists(path)
            result = rmdir(path)
            if before and not storage.exists(path):
                self.report["deleted"].append(storage.url_for(path))
            return result

        storage.rm, storage.rmdir_if_empty = logged_rm, logged_rmdir

    def _manifest_generation(self) -> int | None:
        try:
            info = self.mf.read_manifest(self.storage, self.step)
        except Exception:   # noqa: BLE001 - an unreadable manifest is reported as unknown
            return None
        return None if info is None else info.generation

    def _newer_fence(self):
        """FENCE once it is past the zombie's generation, with the start step of the newest
        generation recorded (or START_STEP_GRACE_S after it moved); raises _GiveUp at the deadline."""
        moved_at = None
        while True:
            fence = self.mf.read_fence_doc(self.storage)
            if fence is not None and fence.generation is not None and fence.generation > self.generation:
                moved_at = moved_at or time.monotonic()
                entry = next((e for e in reversed(fence.history) if e.generation == fence.generation), None)
                if (entry is not None and entry.start_step is not None) or \
                        time.monotonic() - moved_at > START_STEP_GRACE_S:
                    self.report["fence_moved_to"] = fence.generation
                    self.report["new_start_step"] = None if entry is None else entry.start_step
                    return fence
            if time.monotonic() > self.deadline:
                self._give_up("no_fence_change", f"FENCE stayed at generation {self.generation} for "
                                                 f"{self.args.within:.0f}s: nothing to be late for")
            time.sleep(POLL_S)

    def _give_up(self, outcome: str, message: str) -> None:
        # Raised inside the save, which turns it into a CheckpointError: remembered here.
        self.gave_up = _GiveUp(outcome, message)
        raise self.gave_up

    def _stall_before_check(self) -> None:
        self.emit("written", generation=self.generation, step=self.step, phase="check")
        self._newer_fence()
        self.report["manifest_before_put"] = self._manifest_generation()

    def _stall_inside_put(self, storage) -> None:
        put_if = storage.put_if
        stalled = {"done": False}

        def late_put(path, data, *, if_token):
            if stalled["done"] or not path.endswith("/" + self.mf.MANIFEST_NAME):
                return put_if(path, data, if_token=if_token)
            stalled["done"] = True
            # The commit's fence check has passed: from here on only the conditional PUT stands
            # between this stale manifest and the store.
            self.emit("written", generation=self.generation, step=self.step, phase="put")
            self._newer_fence()
            start = self.report.get("new_start_step")
            if start is not None and start >= self.step:
                self._give_up("aborted", f"the new generation started at step {start}, at or past the "
                                         f"zombie's step {self.step}: its fake state would be on the timeline")
            while time.monotonic() < self.deadline:
                generation = self._manifest_generation()
                if generation is not None and generation > self.generation:
                    break
                time.sleep(POLL_S)
            self.report["manifest_before_put"] = self._manifest_generation()
            self.report["put_at"] = round(time.time(), 3)
            return put_if(path, data, if_token=if_token)

        storage.put_if = late_put

    def _outcome(self, mgr, fenced_error) -> None:
        error, give_up = mgr.last_error, self.gave_up
        if mgr.last_commit is not None and mgr.last_commit.step == self.step:
            info = mgr.last_commit
            fence = self.mf.read_fence_doc(self.storage)
            self.report.update(outcome="landed", rejected_by_fence=fence.rejects(info) if fence is not None else None)
        elif isinstance(give_up, _GiveUp):
            self.report.update(outcome=give_up.outcome, error=str(give_up))
        elif isinstance(error, fenced_error):
            # Refused before the hook ran: FENCE moved before the shards were written.
            written = "manifest_before_put" in self.report or "fence_moved_to" in self.report
            self.report.update(outcome="fenced" if written else "fenced_early", error=str(error))
        else:
            self.report.update(outcome="error", error=f"{type(error).__name__}: {error}" if error else "no outcome")

    def _aftermath(self) -> None:
        fence = self.mf.read_fence_doc(self.storage)
        self.report["manifest_after"] = self._manifest_generation()
        self.report["fence_after"] = None if fence is None else {
            "generation": fence.generation, "run_id": fence.run_id,
            "history": [[e.generation, e.start_step] for e in fence.history]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    zombie = Zombie(args)
    try:
        report = zombie.run()
    except Exception as e:   # noqa: BLE001 - the injector reads the outcome, not a traceback
        report = {**zombie.report, "outcome": "error", "error": f"{type(e).__name__}: {e}"}
    zombie.emit("done", **report)
    return 0


if __name__ == "__main__":
    # Exit without waiting for the gloo group's teardown: the events file already says it all.
    code = main()
    sys.stdout.flush()
    os._exit(code)

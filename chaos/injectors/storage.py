"""Faults on checkpoint storage: an outage that refuses writes, a stall of every request, a
crash between the shards and the commit, and bit rot in a committed shard."""
from __future__ import annotations

import random
import signal
import time

from chaos.faults import CorruptCheckpoint, CrashBeforeCommit, Fault, StorageStall
from chaos.injectors import Active, Injector, Skip, Unsupported
from chaos.injectors.process import _detail
from chaos.procs import KEEPER_TITLE, Proc, siblings_titled

_POLL_S = 0.005   # polling interval of the local-storage watch for a half-written checkpoint


class StorageOutageInjector(Injector):
    kind = "storage_outage"

    def setup(self) -> None:
        if self.env.proxy is None:
            raise Unsupported("storage_outage needs s3:// storage (the runner puts a fault proxy in front "
                              "of it); local files cannot refuse writes to root")

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        before = self.env.proxy.snapshot()
        # Refuse for longer than asked: the heal ends the outage, so a late heal lengthens it
        # rather than letting writes through early.
        self.env.proxy.refuse(fault.duration_s + 3600)
        return Active(fault, {"refusing": ["PUT", "POST", "DELETE"]}, state=before)

    def heal(self, active: Active) -> dict:
        self.env.proxy.stop_refusing()
        after = self.env.proxy.snapshot()
        return {"refused_requests": after["refused"] - active.state["refused"]}


class StorageStallInjector(Injector):
    kind = "storage_stall"

    def setup(self) -> None:
        if self.env.proxy is None:
            raise Unsupported("storage_stall needs s3:// storage (the runner puts a fault proxy in front of it)")

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, StorageStall)
        before = self.env.proxy.snapshot()
        # Stalled for longer than asked: the heal ends the stall (see StorageOutageInjector).
        self.env.proxy.stall(fault.duration_s + 3600)
        detail: dict = {"stalling": "every request"}
        if fault.kill:
            # The death is seen through Ray, not storage: the recovery starts inside the stall.
            workers = self.targets("one", rng)
            procs = self.procs(workers)
            detail.update(_detail(workers, procs, [p.signal(signal.SIGKILL) for p in procs]))
            detail["acted_at"] = round(time.time(), 3)
        return Active(fault, detail, state=before)

    def heal(self, active: Active) -> dict:
        self.env.proxy.stop_stalling()
        after = self.env.proxy.snapshot()
        return {"stalled_requests": after["stalled"] - active.state["stalled"]}


class CrashBeforeCommitInjector(Injector):
    """Kill rank 0 (the only writer of COMMITTED) after the shards of a checkpoint are written
    and before its manifest is. On S3 the proxy holds the manifest's PUT, kills its writer and
    drops it: exact. On local files, watch for a step directory without COMMITTED, freeze rank 0,
    check that the manifest is still absent, and kill it."""

    kind = "crash_before_commit"

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, CrashBeforeCommit)
        if self.env.proxy is not None:
            return self._via_proxy(fault)
        return self._via_watch(fault)

    def _rank0(self) -> Proc:
        workers = self.targets("rank:0", random.Random(0))
        return self.procs(workers)[0]

    def _pending_step(self) -> tuple[int, list[str]] | None:
        steps = self.env.view.step_dirs()
        if not steps or self.env.view.has_manifest(steps[-1]):
            return None
        files = self.env.view.step_files(steps[-1])
        return (steps[-1], files) if files else None

    def _via_proxy(self, fault: CrashBeforeCommit) -> Active:
        proxy = self.env.proxy
        proxy.hold("/COMMITTED")
        killed = False
        try:
            if not proxy.wait_held(fault.within_s):
                raise Skip(f"no checkpoint commit within {fault.within_s:.0f}s")
            proc = self._rank0()
            pending = self._pending_step()
            killed = proc.signal(signal.SIGKILL)
            # The writer must be gone before its request is dropped, or its client would
            # retry the PUT and commit after all.
            deadline = time.monotonic() + 10
            while proc.same() and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        finally:
            proxy.release(drop=killed)
        if not killed:
            raise Skip("rank 0 was gone before it could be killed")
        step, files = pending if pending else (None, [])
        return Active(fault, {"ranks": [0], "pids": [proc.pid], "step": step, "files_written": len(files),
                              "method": "proxy held the COMMITTED PUT"})

    def _via_watch(self, fault: CrashBeforeCommit) -> Active:
        deadline = time.monotonic() + fault.within_s
        while time.monotonic() < deadline:
            pending = self._pending_step()
            if pending is None:
                time.sleep(_POLL_S)
                continue
            step, files = pending
            proc = self._rank0()
            if not proc.signal(signal.SIGSTOP):
                raise Skip("rank 0 was gone before it could be frozen")
            if self.env.view.has_manifest(step):
                proc.signal(signal.SIGCONT)      # committed just before the freeze: try the next save
                continue
            proc.signal(signal.SIGKILL)
            return Active(fault, {"ranks": [0], "pids": [proc.pid], "step": step, "files_written": len(files),
                                  "method": "froze rank 0 with the step uncommitted"})
        raise Skip(f"no half-written checkpoint seen within {fault.within_s:.0f}s")


class CorruptCheckpointInjector(Injector):
    """Flip bytes in one shard of the newest committed checkpoint. With `force_load`, freeze
    every worker first (no commit can land while we pick the newest), then kill them all; with
    `kill_keepers`, the run's node keepers with them (they hold copies of the state outside the
    workers), so the restore must come from storage and meet the corrupt checkpoint first."""

    kind = "corrupt_checkpoint"

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, CorruptCheckpoint)
        # An older intact checkpoint must exist to fall back to; a run that just recovered
        # may not have committed twice yet.
        deadline = time.monotonic() + fault.within_s
        while len(self.env.view.committed()) < 2:
            if time.monotonic() > deadline:
                raise Skip(f"fewer than two committed checkpoints after {fault.within_s:.0f}s: "
                           "no older one to fall back to")
            time.sleep(0.2)   # polling interval of the condition
        procs = self.procs(self.targets("all", rng)) if fault.force_load else []
        # The keepers are Ray actors of the workers' own raylets: their siblings, by process title.
        keepers = siblings_titled(procs, KEEPER_TITLE) if procs and fault.kill_keepers else []
        procs += keepers
        for p in procs:
            p.signal(signal.SIGSTOP)
        killed = False
        try:
            committed = self.env.view.committed()
            if len(committed) < 2:
                raise Skip("fewer than two committed checkpoints: no older one to fall back to")
            corrupted = [self._corrupt(committed[-1])]
            intact_older = committed[-2].step
            if fault.force_load:
                killed = all(p.signal(signal.SIGKILL) for p in procs)
                # A commit whose PUT was already on the wire when the workers froze lands now:
                # rot it too, so that the next load really meets a corrupt checkpoint first.
                newer = [c for c in self.env.view.committed() if c.step > committed[-1].step]
                corrupted += [self._corrupt(c) for c in newer]
        finally:
            if not killed:
                for p in procs:
                    p.signal(signal.SIGCONT)
        return Active(fault, {"step": corrupted[-1]["step"], "corrupted": corrupted, "intact_older": intact_older,
                              "pids": [p.pid for p in procs], "keepers": [p.pid for p in keepers],
                              "killed_all": killed})

    def _corrupt(self, info) -> dict:
        shards = sorted((f for f in info.files if not f.endswith(".metadata")),
                        key=lambda f: -info.files[f]["size"]) or sorted(info.files)
        done = self.env.view.corrupt_file(info.step, shards[0])
        done["generation"] = info.generation
        return done

    def heal(self, active: Active) -> dict:
        # Bit rot is not undone: the runtime must live with it (fall back, re-commit, collect).
        return {}

"""Injectors: how each kind of fault is caused, and healed, from outside the training processes.

Every injector has the same life cycle, driven by the nemesis:

    setup(env)            once, before the run; raises Unsupported when the fault cannot be
                          caused here (no cluster, no S3 proxy, no network namespaces)
    invoke(fault, rng)    cause it now; returns an Active handle whose `detail` goes into the
                          history; raises Skip when the moment is wrong (no target, no commit)
    heal(active)          undo what can be undone (SIGCONT, restore the link, add a node back);
                          always safe to call twice, and called by the final heal whatever happened
    teardown()            once, after the final heal

Injectors find their targets the way an operator would: pids and node ids from status.json,
nodes from the runner's Ray cluster, objects on the store.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos.faults import Fault
from chaos.observe import RunView
from chaos.procs import Proc


class Unsupported(Exception):
    """This fault cannot be injected in this environment; the message says what is missing."""


class Skip(Exception):
    """This fault cannot be injected right now (no suitable target or moment)."""


@dataclass
class Env:
    """What injectors may act on. `cluster` and `proxy` are None when the runner has none; the
    job fields describe the job as the campaign runs it (for faults that start a process of
    their own against the run: a second run of the job, a zombie writer)."""

    view: RunView
    cluster: Any = None              # chaos.cluster.LocalCluster / chaos.netns.NetnsCluster
    proxy: Any = None                # chaos.proxy.FaultProxy (S3 storage only)
    touched: list[Proc] = field(default_factory=list)   # every worker process signalled
    job_spec: Any = None             # chaos.job.JobSpec of the attempt running now
    job_env: dict[str, str] | None = None                # the job's environment
    exec_prefix: list[str] = field(default_factory=list)  # e.g. `ip netns exec NS` (chaos.netns)
    out_dir: str | None = None       # where injectors keep their processes' logs
    driver_pid: Callable[[], int | None] = lambda: None   # the job's live driver process, if any
    drivers_killed: list[int] = field(default_factory=list)   # for the campaign to start again


@dataclass
class Active:
    """An injected fault, until healed."""

    fault: Fault
    detail: dict[str, Any]
    state: Any = None                # injector-private: what heal needs
    healed: bool = False


class Injector:
    kind = "fault"

    def __init__(self, env: Env):
        self.env = env

    def setup(self) -> None:
        pass

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        raise NotImplementedError

    def heal(self, active: Active) -> dict[str, Any]:
        return {}

    def teardown(self) -> None:
        pass

    # ---- helpers shared by injectors -------------------------------------------------------
    def targets(self, target: str, rng: random.Random) -> list[dict]:
        """Workers of the current generation named by `target` (see chaos.faults)."""
        workers = self.env.view.workers()
        if not workers:
            raise Skip("status.json lists no workers")
        if target == "one":
            return [rng.choice(workers)]
        if target == "minority":
            return sorted(rng.sample(workers, max(1, (len(workers) - 1) // 2)), key=lambda w: w["rank"])
        if target == "all":
            return workers
        rank = int(target.split(":", 1)[1])
        chosen = [w for w in workers if w["rank"] == rank]
        if not chosen:
            raise Skip(f"no worker with rank {rank} (world size {len(workers)})")
        return chosen

    def procs(self, workers: list[dict]) -> list[Proc]:
        found = []
        for w in workers:
            proc = Proc.of_worker(w["pid"])
            if proc is not None:
                found.append(proc)
                self.env.touched.append(proc)
        if not found:
            raise Skip(f"none of pids {[w['pid'] for w in workers]} is a live worker process")
        return found


def build_injectors(env: Env) -> dict[str, Injector]:
    """One injector per fault kind (UserError has none: it is armed in the job's arguments)."""
    from chaos.injectors.commit import LateCommitInjector, SecondRunInjector
    from chaos.injectors.node import KillNodeInjector
    from chaos.injectors.partition import PartitionInjector
    from chaos.injectors.process import (
        BadGradientInjector,
        BitFlipInjector,
        HangInjector,
        KillAllWorkersInjector,
        KillControllerInjector,
        KillDriverInjector,
        KillWorkerInjector,
        PreemptInjector,
        SlowInjector,
    )
    from chaos.injectors.storage import (
        CorruptCheckpointInjector,
        CrashBeforeCommitInjector,
        StorageOutageInjector,
        StorageStallInjector,
    )
    classes = (KillWorkerInjector, KillAllWorkersInjector, PreemptInjector, HangInjector, SlowInjector,
               KillNodeInjector, PartitionInjector, StorageOutageInjector, StorageStallInjector,
               CrashBeforeCommitInjector, CorruptCheckpointInjector, LateCommitInjector, SecondRunInjector,
               BitFlipInjector, BadGradientInjector, KillControllerInjector, KillDriverInjector)
    return {cls.kind: cls(env) for cls in classes}

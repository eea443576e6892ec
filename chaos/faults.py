"""Faults as data: one frozen dataclass per kind of fault, with its target and parameters.

A fault says *what* goes wrong, never how: the injectors (chaos/injectors/) know how to cause
it and how to heal it. Keeping faults as plain values makes a schedule printable, comparable
and reproducible from its seed, and lets the history record exactly what was asked for.

Targets name workers the way an operator would before looking at the cluster:
  "one"       one worker, picked at injection time by the schedule's seeded generator
  "minority"  floor((n-1)/2) workers (at least one): a quorum always survives
  "all"       every worker of the current generation
  "rank:K"    the worker with rank K in the current generation
For node faults the target picks workers the same way and hits the nodes that host them.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar

_TARGET_RE = re.compile(r"^(one|minority|all|rank:\d+)$")

# Recovery causes written by the runtime into summary.json (elastic.policies.INFRA_CAUSES);
# repeated here because chaos/ drives the runtime from outside and does not import it.
LOST_WORKER_CAUSES = ("worker_died", "node_lost", "hang", "collective_error", "partition")


def _check_target(target: str) -> None:
    if not _TARGET_RE.match(target):
        raise ValueError(f"fault target {target!r}: use 'one', 'minority', 'all' or 'rank:K'")


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name}={value}: must be > 0")


@dataclass(frozen=True)
class Expectation:
    """What the run must show for a fault: `required` recoveries with one of `causes`,
    `optional` ones that may appear, or (`fails_run`) the run failing with a typed error."""

    required: bool
    causes: tuple[str, ...] = ()
    fails_run: bool = False


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Base of every fault. `kind` names it in schedules, histories and reports."""

    kind: ClassVar[str] = "fault"
    duration_s: float = 0.0          # how long the fault lasts before its heal; 0: instantaneous

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=False)

    def describe(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if getattr(self, f.name) != f.default)
        return f"{self.kind}({fields})"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass(frozen=True, kw_only=True)
class KillWorker(Fault):
    """SIGKILL to worker processes: a crash with no warning."""

    kind: ClassVar[str] = "kill_worker"
    target: str = "one"

    def __post_init__(self) -> None:
        _check_target(self.target)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=True, causes=("worker_died", "collective_error", "hang"))


@dataclass(frozen=True, kw_only=True)
class KillAllWorkers(KillWorker):
    """SIGKILL to every worker of the generation at once: a job-wide crash (the OOM killer on
    every node, a bad driver or library release). The workers' copies in memory die with them;
    the nodes' keepers still hold theirs, so the recovery restores from memory, not storage."""

    kind: ClassVar[str] = "kill_all_workers"
    target: str = "all"

    def __post_init__(self) -> None:
        if self.target != "all":
            raise ValueError(f"kill_all_workers kills every worker (target 'all'), got target {self.target!r}; "
                             f"use kill_worker for others")


@dataclass(frozen=True, kw_only=True)
class KillController(Fault):
    """SIGKILL to the run's controller process (status.json names it), while its generation runs.
    Ray restarts the controller, which adopts the live workers: no recovery is expected, no
    worker may be restarted by it, and no step lost or redone."""

    kind: ClassVar[str] = "kill_controller"


@dataclass(frozen=True, kw_only=True)
class KillDriver(Fault):
    """SIGKILL to the job's driver process alone (not its process group: the run's own local Ray
    lives in that group), while the run trains. The run goes on without a driver; the campaign
    starts the same job again, which attaches to the live run and exits with its status. No
    recovery is expected: the driver takes no part in training."""

    kind: ClassVar[str] = "kill_driver"


@dataclass(frozen=True, kw_only=True)
class KillNode(Fault):
    """A whole Ray node leaves the cluster (all its processes die); the heal adds a fresh node,
    the way an autoscaler replaces a lost machine."""

    kind: ClassVar[str] = "kill_node"
    target: str = "one"

    def __post_init__(self) -> None:
        _check_target(self.target)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=True, causes=("node_lost", "worker_died", "collective_error", "hang"))


@dataclass(frozen=True, kw_only=True)
class Hang(Fault):
    """SIGSTOP for `duration_s`, then SIGCONT: a frozen process (swapping VM, debugger, GC)."""

    kind: ClassVar[str] = "hang"
    target: str = "one"
    duration_s: float = 15.0

    def __post_init__(self) -> None:
        _check_target(self.target)
        _check_positive("duration_s", self.duration_s)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        # A freeze shorter than the heartbeat timeout (with a margin for a loaded machine) is
        # allowed to go unnoticed; a longer one must be detected and recovered.
        required = self.duration_s >= heartbeat_timeout_s + 3.0
        return Expectation(required=required, causes=("hang", "collective_error", "worker_died"))


@dataclass(frozen=True, kw_only=True)
class BitFlip(Fault):
    """One bit of one parameter flipped in a worker's memory (its mantissa or sign: a plausible
    number that trains on), through the job's --bitflip-requests hook: silent data corruption.
    The replicas' fingerprints must disagree at the next step, the recovery (cause `sdc`) must
    name the flipped rank (with two replicas both are suspects), and the run must roll back to a
    state from before it, so the final model still matches the reference."""

    kind: ClassVar[str] = "bitflip"
    target: str = "one"

    def __post_init__(self) -> None:
        _check_target(self.target)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=True, causes=("sdc",))


@dataclass(frozen=True, kw_only=True)
class BadGradient(Fault):
    """A worker's backward computes a wrong gradient from now on (one bit of one element of one
    parameter's gradient flipped, before the all-reduce, in every backward of its generation),
    through the job's --bitflip-requests hook: a compute fault, which the all-reduce hands to
    every replica, so the parameters still agree. The spot check (FailureConfig.
    spot_check_every_n_steps) must find it, the recovery (cause `sdc`) name the rank, and the run
    roll back to before the fault, so the final model still matches the reference."""

    kind: ClassVar[str] = "bad_gradient"
    target: str = "one"

    def __post_init__(self) -> None:
        _check_target(self.target)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=True, causes=("sdc",))


@dataclass(frozen=True, kw_only=True)
class Slow(Fault):
    """CPU stolen for `duration_s`: SIGSTOP/SIGCONT duty cycles, stopped `stopped_share` of
    every `period_s`. A straggler, not a failure: no recovery needed unless the runtime evicts it."""

    kind: ClassVar[str] = "slow"
    target: str = "one"
    duration_s: float = 10.0
    stopped_share: float = 0.7
    period_s: float = 0.2

    def __post_init__(self) -> None:
        _check_target(self.target)
        _check_positive("duration_s", self.duration_s)
        _check_positive("period_s", self.period_s)
        if not 0 < self.stopped_share < 1:
            raise ValueError(f"stopped_share={self.stopped_share}: must be between 0 and 1")

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=False, causes=("straggler", "hang", "collective_error"))


@dataclass(frozen=True, kw_only=True)
class Partition(Fault):
    """The network link of the target workers' nodes is cut for `duration_s`, then restored."""

    kind: ClassVar[str] = "partition"
    target: str = "one"
    duration_s: float = 20.0

    def __post_init__(self) -> None:
        _check_target(self.target)
        _check_positive("duration_s", self.duration_s)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=self.duration_s >= heartbeat_timeout_s + 3.0,
                           causes=LOST_WORKER_CAUSES)


@dataclass(frozen=True, kw_only=True)
class StorageOutage(Fault):
    """Object storage refuses writes (HTTP 503 to PUT/POST/DELETE) for `duration_s`.
    Saves may be retried, fail and be counted, or surface as `storage_error`: none is required."""

    kind: ClassVar[str] = "storage_outage"
    duration_s: float = 8.0

    def __post_init__(self) -> None:
        _check_positive("duration_s", self.duration_s)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=False, causes=("storage_error",))


@dataclass(frozen=True, kw_only=True)
class StorageStall(Fault):
    """Object storage stalls: every request, reads and writes, hangs for `duration_s` and then
    goes through (S3 stalls of about 55 s have been seen). Nothing may be judged hung for it:
    storage calls stay off the paths that judge the workers, and the run lease, renewed on its own
    thread, outlasts a stall shorter than its staleness bound. With `kill`, one worker is
    SIGKILLed once the stall has begun, so that the recovery's re-form (its fence, its listing)
    runs inside the stall: that recovery is due, with the killed worker's cause."""

    kind: ClassVar[str] = "storage_stall"
    duration_s: float = 20.0
    kill: bool = False

    def __post_init__(self) -> None:
        _check_positive("duration_s", self.duration_s)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=self.kill, causes=("worker_died",))


@dataclass(frozen=True, kw_only=True)
class CrashBeforeCommit(Fault):
    """Rank 0 is killed while a step directory holds shards but no COMMITTED manifest: the
    half-written checkpoint must never be loaded. Waits up to `within_s` for such a moment."""

    kind: ClassVar[str] = "crash_before_commit"
    within_s: float = 30.0

    def __post_init__(self) -> None:
        _check_positive("within_s", self.within_s)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=True, causes=("worker_died", "collective_error", "hang"))


@dataclass(frozen=True, kw_only=True)
class CorruptCheckpoint(Fault):
    """Bytes flipped in a shard of the newest committed checkpoint (once an older one exists).
    With `force_load`, every worker is then killed. With `kill_keepers` too, the run's node
    keepers die with them, so the next restore must read storage and meet the rotted checkpoint
    first: it must fall back to an older one (the storage campaigns' point). Without, the keepers
    answer the kill-all from memory, as they answer `kill_all_workers`: no checkpoint is read, and
    the rotted one is found by the final verification (the `mixed` campaign's choice: a job-wide
    crash beside a rotted commit costs what a kill costs)."""

    kind: ClassVar[str] = "corrupt_checkpoint"
    force_load: bool = True
    kill_keepers: bool = True
    within_s: float = 60.0           # wait this long for two committed checkpoints to exist

    def __post_init__(self) -> None:
        _check_positive("within_s", self.within_s)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=self.force_load,
                           causes=("worker_died", "collective_error", "hang", "node_lost"))


@dataclass(frozen=True, kw_only=True)
class Preempt(Fault):
    """SIGTERM to a worker: a preemption notice (spot reclaim, node drain)."""

    kind: ClassVar[str] = "preempt"
    target: str = "one"

    def __post_init__(self) -> None:
        _check_target(self.target)

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=True, causes=("preempted", "worker_died"))


@dataclass(frozen=True, kw_only=True)
class UserError(Fault):
    """The user's loop raises on `rank` at `step` (first generation only). Armed when the job
    starts (`--fail-at RANK:STEP` of the main job), not signalled: the run must fail fast with
    the user's exception, naming the rank."""

    kind: ClassVar[str] = "user_error"
    rank: int = 0
    step: int = 100

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 1:
            raise ValueError(f"user_error rank={self.rank} step={self.step}: rank >= 0 and step >= 1")

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=True, causes=("user_error",), fails_run=True)


LATE_COMMIT_PHASES = ("check", "put")


@dataclass(frozen=True, kw_only=True)
class LateCommit(Fault):
    """A fenced writer's late commit: a zombie of the current generation's rank 0 (a separate
    process, the checkpointing package's own save path) writes a checkpoint of a step the run
    has not reached, then stalls at its commit while the target workers are killed and the run
    re-forms under a newer generation; then it tries to commit. `phase` is where it stalls:
      "check"  before the commit's final fence check: the commit must be refused (FencedError)
      "put"    after that check passed, with its COMMITTED PUT on the wire, until the newer
               generation has committed the same step (at most `within_s`): the conditional
               PUT must fail and the commit be refused (FencedError); if the newer generation
               never gets there in time, the PUT goes out anyway and the late manifest must be
               ignored by every reader and collector (the fence history rejects it)
    Either way the zombie's own retention pass must delete nothing, and a newer generation's
    manifest must never be replaced. The kill makes the new generation, so a recovery is due."""

    kind: ClassVar[str] = "late_commit"
    target: str = "one"
    phase: str = "check"
    within_s: float = 90.0           # for the zombie to start, the fence to move and (put) the newer commit

    def __post_init__(self) -> None:
        _check_target(self.target)
        _check_positive("within_s", self.within_s)
        if self.phase not in LATE_COMMIT_PHASES:
            raise ValueError(f"late_commit phase={self.phase!r}: use one of {LATE_COMMIT_PHASES}")

    def expectation(self, heartbeat_timeout_s: float) -> Expectation:
        return Expectation(required=True, causes=("worker_died", "collective_error", "hang"))


@dataclass(frozen=True, kw_only=True)
class SecondRun(Fault):
    """The job started a second time on the same storage while the first run is live, with
    another configuration (its seed: the same configuration attaches to the live run and follows
    it to its end, as a resubmitted job should). The second must exit non-zero within
    `within_s` with the run lease's RunConflictError naming the live run, having written
    nothing; the first run must go on as if nothing happened (same lease holder, same
    generation, still training). No recovery is expected."""

    kind: ClassVar[str] = "second_run"
    within_s: float = 120.0          # a refused start still imports torch and the runtime

    def __post_init__(self) -> None:
        _check_positive("within_s", self.within_s)


FAULT_TYPES: dict[str, type[Fault]] = {cls.kind: cls for cls in (
    KillWorker, KillAllWorkers, KillController, KillDriver, KillNode, Hang, Slow, Partition, StorageOutage,
    StorageStall, CrashBeforeCommit, CorruptCheckpoint, Preempt, UserError, LateCommit, SecondRun, BitFlip,
    BadGradient)}


def fault_from_dict(data: dict[str, Any]) -> Fault:
    data = dict(data)
    kind = data.pop("kind")
    try:
        cls = FAULT_TYPES[kind]
    except KeyError:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(sorted(FAULT_TYPES))}") from None
    return cls(**data)

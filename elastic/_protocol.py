"""Messages exchanged between the controller and the workers (plain, picklable dataclasses)."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.config import CheckpointConfig, FailureConfig, LRScalingConfig, ScalingConfig

# The per-rank compute times of a step (straggler scores, metrics.jsonl's `compute_s`): up to
# this many ranks every rank's step record carries them (N² floats a step: 256 at 16), so that a
# step's metrics line has them whichever rank's record the controller takes first. Above it only
# rank 0's does (every rank's would send the controller 906 MB a step at 10,000 ranks), and the
# lines carry them on every k-th step, k = ceil(N / this): about this many floats per line.
COMPUTE_TIMES_PER_LINE = 16


class WorkerPhase(enum.StrEnum):
    IDLE = "idle"                # process up, in no group
    RUNNING = "running"          # train_loop runs in generation `generation`
    INTERRUPTED = "interrupted"  # left the loop (rescale request or broken group); state kept in memory
    FINISHED = "finished"        # train_loop returned after total_steps
    FAILED = "failed"            # train_loop raised a user-code error


@dataclass(frozen=True)
class StepRecord:
    """One completed step (the source of metrics.jsonl).

    Every rank builds it from the step's all-gathered values, so any rank can tell the controller
    of a step whose rank 0 died before it was polled.
    """

    step: int
    loss: float | None
    world_size: int
    time: float
    samples_seen: int
    global_batch: int
    metrics: dict[str, float] = field(default_factory=dict)
    compute_s: tuple[float, ...] = ()      # every rank's own compute time of the step, by rank
    data_order: str | None = None          # data-order hash after this step (see _state.chain_sample_ids)
    generation: int = 0                    # the generation that ran the step
    accum_steps: int = 1                   # micro-batches per rank in this step (constant_global_batch)
    # "step": a completed step (counts one); "log": `ctx.log(...)` values recorded at `step`,
    # counting no step (validation metrics). Only one rank's log record of a step is kept.
    kind: str = "step"
    # Durations measured on the rank that built the record (no clock is compared across nodes),
    # for the run's time ledger (elastic._controller.time_ledger): the seconds its report() was
    # blocked saving a checkpoint since its previous step, and, on a generation's first step,
    # the seconds its ctx.restore took.
    checkpoint_stall_s: float = 0.0
    restore_s: float = 0.0


@dataclass(frozen=True)
class WorkerReport:
    """A worker's answer to a poll."""

    phase: WorkerPhase
    generation: int
    rank: int | None
    step: int                      # steps completed by the state held in memory
    has_state: bool                # model/optimizer state of `step` is in memory (warm source)
    records: list[StepRecord]      # steps this rank completed since the previous poll (every rank)
    error_type: str | None = None
    error_message: str | None = None
    error_traceback: str | None = None
    error_kind: str | None = None        # see elastic._worker.worker.classify_error
    error: BaseException | None = None   # the original exception when it pickles
    preempted: bool = False              # got SIGTERM: leaves after committing a checkpoint
    restored_step: int | None = None     # step ctx.restore loaded in this generation
    checkpoint_fallbacks: list[dict] = field(default_factory=list)   # committed steps skipped on load
    model_sha256: str | None = None
    resumed_from: int | None = None
    samples_seen: int = 0                # global samples consumed by the state in memory
    data_order: str | None = None        # its data-order hash
    replicas: ReplicaHeld | None = None  # FSDP: the shards this worker holds copies of (in host memory)
    position: PositionReport | None = None   # where its training thread is (elastic._worker.thread_position)
    seq: int = 0                         # this answer's number (the next poll acknowledges it: state.Outbox)
    # (TP rank, TP degree) of the state in memory: under tensor parallelism a survivor is a warm
    # source only for the ranks of its own TP rank (elastic._controller.replica_arrangement).
    shard: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class PollFailure:
    """A worker's poll that ended without a WorkerReport, as the controller or the worker's node
    agent (elastic._controller.node_agent) saw it: its actor is gone (`actor_gone`), or the poll
    itself raised."""

    actor_gone: bool
    message: str               # the error's first line


class ThreadPlace(enum.StrEnum):
    """Where a rank's training thread is (elastic._worker.thread_position marks it)."""

    JOINING = "joining"        # forming the group, preparing the model, until ctx.restore
    RESTORING = "restoring"    # in ctx.restore, and the generation's first step after it
    COMPUTING = "computing"    # data, forward and backward of the step in hand
    PIPELINE = "pipeline"      # in a pipeline schedule's send/recv: waits for a neighbouring stage
    SYNC = "sync"              # backward done: in DDP's gradient all-reduce (waits for the others), then the optimizer
    EXCHANGE = "exchange"      # in the step boundary's all-gather: waits for the others
    BOUNDARY = "boundary"      # the exchange is over: the boundary's own work (checkpoint rules, copies)
    CHECKPOINT = "checkpoint"  # in a checkpoint save
    HELD = "held"              # in the tests' fault gate (elastic._worker.fault_gate)


@dataclass(frozen=True)
class PositionReport:
    """Where a rank's training thread was when it answered a poll. Ages are measured on the
    worker's own monotonic clock: the controller compares them with its receive times, never
    with another node's clock."""

    generation: int
    place: ThreadPlace
    step: int                  # steps completed when it got there: the step in hand is step + 1
    nth: int                   # index of the step in hand within the generation (1: its first)
    age_s: float               # seconds it has been there
    step_times: tuple[float, ...] = ()   # its steps' durations since its previous answer (see thread_position)
    exchanged: int = 0         # the newest step whose exchange it has collected: every rank entered it
    # The step in hand follows boundary work (a checkpoint save, a copy to memory), whose
    # background part (an upload, a keeper's handover) shares the host with it; and the
    # durations of such steps since the previous answer, kept apart from `step_times`.
    after_work: bool = False
    after_work_times: tuple[float, ...] = ()


@dataclass(frozen=True)
class ReplicaHeld:
    """The FSDP shards one worker holds in host memory (elastic._worker.replicas): the state of
    ranks `ranks` of generation `generation` (of `world_size` ranks) after step `step`."""

    generation: int
    world_size: int
    step: int
    ranks: tuple[int, ...]


class RestoreKind(enum.StrEnum):
    """Where a generation's state comes from (the rungs of the recovery ladder, seen by a rank)."""

    FRESH = "fresh"            # nothing to load: step 0
    BROADCAST = "broadcast"    # a survivor's memory (warm)
    MEMORY = "memory"          # FSDP: the shards' copies in the members' host memory, resharded
    CHECKPOINT = "checkpoint"  # the newest committed checkpoint


@dataclass(frozen=True)
class ReplicaSource:
    """A MEMORY restore's sources: the shards of the `world_size` ranks of generation
    `generation`, rank j's held by the new generation's rank `holders[j]`; with `keepers`, rank
    j's copy is in the node keeper named `keepers[j]` (elastic._node_keeper), which rank
    `holders[j]` fetches it from (the workers that held the copies were lost)."""

    generation: int
    world_size: int
    holders: tuple[int, ...]
    keepers: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestorePlan:
    """How ranks of a new generation obtain their state in `ctx.restore`."""

    kind: RestoreKind
    source_rank: int | None = None
    step: int = 0
    replica: ReplicaSource | None = None       # MEMORY: who holds which old rank's shards
    reason: str = ""                           # why this rung (the recovery record says it)
    # BROADCAST: the new ranks that hold the full state of `step` (each sends a slice, and
    # receives nothing: elastic._worker.warm_slices); `source_rank` is the first of them.
    # Empty: `source_rank` alone (a plan of an earlier controller).
    sources: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RestoreKind(self.kind))

    @property
    def warm_sources(self) -> tuple[int, ...]:
        """BROADCAST: the ranks that hold the state and send it, in slice order."""
        if self.sources:
            return self.sources
        return (self.source_rank,) if self.source_rank is not None else ()


@dataclass(frozen=True)
class GenerationPlan:
    """Everything a worker needs to join generation `generation` as `rank`."""

    generation: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    restore: RestorePlan
    timeout_s: float
    # Placement within the group, as torchrun names it: ranks on this rank's node, this rank's
    # index among them, and its node's index among the group's nodes (in rank order).
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    # Where FSDP's copies in memory go (elastic._worker.replicas): rank r's copy to the rank
    # `copy_shift` replicas on, around the data-parallel ring; chosen so that it lands on another
    # node when the group spans nodes (copy_shift).
    copy_shift: int = 1


COPY_SHIFTS_TRIED = 64   # the steps copy_shift weighs: a node's replicas, up to this many


def copy_shift(infos: list[WorkerInfo | None], replica_size: int = 1) -> int:
    """The step of the copies' ring, in replicas: the smallest s for which every rank's copy
    (at the same place, s replicas on) is held on another node than its own, so that losing one
    node never loses a shard with its only copy (Gemini, SOSP'23, places them so). Where ranks
    sit node by node (a group that grew onto a new node, a scheduler that packs), the ring's
    plain step of one keeps every copy but a node's last on its own node; where they alternate
    between nodes, one is right. Where no step places every copy elsewhere (one node, uneven
    nodes), the step that places the most does (the smallest of those). Steps up to
    COPY_SHIFTS_TRIED are weighed, each in one pass over the ranks: the controller computes this
    at every generation start, at up to 10,000 ranks. A member whose node is not known yet
    counts as a node of its own."""
    nodes = [info.node_id if info is not None else f"?{rank}" for rank, info in enumerate(infos)]
    world = len(nodes)
    replicas = world // replica_size if replica_size > 0 and world % replica_size == 0 else 0
    best, best_apart = 1, -1
    for shift in range(1, min(replicas, COPY_SHIFTS_TRIED + 1)):
        step = shift * replica_size
        apart = sum(nodes[rank] != nodes[(rank + step) % world] for rank in range(world))
        if apart == world:
            return shift
        if apart > best_apart:
            best, best_apart = shift, apart
    return best


def placement(infos: list[WorkerInfo | None]) -> list[dict[str, int]]:
    """GenerationPlan's placement fields of each rank, from the members' nodes in rank order:
    nodes are numbered by their first rank, ranks within a node by rank. A member whose node is
    not known yet counts as a node of its own."""
    nodes: dict[str, list[int]] = {}
    for rank, info in enumerate(infos):
        nodes.setdefault(info.node_id if info is not None else f"?{rank}", []).append(rank)
    places: list[dict[str, int]] = [{} for _ in infos]
    for node_rank, ranks in enumerate(nodes.values()):
        for local_rank, rank in enumerate(ranks):
            places[rank] = {"local_rank": local_rank, "local_world_size": len(ranks), "node_rank": node_rank}
    return places


@dataclass(frozen=True)
class WorkerInfo:
    pid: int
    node_id: str
    actor_id: str
    ip: str


@dataclass(frozen=True)
class RunSpec:
    """What every worker needs to know about the run (sent once, at actor creation).

    The user's loop and its config travel pickled, as bytes only workers load: the controller
    passes the spec on without importing torch or whatever the user's code imports."""

    user_code: bytes                           # cloudpickle of (train_loop, train_loop_config)
    total_steps: int
    seed: int
    # The run's configs whole: a rank reads each setting where the user set it, so a new field
    # reaches the ranks with no edit here.
    scaling: ScalingConfig
    checkpoint: CheckpointConfig
    failure: FailureConfig
    lr: LRScalingConfig | None = None
    # The driver's storage credentials (AWS_ACCESS_KEY_ID, ...): an actor argument, which Ray does
    # not display, unlike runtime_env (see elastic._credentials). Each actor applies them first.
    storage_env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def in_memory_every(self) -> int | None:
        """Steps between the copies of the state in host memory (elastic._worker.replicas): FSDP's,
        with or without tensor parallelism (FSDP x TP: the ring runs within each TP rank's
        data-parallel group); DDP's under FailureConfig.sdc_check, each rank's own copy of its
        replica, taken at steps whose fingerprints agreed: what a silent corruption rolls back to
        (a survivor's live state may have trained on the corrupt rank's gradients). None: no
        copies (HSDP and DDP without the check do not take them)."""
        if self.scaling.strategy == "fsdp" or (self.scaling.strategy == "ddp" and self.failure.sdc_check):
            return self.checkpoint.in_memory_every_n_steps
        return None

    def kept_through(self, newest: int) -> int:
        """The newest step that no recovery with a survivor or a copy in memory takes back, once
        step `newest` completed: what a tracker may record for good (the feed's KEPT events,
        elastic.callbacks). A committed checkpoint keeps its step too (the recorder takes the
        larger). Only a recovery that falls back to storage goes further back.

        - No copies in memory (DDP without the corruption check, HSDP): a survivor's state is
          the newest step's; one step of margin for a step whose record a dying rank sent.
        - FSDP without copies: every lost rank goes back to storage; 0 (commits only).
        - Copies every K steps: the newest multiple of K before `newest` (the copy of a step is
          taken at its boundary, before the next step runs).
        - DDP's spot check every C steps: a compute corruption rolls back to a copy from before
          the last passed check, the newest multiple of C before `newest` (elastic._worker.spot_check)."""
        every = self.in_memory_every
        if every is None:
            return 0 if self.scaling.strategy == "fsdp" else max(0, newest - 1)
        verified = newest - 1
        checks = self.failure.spot_check_every_n_steps
        if self.scaling.strategy == "ddp" and self.failure.sdc_check and checks:
            verified -= verified % checks
        return max(0, verified - verified % every)

    def checkpoint_due(self, step: int) -> bool:
        """Whether the boundary after step `step` saves a scheduled checkpoint (the final
        commit comes with the run's end instead)."""
        every = self.checkpoint.every_n_steps
        return every is not None and step % every == 0

    def copy_due(self, step: int) -> bool:
        """Whether the boundary after step `step` takes the copies in host memory (in_memory_every)."""
        every = self.in_memory_every
        return every is not None and step % every == 0

    def keeps_state_at(self, step: int) -> bool:
        """Whether the state after step `step` is kept (a checkpoint, a copy in memory, or the
        final commit): what the replicas must have agreed on (the fingerprint after the update)."""
        return step == self.total_steps or self.checkpoint_due(step) or self.copy_due(step)

    def apply_storage_env(self) -> None:
        """Put the run's storage credentials in this process's environment (before any storage
        client is made: botocore reads them then)."""
        from elastic._credentials import apply_env
        apply_env(self.storage_env)

    def load_user_code(self) -> tuple[Callable[..., Any], Any]:
        """(train_loop, train_loop_config), unpickled in the calling process: a worker's first
        use of its spec, so the storage credentials are set here too, before the user's code
        (or anything after it) opens storage."""
        import ray.cloudpickle
        self.apply_storage_env()
        return ray.cloudpickle.loads(self.user_code)

"""What a worker keeps across generations, in named parts.

A generation's `TrainContext` is discarded at every rescale; what outlives it is here:
- `Progress` (elastic._worker.train_state): the framework's counters, identical on every rank;
- `WarmSource`: the last generation's state, offered to the next one (warm recovery);
- `CheckpointSession` (elastic._worker.checkpoint_session): the checkpoint manager and what this rank
  knows of its saves and loads;
- `ReplicaStore` (elastic._worker.replicas): FSDP's copies of this rank's and its neighbour's state;
- `Outbox`: step records waiting for the controller's poll, and the event that wakes a held poll;
- the run's Ray names (elastic._run_names), by which the ranks find the actors that hold the run's
  Ray Datasets (elastic._worker.ray_data).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic._node_keeper import CopyHandover
from elastic._protocol import StepRecord
from elastic._run_names import RunNames
from elastic._worker.checkpoint_session import CheckpointSession
from elastic._worker.replicas import ReplicaStore
from elastic._worker.train_state import Progress

if TYPE_CHECKING:
    from elastic._worker.train_state import TrainState

RECORDS_KEPT = 10_000   # step records a rank holds until polled (bounded if the controller stalls)
ANSWERS_KEPT = 8        # answers a rank can send again when the controller says it never got them
# Step records a rank keeps after they were polled, for a controller that replaced a lost one: the
# lost one's journal (elastic._controller.journal) may be a few seconds older than its last poll,
# and the steps it took meanwhile are replayed from here (Outbox.replay).
HISTORY_KEPT = 4096


@dataclass
class WarmSource:
    """The state this rank can broadcast to a re-formed group (DDP: full state on every rank)."""

    state: TrainState | None = None
    capable: bool = False                      # `state` holds the full state (not FSDP shards)
    restored: tuple[int, int] | None = None    # (generation, step) of the last ctx.restore
    shard: tuple[int, int] = (0, 1)            # (TP rank, TP degree) of `state`: which shard it holds

    @property
    def available(self) -> bool:
        return self.capable and self.state is not None


@dataclass
class Outbox:
    """Step records not yet polled; the poll takes them under `lock` (`answer`).

    Each answer is numbered (`seq`). A poll that says which answer the controller received last
    (`acked`) gets the records of the answers after it again, before the new ones: a node agent
    (elastic._controller.node_agent) that dies holding an answer it took from this worker loses
    nothing, since the next poll, from whoever polls next, carries the controller's older
    `acked`. The controller takes each step once (ReportIntake), so a record sent twice counts
    once; one that reached it is never sent again (its answer was acknowledged)."""

    records: list[StepRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    news: threading.Event = field(default_factory=threading.Event)   # wakes a held poll
    seq: int = 0                                                      # the newest answer's number
    unacked: list[tuple[int, list[StepRecord]]] = field(default_factory=list)   # (seq, its records)
    history: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=HISTORY_KEPT))   # polled or not

    def put(self, record: StepRecord) -> None:
        with self.lock:
            self.records.append(record)
            del self.records[:-RECORDS_KEPT]
            self.history.append(record)

    def drain(self) -> list[StepRecord]:
        with self.lock:
            records, self.records = self.records, []
        return records

    def answer(self, acked: int | None = None) -> tuple[int, list[StepRecord]]:
        """The records for a poll's answer (drained), and that answer's number. With `acked`,
        first those of the answers after `acked` (kept until acknowledged, the newest ANSWERS_KEPT)."""
        with self.lock:
            records, self.records = self.records, []
            self.seq += 1
            if acked is None:
                return self.seq, records
            self.unacked = [(seq, sent) for seq, sent in self.unacked if seq > acked][-(ANSWERS_KEPT - 1):]
            again = [record for _, sent in self.unacked for record in sent]
            self.unacked.append((self.seq, records))
            return self.seq, again + records

    def replay(self, after_step: int) -> list[StepRecord]:
        """For a controller that adopts this rank: the records of the steps after `after_step`
        (those its journal does not hold), polled or not, in the order they came. Everything
        pending is handed over with them: the next poll carries only newer records."""
        with self.lock:
            self.records, self.unacked = [], []
            return [record for record in self.history if record.step > after_step]

    def drop_after(self, step: int) -> None:
        """Steps past `step` were lost with a failure: never report them."""
        with self.lock:
            self.records = [r for r in self.records if r.step <= step]
            self.unacked = [(seq, [r for r in sent if r.step <= step]) for seq, sent in self.unacked]
            self.history = deque((r for r in self.history if r.step <= step), maxlen=HISTORY_KEPT)


@dataclass
class WorkerState:
    """Per-worker state that outlives a generation."""

    progress: Progress = field(default_factory=Progress)
    warm: WarmSource = field(default_factory=WarmSource)
    checkpoints: CheckpointSession = field(default_factory=CheckpointSession)
    outbox: Outbox = field(default_factory=Outbox)
    replicas: ReplicaStore = field(default_factory=ReplicaStore)
    grad_scaler: Any = None                    # fp16: the framework's torch.amp.GradScaler
    spot_verified: int = 0                     # the newest step whose spot check passed (elastic._worker.spot_check)
    run_names: RunNames | None = None          # the run's (None: a context built outside a run, e.g. a benchmark)
    # Hands this rank's copies in memory to its node's keeper, which outlives the workers
    # (elastic._node_keeper); made with the first copy of a run's worker.
    copy_handover: CopyHandover | None = None

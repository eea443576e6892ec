"""Named scenarios: a schedule builder plus the job and cluster shape it is meant for.

Every scenario is a function of the seed: `SCENARIOS[name].schedule(seed)` always gives the same
faults at the same times. Default shapes keep min == max workers, so recoveries restore the
same world size and the final model can be compared with a fault-free reference run (the
runtime guarantees equal model_sha256 for an equal layout history: world size, TP and PP degrees
at every step); `--workers` overrides that, and the comparison is then skipped whenever the
layouts differ.

A scenario with `tensor_parallel` T > 1 runs the job with `--tp T`, one with `pipeline_parallel`
P > 1 with `--pp P`: its workers (and spares) count ranks and come in whole replicas of T x P
ranks (a replica is a pipeline of P stages of T ranks), so MIN, MAX and `spare_workers` are
multiples of T x P (checked here, and for a `--workers` override by the runner).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from chaos.faults import (
    BadGradient,
    BitFlip,
    CorruptCheckpoint,
    CrashBeforeCommit,
    Hang,
    KillAllWorkers,
    KillController,
    KillDriver,
    KillNode,
    KillWorker,
    LateCommit,
    Partition,
    Preempt,
    SecondRun,
    Slow,
    StorageOutage,
    StorageStall,
    UserError,
)
from chaos.schedule import Schedule, fixed, randomized


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    description: str
    build: Callable[[Scenario, int], Schedule]
    steps: int                                # default --steps: long enough for the schedule
    workers: str = "3:3"
    checkpoint_every: int = 25
    heartbeat_timeout_s: float = 10.0
    model_size: str = "tiny"
    strategy: str = "ddp"                     # the job's --strategy
    tensor_parallel: int = 1                  # the job's --tp T: replicas of T ranks
    pipeline_parallel: int = 1                # the job's --pp P: replicas are pipelines of P stages (T x P ranks)
    spare_workers: int = 0                    # the job's --spare-workers (hot spares, in ranks)
    cpus_per_worker: float | None = None      # the job's --cpus-per-worker (None: the job's default, 1)
    nodes: int | None = None                  # runner-owned Ray cluster of this many 1-CPU nodes
    namespaced: bool = False                  # ... each node in its own network namespace
    restarts: int = 0                         # job restarts allowed after a typed failure
    job_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        check_workers(self.workers, self.tensor_parallel, self.spare_workers, pp=self.pipeline_parallel,
                      what=f"scenario {self.name}")

    @property
    def min_workers(self) -> int:
        return parse_workers(self.workers)[0]

    def schedule(self, seed: int) -> Schedule:
        return self.build(self, seed)


def parse_workers(workers: str) -> tuple[int, int]:
    """MIN:MAX (or N, for N:N) as the job's --workers takes it."""
    low, _, high = workers.partition(":")
    return int(low), int(high or low)


def check_workers(workers: str, tp: int, spares: int = 0, *, pp: int = 1, what: str) -> None:
    """ValueError unless MIN, MAX and the spares are whole replicas of `tp` x `pp` ranks (the
    runtime's ScalingConfig refuses anything else with a ConfigError, once the job has started)."""
    for name, degree in (("tensor_parallel", tp), ("pipeline_parallel", pp)):
        if degree < 1:
            raise ValueError(f"{what}: {name} must be at least 1, not {degree}")
    unit = tp * pp
    low, high = parse_workers(workers)
    bad = {name: n for name, n in (("min", low), ("max", high), ("spare", spares)) if n % unit}
    if bad:
        flags = " ".join(f"--{flag} {degree}" for flag, degree in (("tp", tp), ("pp", pp)) if degree > 1)
        raise ValueError(f"{what}: with {flags} the workers come in replicas of {unit} ranks; "
                         + ", ".join(f"{name} {n}" for name, n in bad.items()) + f" is not a multiple of {unit}")


def _spread(rng: random.Random, faults: list, gap_s: float, start_s: float = 3.0) -> list:
    """(time, fault) pairs about `gap_s` apart, jittered by the seed."""
    t, out = start_s, []
    for fault in faults:
        out.append((round(t, 2), fault))
        t += rng.uniform(0.7 * gap_s, 1.3 * gap_s)
    return out


def _smoke(sc: Scenario, seed: int) -> Schedule:
    rng = random.Random(seed)
    hb = sc.heartbeat_timeout_s
    faults = [KillWorker(target="one"), Preempt(target="one"), Hang(target="one", duration_s=hb + 6),
              CrashBeforeCommit(within_s=20), CorruptCheckpoint(force_load=True), StorageOutage(duration_s=4),
              KillNode(target="one")]
    return fixed(_spread(rng, faults, gap_s=3.0), seed=seed)


def _kill_storm(sc: Scenario, seed: int) -> Schedule:
    menu = [(3.0, lambda r: KillWorker(target="one")), (1.0, lambda r: KillWorker(target="minority"))]
    return randomized(seed, menu, count=12, mean_interval_s=5.0, min_interval_s=1.5, start_s=5.0,
                      wait_for_recovery=False)


def _hang(sc: Scenario, seed: int) -> Schedule:
    hb = sc.heartbeat_timeout_s
    menu = [(3.0, lambda r: Hang(target="one", duration_s=round(r.uniform(hb + 4, hb + 12), 1))),
            (1.0, lambda r: Hang(target="one", duration_s=round(r.uniform(0.5, hb / 2), 1)))]
    return randomized(seed, menu, count=5, mean_interval_s=12.0, jitter=0.3, start_s=5.0)


def _sdc(sc: Scenario, seed: int) -> Schedule:
    # Mostly bit flips (each must be found at the next step, its rank named and the run rolled
    # back) and wrong gradients (found by the next spot check, within spot_check_every_n_steps),
    # with kills among them so that rollbacks and warm recoveries interleave.
    # Few enough that at most one node is marked bad (two verdicts on one node's ranks): its
    # workers' replacements go to the others (5 one-CPU nodes for 3 workers).
    menu = [(2.0, lambda r: BitFlip(target="one")), (1.5, lambda r: BadGradient(target="one")),
            (1.0, lambda r: KillWorker(target="one"))]
    return randomized(seed, menu, count=4, mean_interval_s=10.0, jitter=0.3, start_s=5.0, cover_menu=True)


def _stragglers(sc: Scenario, seed: int) -> Schedule:
    menu = [(1.0, lambda r: Slow(target="one", duration_s=round(r.uniform(8, 15), 1),
                                 stopped_share=round(r.uniform(0.5, 0.85), 2)))]
    return randomized(seed, menu, count=4, mean_interval_s=18.0, jitter=0.3, start_s=5.0)


def _storage(sc: Scenario, seed: int) -> Schedule:
    rng = random.Random(seed)
    faults = [StorageOutage(duration_s=round(rng.uniform(4, 12), 1)), CrashBeforeCommit(),
              CorruptCheckpoint(), StorageOutage(duration_s=round(rng.uniform(4, 12), 1)),
              CrashBeforeCommit(), CorruptCheckpoint(), StorageOutage(duration_s=round(rng.uniform(4, 12), 1))]
    rng.shuffle(faults)
    return fixed(_spread(rng, faults, gap_s=12.0, start_s=5.0), seed=seed)


def _partition(sc: Scenario, seed: int) -> Schedule:
    hb = sc.heartbeat_timeout_s
    menu = [(1.0, lambda r: Partition(target="one", duration_s=round(r.uniform(hb + 5, hb + 15), 1)))]
    return randomized(seed, menu, count=3, mean_interval_s=20.0, jitter=0.3, start_s=5.0)


def _commit(sc: Scenario, seed: int) -> Schedule:
    # The second run first (the run's lease is held by then), then a zombie stalled before its
    # final fence check, then one stalled with its PUT past that check; the order of the two
    # zombies is the seed's. The PUT one comes with every worker killed: the new generation
    # restores a checkpoint from storage while the zombie's stale step is there, and then
    # commits that step itself before the zombie's PUT goes out.
    rng = random.Random(seed)
    zombies = [LateCommit(target="one", phase="check"), LateCommit(target="all", phase="put")]
    rng.shuffle(zombies)
    return fixed(_spread(rng, [SecondRun(), *zombies], gap_s=5.0), seed=seed)


def _storage_stall(sc: Scenario, seed: int) -> Schedule:
    # A stall with a worker killed inside it (the re-form fences and lists while storage hangs),
    # a longer one across the run lease's renewals, then a second run on the storage: the lease
    # renewed through the stalls must still refuse it. The stalls' lengths are the seed's.
    rng = random.Random(seed)
    faults = [StorageStall(duration_s=round(rng.uniform(15, 25), 1), kill=True),
              StorageStall(duration_s=round(rng.uniform(25, 35), 1)), SecondRun()]
    return fixed(_spread(rng, faults, gap_s=12.0, start_s=5.0), seed=seed)


# Kinds mixed leaves out: a bit flip needs replicas to be found (mixed-fsdp has none, and its
# corrupt model would train on), a wrong gradient the spot check (plain DDP only); the "sdc"
# scenario runs both on DDP.
NOT_IN_MIXED = ("bitflip", "bad_gradient")
MIXED_MENU = [
    (3.0, lambda r: KillWorker(target=r.choice(["one", "one", "minority"]))),
    (1.0, lambda r: KillAllWorkers()),
    (1.5, lambda r: KillNode(target="one")),
    (1.5, lambda r: Hang(target="one", duration_s=round(r.uniform(16, 24), 1))),
    (1.5, lambda r: Slow(target="one", duration_s=round(r.uniform(8, 15), 1),
                         stopped_share=round(r.uniform(0.5, 0.85), 2))),
    (1.5, lambda r: Preempt(target="one")),
    (1.5, lambda r: StorageOutage(duration_s=round(r.uniform(4, 12), 1))),
    (1.0, lambda r: StorageStall(duration_s=round(r.uniform(10, 25), 1), kill=r.random() < 0.5)),
    (1.0, lambda r: CrashBeforeCommit()),
    # The keepers outlive the kill-all: a job-wide crash beside a rotted commit restores from
    # memory (issue 35); the `storage` and `smoke` campaigns make the restore meet the rot.
    (1.0, lambda r: CorruptCheckpoint(kill_keepers=False)),
    (1.0, lambda r: Partition(target="one", duration_s=round(r.uniform(16, 24), 1))),
    (1.0, lambda r: LateCommit(target="one", phase=r.choice(["check", "put"]))),
    (0.5, lambda r: SecondRun()),
    (1.0, lambda r: KillController()),
    (1.0, lambda r: KillDriver()),
]


def _mixed(sc: Scenario, seed: int, count: int = 50) -> Schedule:
    # The user error comes first, alone (it is armed in the run's first generation): that
    # attempt fails fast with it, the runner restarts the job, which resumes from its last
    # checkpoint, and the campaign runs on the restarted job.
    # Its rank is any of the group's (seed % 3 on mixed's three workers).
    return randomized(seed, MIXED_MENU, count=count, mean_interval_s=25.0, jitter=0.2, start_s=10.0, cover_menu=True,
                      launch_faults=(UserError(rank=seed % sc.min_workers, step=3 * sc.checkpoint_every),))


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    # Two workers: the smallest elastic group, and cheap on a CI machine. The campaigns below run
    # three, where a changed reduction order would show in model_sha256 (G1 matched its reference).
    Scenario(name="smoke", description="one fault each of 7 kinds, a few seconds apart, on 2 workers and 3 nodes",
             build=_smoke, steps=800, workers="2:2", checkpoint_every=20, heartbeat_timeout_s=6.0, nodes=3,
             job_timeout_s=420),
    Scenario(name="kill-storm", description="12 SIGKILLs, ~5 s apart, landing during recoveries too",
             build=_kill_storm, steps=3000, job_timeout_s=600),
    Scenario(name="hang", description="5 SIGSTOP freezes: most outlast the heartbeat timeout, some do not",
             build=_hang, steps=3000, heartbeat_timeout_s=6.0),
    Scenario(name="sdc", description="bit flips in a worker's parameters and wrong gradients in its backward (silent "
                                     "data corruption) and a kill, on 3 DDP workers and 5 nodes: each found, its rank "
                                     "named, rolled back",
             build=_sdc, steps=1500, nodes=5),
    Scenario(name="stragglers", description="4 CPU-stealing duty cycles of 8-15 s on one rank (no recovery expected)",
             build=_stragglers, steps=2500),
    Scenario(name="storage", description="S3 write outages, crashes between shards and commit, rotted shards",
             build=_storage, steps=3500),
    Scenario(name="storage-stall", description="S3 stalls of every request (15-35 s), one with a worker killed "
                                               "inside it, then a second run on the storage",
             build=_storage_stall, steps=3000, workers="2:2"),
    Scenario(name="partition", description="3 link cuts of one node's network namespace, 15-25 s each",
             build=_partition, steps=3000, heartbeat_timeout_s=6.0, nodes=4, namespaced=True),
    Scenario(name="commit", description="attacks on the commit protocol: a second run on the storage, a fenced "
                                        "writer's late commit before and after its fence check",
             # Steps for minutes of training: the second run must find the first still live when
             # it reaches its lease check (after its imports and Ray start, tens of seconds here).
             build=_commit, steps=3000, workers="2:2", checkpoint_every=20, heartbeat_timeout_s=6.0,
             job_timeout_s=900),
    Scenario(name="mixed", description="a user error, then 50 faults of 13 kinds, one every 20-30 s",
             # Every 20 steps (a few seconds): each fault waits for a commit since the previous
             # one (the gate), so the interval bounds how close faults can come.
             build=_mixed, steps=2000, model_size="small", checkpoint_every=20, nodes=4, namespaced=True,
             restarts=4, job_timeout_s=3600),
    # The same faults on FSDP: a lost rank's shards come back from its neighbour's memory
    # (CheckpointConfig.in_memory_every_n_steps), two neighbours lost or a rotted shard take the
    # checkpoint; the invariants are the same.
    Scenario(name="mixed-fsdp", description="mixed's faults on an FSDP job (shards restored from peers' memory)",
             build=_mixed, steps=2000, model_size="small", checkpoint_every=20, nodes=4, namespaced=True,
             restarts=4, job_timeout_s=3600, strategy="fsdp"),
    # The same faults on tensor parallelism: two replicas of two ranks (min == max, so the layout
    # stays DP 2 x TP 2 and the model is compared with the reference's) and a spare replica. A
    # lost rank takes its replica out; a spare completes it at once, warm from the surviving
    # replica's same TP rank. Half a CPU per worker: the four one-CPU nodes of mixed host the six
    # workers two to a node with one node's room free for replacements (as mixed's three workers
    # on four nodes), and a node lost (a kill_node, a partition) is a machine lost with its two
    # ranks, a whole replica or one TP rank of each (then the checkpoint restores that TP rank).
    Scenario(name="mixed-tp", description="mixed's faults on a TP 2 job: 2 replicas of 2 ranks and a spare replica",
             build=_mixed, steps=2000, model_size="small", checkpoint_every=20, nodes=4, namespaced=True,
             restarts=4, job_timeout_s=3600, workers="4:4", tensor_parallel=2, spare_workers=2, cpus_per_worker=0.5),
    # The same faults on pipeline parallelism, in mixed-tp's shape: two pipelines of two stages
    # (the small model's 4 blocks, 2 a stage; 1F1B over 2 micro-batches, the job's defaults) and a
    # spare pipeline, half a CPU per worker on mixed's four nodes. A lost rank takes its pipeline
    # out (its other stage waits as a warm member); a spare pipeline completes it, each stage warm
    # from the same stage of the surviving pipeline. A stage stopped or cut off leaves its peer
    # stage waiting in a send or receive: the hang judge names the whole pipeline. A lost node
    # takes its two ranks: a whole pipeline, or one stage of each (then the checkpoint restores).
    Scenario(name="mixed-pp", description="mixed's faults on a PP 2 job: 2 pipelines of 2 stages and a spare pipeline",
             build=_mixed, steps=2000, model_size="small", checkpoint_every=20, nodes=4, namespaced=True,
             restarts=4, job_timeout_s=3600, workers="4:4", pipeline_parallel=2, spare_workers=2,
             cpus_per_worker=0.5),
)}

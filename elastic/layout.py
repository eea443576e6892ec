"""A run's layout of parallelism: how its ranks split into data-parallel replicas.

A replica is the set of ranks that together hold one copy of the model: `pp` pipeline stages of
`tp` tensor-parallel ranks each (1 x 1 for plain DDP or FSDP). The data-parallel degree `dp` is
what grows and shrinks, one replica at a time; `tp` and `pp` change only on a restore from a
checkpoint. TP is innermost, as torchtitan and Megatron order ranks, and DP outermost: rank r is
TP rank r % tp of stage (r // tp) % pp of replica r // (tp x pp). So a replica's ranks are
consecutive: a lost replica leaves one run of ranks, and the survivors keep their order.
(torchtitan puts pp outermost of all; here a whole pipeline is the unit that leaves and returns,
so its ranks are kept together, and a stage's TP ranks still sit on one node.) Data is sharded
by data-parallel rank: every rank of a replica reads the same batch.

Pure values (no torch): the controller sizes and arranges groups with it, each rank builds its
device mesh from it (elastic._worker.mesh).
"""
from __future__ import annotations

from dataclasses import dataclass

from elastic.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """`dp` replicas of `pp` stages of `tp` ranks each."""

    dp: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Layout.{name} must be an int >= 1, got {value!r}")

    @classmethod
    def of(cls, world_size: int, tp: int = 1, pp: int = 1) -> Layout:
        """The layout of `world_size` ranks in replicas of `tp` x `pp`; a world that does not split
        into whole replicas is refused (the controller only forms multiples of tp x pp)."""
        if world_size % (tp * pp):
            raise ConfigError(f"a group of {world_size} ranks does not split into replicas of "
                              f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} ranks")
        return cls(dp=world_size // (tp * pp), tp=tp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def replica_size(self) -> int:
        return self.tp * self.pp

    def dp_rank(self, rank: int) -> int:
        return rank // self.replica_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage `rank` runs (its first, under an interleaved schedule)."""
        return (rank // self.tp) % self.pp

    def metric_ranks(self) -> slice:
        """The ranks whose reported values stand for their replica, one per replica: TP rank 0 of
        the last stage (the ranks of a stage compute the same loss; only the last stage has it)."""
        return slice((self.pp - 1) * self.tp, None, self.replica_size)

    def to_dict(self) -> dict[str, int]:
        """As status.json and summary.json show it."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

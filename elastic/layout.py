"""A run's layout of parallelism: how its ranks split into data-parallel replicas.

A replica is the set of ranks that together hold one copy of the model: `tp` ranks for tensor
parallelism of degree tp (1 for plain DDP or FSDP). The data-parallel degree `dp` is what grows
and shrinks, one replica at a time; `tp` changes only on a restore from a checkpoint. Ranks are
ordered as torchtitan orders them, TP innermost: rank r is TP rank r % tp of replica r // tp, so
a replica's ranks are consecutive (and placed together). Data is sharded by data-parallel rank:
every rank of a replica reads the same batch.

Pure values (no torch): the controller sizes and arranges groups with it, each rank builds its
device mesh from it (elastic._worker.mesh).
"""
from __future__ import annotations

from dataclasses import dataclass

from elastic.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """`dp` replicas of `tp` x `pp` ranks each (pp is 1: pipelines are not built yet)."""

    dp: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Layout.{name} must be an int >= 1, got {value!r}")

    @classmethod
    def of(cls, world_size: int, tp: int = 1) -> Layout:
        """The layout of `world_size` ranks in replicas of `tp`; a world that does not split into
        whole replicas is refused (the controller only forms multiples of tp)."""
        if world_size % tp:
            raise ConfigError(f"a group of {world_size} ranks does not split into replicas of "
                              f"tensor_parallel_size={tp} ranks")
        return cls(dp=world_size // tp, tp=tp)

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

    def to_dict(self) -> dict[str, int]:
        """As status.json and summary.json show it."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

"""One generation's layout on one rank, and its device mesh.

The mesh's dimensions are named as torchtitan names them, data-parallel outermost and TP
innermost: ("dp_replicate", "tp") when the replicas hold copies (strategy "ddp"), ("dp_shard",
"tp") when FSDP2 shards over them (strategy "fsdp"), ("dp_replicate", "dp_shard", "tp") under
HSDP (strategy "hsdp": FSDP2 shards over the S replicas of a shard group and replicates across
the groups). A user's TP plan gets `mesh["tp"]`; the framework wraps the data-parallel
dimension(s); the warm rung moves a shard within its warm group: the ranks at the same position
of every unit (a replica of T ranks, under hsdp a shard group of S x T ranks), which hold the
same shard. Ranks are in torchtitan's order: rank = (r_replicate * S + r_shard) * T + t. With pipeline
parallelism (P > 1) the mesh is (data-parallel, "pp", "tp"), rank = (r_dp * P + stage) * T + t:
a replica is a whole pipeline, so "pp" sits inside the data-parallel dimension (torchtitan puts
it outermost; see elastic.layout for why a pipeline's ranks are kept together here), and the
warm unit is the pipeline: the ranks at one (stage, TP rank) of every pipeline hold one shard.

The mesh is built at its first use, not when a generation starts: building it creates a process
group per row and column of the mesh (a collective of every rank), which a run without tensor
parallelism never needs. Its first use is a collective too: every rank reaches it at the same
point (prepare_model, or the warm restore of a TP run).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.config import ScalingConfig
from elastic.layout import Layout

if TYPE_CHECKING:     # torch only for annotations: the controller's process imports the worker's module
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

DP_DIMS = {"ddp": "dp_replicate", "fsdp": "dp_shard", "hsdp": "dp_replicate"}
TP_DIM = "tp"
PP_DIM = "pp"
HSDP_DIMS = ("dp_replicate", "dp_shard")


class GenerationMesh:
    """The layout of this generation's ranks, this rank's place in it, and the mesh."""

    def __init__(self, *, rank: int, world_size: int, scaling: ScalingConfig, device: torch.device):
        self.layout = Layout.of(world_size, scaling.tensor_parallel_size, scaling.pipeline_parallel_size)
        self.rank = rank
        self.hsdp = scaling.strategy == "hsdp"
        # Ranks that join and leave together; a warm source holds the shard of its position in one.
        self.unit = scaling.unit_size
        if world_size % self.unit:
            from elastic.errors import ConfigError
            raise ConfigError(f"a group of {world_size} ranks does not split into shard groups of {self.unit} ranks "
                              f"(hsdp_shard_size x tensor_parallel_size)")
        # The dimension whose ranks hold the same shard (FSDP: the one it shards over).
        self.dp_dim = DP_DIMS[scaling.strategy]
        self._device_type = device.type
        self._mesh: DeviceMesh | None = None

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank(self.rank)

    @property
    def position(self) -> int:
        """This rank's place in its unit (its TP rank, under hsdp its place in its shard group)."""
        return self.rank % self.unit

    @property
    def tensor_parallel(self) -> bool:
        return self.layout.tp > 1

    @property
    def pipelined(self) -> bool:
        return self.layout.pp > 1

    @property
    def split(self) -> bool:
        """Whether a replica is more than one rank (tensor or pipeline parallelism): its ranks
        hold different parts of the model."""
        return self.layout.replica_size > 1

    @property
    def meshed(self) -> bool:
        """Whether the generation uses the device mesh: under tensor or pipeline parallelism, or HSDP."""
        return self.split or self.hsdp

    def mesh(self) -> DeviceMesh:
        """The mesh (data-parallel x tp; with pipelines data-parallel x pp x tp; under hsdp
        dp_replicate x dp_shard x tp); a collective the first time."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            if self.hsdp:
                shard = self.unit // self.layout.tp
                shape: tuple[int, ...] = (self.layout.dp // shard, shard, self.layout.tp)
                names: tuple[str, ...] = (*HSDP_DIMS, TP_DIM)
            elif self.pipelined:
                shape, names = (self.layout.dp, self.layout.pp, self.layout.tp), (self.dp_dim, PP_DIM, TP_DIM)
            else:
                shape, names = (self.layout.dp, self.layout.tp), (self.dp_dim, TP_DIM)
            self._mesh = init_device_mesh(self._device_type, shape, mesh_dim_names=names)
        return self._mesh

    def dp_mesh(self) -> DeviceMesh:
        """What FSDP2 wraps: the data-parallel dimension (under hsdp, dp_replicate x dp_shard)."""
        return self.mesh()[HSDP_DIMS] if self.hsdp else self.mesh()[self.dp_dim]

    def pp_group(self) -> ProcessGroup:
        """This rank's pipeline: the ranks of its replica at its TP rank, one per stage."""
        return self.mesh()[PP_DIM].get_group()

    def dp_group(self) -> ProcessGroup:
        """The ranks holding the same shard as this one: one per replica (under hsdp, one per
        shard group)."""
        return self.mesh()[self.dp_dim].get_group()

    def dp_peers(self, position: int) -> list[int]:
        """The global ranks at `position` in every unit (TP rank `position` in every replica;
        under hsdp that place in every shard group), in unit order."""
        return [self.unit * d + position for d in range(self.layout.world_size // self.unit)]

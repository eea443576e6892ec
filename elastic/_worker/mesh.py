"""One generation's layout on one rank, and its device mesh.

The mesh's dimensions are named as torchtitan names them, data-parallel outermost and TP
innermost: ("dp_replicate", "tp") when the replicas hold copies (strategy "ddp"), ("dp_shard",
"tp") when FSDP2 shards over them (strategy "fsdp"). A user's TP plan gets `mesh["tp"]`; the
framework wraps the data-parallel dimension; the warm rung moves a TP shard within its
data-parallel group (the ranks of the same TP rank in every replica).

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

DP_DIMS = {"ddp": "dp_replicate", "fsdp": "dp_shard"}
TP_DIM = "tp"


class GenerationMesh:
    """The layout of this generation's ranks, this rank's place in it, and the mesh."""

    def __init__(self, *, rank: int, world_size: int, scaling: ScalingConfig, device: torch.device):
        self.layout = Layout.of(world_size, scaling.tensor_parallel_size)
        self.rank = rank
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
    def tensor_parallel(self) -> bool:
        return self.layout.tp > 1

    def mesh(self) -> DeviceMesh:
        """The 2-D mesh (data-parallel x tp); a collective the first time."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            self._mesh = init_device_mesh(self._device_type, (self.layout.dp, self.layout.tp),
                                          mesh_dim_names=(self.dp_dim, TP_DIM))
        return self._mesh

    def dp_group(self) -> ProcessGroup:
        """The ranks holding the same TP shard as this one, one per replica."""
        return self.mesh()[self.dp_dim].get_group()

    def dp_peers(self, tp_rank: int) -> list[int]:
        """The global ranks of TP rank `tp_rank` in every replica, in replica order."""
        return [self.layout.replica_size * d + tp_rank for d in range(self.layout.dp)]

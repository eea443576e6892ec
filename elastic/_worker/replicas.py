"""FSDP's in-memory copies: the recovery ladder's MEMORY rung on one rank.

An FSDP rank holds the only live copy of its shards, so a lost rank used to send every rank back
to the newest checkpoint (or to step 0 before the first commit). Here, every
`CheckpointConfig.in_memory_every_n_steps` steps, each rank copies its whole state to host
memory (its shards of the parameters and the optimizer state, and the replicated rest: the
framework's progress, schedulers, the user's counters) and swaps a copy with its ring
neighbours: rank r sends its copy to r + s and keeps r - s's (Gemini, SOSP'23, with one peer). The
controller picks the step s (GenerationPlan.copy_shift) so that every copy lands on another node
than its rank's when the group spans nodes: ranks are placed node by node, so s = 1 would keep
all but a node's last rank's copy on its own node, and a lost node would take them together. A
lost rank's (or node's) state then survives on its ring neighbour; a group that lost two
neighbours falls back to the checkpoint. Cost: two copies of the rank's state in host memory, and one copy's
worth of point-to-point traffic per rank every K steps (elastic._worker.broadcast.swap_ring).

Under tensor parallelism (T > 1, FSDP x TP: torchtitan's 2-D) the ring runs along the
data-parallel dimension, within each TP rank's data-parallel group: rank r sends its copy to
r + s x T (the same TP rank s replicas on) and keeps r - s x T's. A lost rank's copy then lives in
another replica, at its own TP rank, where a rebuild needs it; at T = 1 this is the ring above.

When the copies are taken. At the K-step boundaries, and when the group leaves the loop
together (a resize, a preemption): every rank of the group at the same steps, since the swap is a
collective. Not when a generation starts: the restore would pay a swap on the critical path of
every recovery (0.2-0.3 s of the base model's 0.6 s memory restore on 3 CPU ranks), and the
previous generation's copies still cover the restored step until the first boundary (below).
(Nor at step 0: a fresh optimizer's state would be made up by DCP's zero step, which would
change Adam's step count.)

Consistency. A rank keeps one pair of copies, its own and its left neighbour's, of the same
generation and step; a new swap replaces the pair (the old one is dropped first: steady memory is
the pair, not two pairs). The controller restores from memory only at a (generation, step) for
which every rank of that generation has a holder among the new group's members
(elastic._controller.forming); a death inside a swap leaves no such step and the run takes the
checkpoint. Copies of a generation survive the next generation's start until its own first swap,
so a group lost again before then still finds them (unless the loss takes a copy's only holder:
then the checkpoint).

Rebuild at any data-parallel degree. A rank's shard of a DTensor is one block of the full
tensor (a box: an offset and a size per dim) under the layouts FSDP2 and TP make: Shard(0) over
the ranks at T = 1; under FSDP x TP (_StridedShard(0), Shard(0)), (Shard(0), Shard(1)),
(Shard(0), Replicate()) on the 2-D mesh, (Shard(0),) on the data-parallel mesh for what the TP
plan leaves alone (`shard_box`; any other layout is refused when a copy is taken). A copy keeps
each block with its offset. In a new generation the holder of each old rank's copy broadcasts it
in turn, and every rank copies into its own new block the part of each old block that meets it
(`Rebuild`, `Assembly`): no storage read, slices of tensors only, and at most one old rank's copy
of extra memory at a time. Under tensor parallelism T stays (a change of T restores from a
checkpoint) and each TP rank rebuilds within its data-parallel group, from the copies of the old
ranks of its TP rank: the controller places every holder at the TP rank of the copies it holds.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elastic._protocol import ReplicaHeld
from elastic.errors import StateError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

    from elastic._worker.train_state import TrainState


@dataclass(frozen=True)
class Box:
    """A block of a tensor: indices [offset[d], offset[d] + size[d]) along every dim d."""

    offset: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def meet(self, other: Box) -> Box | None:
        """The block both boxes hold, or None when they share no element."""
        low = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        high = tuple(min(a + m, b + n) for a, m, b, n in zip(self.offset, self.size, other.offset, other.size,
                                                             strict=True))
        if any(lo >= hi for lo, hi in zip(low, high, strict=True)):
            return None
        return Box(low, tuple(hi - lo for lo, hi in zip(low, high, strict=True)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Where this box lies in the local tensor of `outer` (which contains it): a slice per dim."""
        return tuple(slice(o - w, o - w + n) for o, n, w in zip(self.offset, self.size, outer.offset, strict=True))


@dataclass(frozen=True)
class ShardPiece:
    """One rank's block of a sharded tensor of `shape`: `local` holds the elements from `offset` on
    (one offset per dim)."""

    local: torch.Tensor
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def box(self) -> Box:
        return Box(self.offset, tuple(self.local.shape))


@dataclass(frozen=True)
class Copy:
    """The state of rank `rank` of generation `generation` after step `step`, on the host."""

    generation: int
    world_size: int
    rank: int
    step: int
    state: dict[str, Any]       # TrainState.state_dict(), every DTensor as a ShardPiece


def chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of dim 0 that `rank` holds when `rows` are split as torch.chunk
    splits them (FSDP2's and DTensor's Shard(0)): ceil-sized pieces, the last ones short or empty."""
    size = -(-rows // world_size)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


@functools.lru_cache(maxsize=4096)
def shard_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
              placements: tuple[Placement, ...]) -> Box:
    """The block of a tensor of `shape` that the rank at `coordinate` of a mesh of `mesh_shape`
    holds under `placements`, as FSDP2 and TP lay the data out.

    Every Shard(d) cuts what the mesh dims before it left of dim d in torch.chunk pieces (mesh
    dims left to right); a _StridedShard(d, sf) is FSDP2's shard of a TP shard: it cuts dim d
    after the mesh dims to its right that shard d (sf is their product), i.e. FSDP2's torch.chunk
    of the TP shard it was given. torch's compute_local_shape_and_global_offset reads a
    _StridedShard otherwise (interleaved pieces), which differs from FSDP2's data where the TP
    split is uneven (7 rows over TP 2 and FSDP 3). Any other placement (Partial, a _StridedShard
    of another layout) is refused: a copy's piece is one block. Pure integers, cached per layout."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    offset, size = [0] * len(shape), list(shape)

    def cut(mesh_dim: int, dim: int) -> None:
        start, end = chunk_rows(size[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        offset[dim], size[dim] = offset[dim] + start, end - start

    deferred: list[tuple[int, int]] = []     # (mesh dim, dim) of the _StridedShards: cut after those to their right
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            right = [mesh_shape[j] for j, later in enumerate(placements) if j > mesh_dim
                     and isinstance(later, (Shard, _StridedShard)) and later.dim == placement.dim]
            if placement.split_factor != math.prod(right) or any(d == placement.dim for _, d in deferred):
                raise StateError(f"in-memory copies keep each shard as one block of its tensor; a tensor of "
                                 f"{shape} is placed {placements} on a mesh of {mesh_shape}, whose {placement} on "
                                 f"mesh dim {mesh_dim} is not FSDP2's shard of a TP shard. {_OFF}")
            deferred.append((mesh_dim, placement.dim))
        elif isinstance(placement, Shard):
            cut(mesh_dim, placement.dim)
        elif not isinstance(placement, Replicate):
            raise StateError(f"in-memory copies cut Shard, _StridedShard and Replicate placements; a tensor of "
                             f"{shape} is placed {placements}, with {placement} on mesh dim {mesh_dim}. {_OFF}")
    for mesh_dim, dim in reversed(deferred):
        cut(mesh_dim, dim)
    return Box(tuple(offset), tuple(size))


_OFF = "Set CheckpointConfig.in_memory_every_n_steps=None to rely on checkpoints"


def dtensor_box(tensor: DTensor) -> Box:
    """The block of the full tensor this rank's shard of `tensor` holds."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the DTensor's mesh"
    return shard_box(tuple(tensor.shape), tuple(mesh.shape), tuple(coordinate), tuple(tensor.placements))


def to_host(tree: Any, path: tuple = ()) -> Any:
    """A copy of a state dict in host memory: DTensors become ShardPieces, tensors host copies,
    everything else a deep copy (the live objects keep changing after this step)."""
    from torch.distributed.tensor import DTensor
    if isinstance(tree, DTensor):
        box = dtensor_box(tree)
        local = tree.to_local()
        if tuple(local.shape) != box.size:
            raise StateError(f"the shard of {_name(path)} ({tuple(tree.shape)} placed {tree.placements}) holds "
                             f"{tuple(local.shape)} where its placement gives {box.size}: this layout is not one "
                             f"the in-memory copies know. {_OFF}")
        return ShardPiece(local.detach().to("cpu", copy=True), box.offset, tuple(tree.shape))
    if isinstance(tree, ShardPiece):      # a neighbour's copy, received on the device
        return dataclasses.replace(tree, local=tree.local.detach().to("cpu", copy=True))
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_host(v, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(v, path + (i,)) for i, v in enumerate(tree))
    return copy.deepcopy(tree)


class Assembly:
    """One shard of a new generation (block `box` of a tensor), filled from the old pieces that
    meet it: each piece's common block is copied into place, a slice of a tensor at a time."""

    def __init__(self, box: Box, dtype: torch.dtype, device: torch.device):
        self.box = box
        self._local = torch.empty(box.size, dtype=dtype, device=device)
        self._filled: set[Box] = set()    # blocks copied in; the same block twice (a replicated dim) once

    def add(self, piece: ShardPiece) -> None:
        common = piece.box.meet(self.box)
        if common is None or common in self._filled:
            return
        self._local[common.within(self.box)] = piece.local[common.within(piece.box)]
        self._filled.add(common)

    @property
    def complete(self) -> bool:
        return sum(b.numel for b in self._filled) == self.box.numel

    def result(self) -> torch.Tensor:
        """The shard; the caller checks `complete` first (the blocks filled are disjoint)."""
        return self._local


class ReplicaStore:
    """This worker's pair of copies (its own and its left neighbour's), across generations."""

    def __init__(self) -> None:
        # One tuple, replaced whole: poll() reads it from the actor's thread while the training
        # thread swaps.
        self._pair: tuple[Copy, ...] = ()

    def held(self) -> ReplicaHeld | None:
        """What the controller may restore from: the copies of one (generation, step)."""
        pair = self._pair
        if not pair:
            return None
        own = pair[0]
        return ReplicaHeld(generation=own.generation, world_size=own.world_size, step=own.step,
                           ranks=tuple(c.rank for c in pair))

    def own(self) -> Copy | None:
        """This rank's own copy (the newest), if any."""
        pair = self._pair
        return pair[0] if pair else None

    def copy_of(self, generation: int, rank: int) -> dict[str, Any]:
        for kept in self._pair:
            if (kept.generation, kept.rank) == (generation, rank):
                return kept.state
        held = [(c.generation, c.rank, c.step) for c in self._pair]
        raise StateError(f"asked for the in-memory copy of rank {rank} of generation {generation}, but this "
                         f"worker holds {held} (generation, rank, step)")

    def refresh(self, state: TrainState, *, generation: int, rank: int, world_size: int, step: int,
                device: torch.device, replica_size: int = 1, group: ProcessGroup | None = None,
                shift: int = 1) -> None:
        """Collective over `group` (default: the world): take this rank's copy and swap copies
        around the ring, `shift` replicas on (the controller's GenerationPlan.copy_shift, which
        puts each copy on another node).

        Under tensor or pipeline parallelism (`replica_size` R = T x P > 1) the ring is this
        rank's data-parallel group (`group`: the same place in every replica), so rank r keeps
        the copy of r - shift x R."""
        from elastic._worker.broadcast import swap_ring
        self._pair = ()     # the previous pair is dropped first: memory holds one pair, not two
        own = Copy(generation, world_size, rank, step, to_host(state.state_dict()))
        self._pair = (own,)
        if world_size == replica_size:
            return
        theirs = swap_ring(own.state, device, group=group, shift=shift)
        if device.type != "cpu":
            theirs = to_host(theirs)
        self._pair = (own, Copy(generation, world_size, (rank - shift * replica_size) % world_size, step, theirs))


class Rebuild:
    """A new generation's state from the old generation's copies, one old rank's at a time.

    `template` is the new generation's own state dict (its DTensors name the mesh, placement and
    full shape of every shard): each DTensor's block is filled from the blocks of the copies'
    pieces that meet it (`Assembly`); every other value is taken from the first copy
    (replicated: the same on every old rank)."""

    def __init__(self, template: dict[str, Any]):
        self._template = template
        self._shards: dict[tuple, Assembly] = {}    # path -> this rank's new shard, as filled so far
        self._rest: dict[str, Any] | None = None

    def take(self, state: dict[str, Any]) -> None:
        """One old rank's copy: keep what falls in this rank's new pieces."""
        if self._rest is None:
            self._rest = state
        self._cut(self._template, state, ())

    def _cut(self, template: Any, copied: Any, path: tuple) -> None:
        """Copy into every shard of `template` what `copied` has of it (a shard the copies do
        not cover whole is caught in `result`)."""
        from torch.distributed.tensor import DTensor
        if isinstance(template, DTensor):
            if not isinstance(copied, ShardPiece):
                raise StateError(f"the in-memory copy holds {type(copied).__name__} at {_name(path)} where this "
                                 f"generation has a shard")
            if copied.shape != tuple(template.shape):
                raise StateError(f"the in-memory copy of {_name(path)} is of shape {copied.shape}, this "
                                 f"generation's is {tuple(template.shape)}: pass ctx.restore the same objects, by "
                                 f"the same names, as before the rescale")
            shard = self._shards.get(path)
            if shard is None:
                shard = self._shards[path] = Assembly(dtensor_box(template), template.dtype,
                                                      template.to_local().device)
            shard.add(copied)
        elif isinstance(template, dict) and isinstance(copied, dict):
            for key, value in template.items():
                if key in copied:
                    self._cut(value, copied[key], path + (key,))
        elif isinstance(template, (list, tuple)) and isinstance(copied, (list, tuple)):
            for i, (value, kept) in enumerate(zip(template, copied, strict=False)):
                self._cut(value, kept, path + (i,))

    def result(self) -> dict[str, Any]:
        """The state dict to load: the template with every shard rebuilt and every other value
        as copied (values only the copy has pass through: TrainState.load_state_dict judges the
        names)."""
        assert self._rest is not None, "no copy taken"
        return self._build(self._template, self._rest, ())

    def _build(self, template: Any, copied: Any, path: tuple) -> Any:
        from torch.distributed.tensor import DTensor
        if isinstance(template, DTensor):
            shard = self._shards.get(path)
            if shard is None or not shard.complete:
                raise StateError(f"the in-memory copies do not cover the block {dtensor_box(template)} of "
                                 f"{_name(path)} this rank needs: pass ctx.restore the same objects, by the same "
                                 f"names, as before the rescale")
            return DTensor.from_local(shard.result(), template.device_mesh, template.placements, run_check=False,
                                      shape=template.shape, stride=template.stride())
        if isinstance(template, dict) and isinstance(copied, dict):
            return {**copied, **{key: self._build(value, copied.get(key, _MISSING), path + (key,))
                                 for key, value in template.items()}}
        if copied is _MISSING:
            if _has_shards(template):
                raise StateError(f"the in-memory copies hold no {_name(path)}: pass ctx.restore the same objects, "
                                 f"by the same names, as before the rescale")
            return template
        if isinstance(template, torch.Tensor) and isinstance(copied, torch.Tensor):
            return copied.to(device=template.device)
        if isinstance(template, (list, tuple)) and isinstance(copied, (list, tuple)) and len(template) == len(copied):
            pairs = enumerate(zip(template, copied, strict=True))
            return type(copied)(self._build(v, c, path + (i,)) for i, (v, c) in pairs)
        return copied


_MISSING = object()   # a value the template has and the copy does not: the template's stays


def _has_shards(tree: Any) -> bool:
    from torch.distributed.tensor import DTensor
    if isinstance(tree, DTensor):
        return True
    if isinstance(tree, dict):
        return any(_has_shards(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_shards(v) for v in tree)
    return False


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "the state"

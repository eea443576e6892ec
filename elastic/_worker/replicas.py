"""FSDP's in-memory copies: the recovery ladder's MEMORY rung on one rank.

An FSDP rank holds the only live copy of its shards, so a lost rank used to send every rank back
to the newest checkpoint (or to step 0 before the first commit). Here, every
`CheckpointConfig.in_memory_every_n_steps` steps, each rank copies its whole state to host
memory (its shards of the parameters and the optimizer state, and the replicated rest: the
framework's progress, schedulers, the user's counters) and swaps a copy with its ring
neighbours: rank r sends its copy to r + 1 and keeps r - 1's (Gemini, SOSP'23, with one peer). A
lost rank's state then survives on its right neighbour; a group that lost two neighbours falls
back to the checkpoint. Cost: two copies of the rank's state in host memory, and one copy's
worth of point-to-point traffic per rank every K steps (elastic._worker.broadcast.swap_ring).

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

Rebuild at any world size. FSDP2 shards every tensor on dim 0 in `torch.chunk` pieces; a copy
keeps each piece with its offset in the full tensor. In a new generation the holder of each old
rank's copy broadcasts it in turn, and every rank keeps the rows of its own new piece that fall in
it (`Rebuild`): no storage read, and at most one old rank's copy of extra memory at a time.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elastic._protocol import ReplicaHeld
from elastic.errors import StateError

if TYPE_CHECKING:
    from elastic._worker.train_state import TrainState


@dataclass(frozen=True)
class ShardPiece:
    """One rank's rows of a dim-0 sharded tensor: rows [offset, offset + len(local)) of `shape`."""

    local: torch.Tensor
    offset: int
    shape: tuple[int, ...]


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


def to_host(tree: Any) -> Any:
    """A copy of a state dict in host memory: DTensors become ShardPieces, tensors host copies,
    everything else a deep copy (the live objects keep changing after this step)."""
    from torch.distributed.tensor import DTensor, Shard
    if isinstance(tree, DTensor):
        placements = tree.placements
        if tree.device_mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0):
            raise StateError(f"in-memory copies hold FSDP's dim-0 shards on a 1-D mesh; a tensor is placed "
                             f"{placements} on a {tree.device_mesh.ndim}-D mesh. Set "
                             f"CheckpointConfig.in_memory_every_n_steps=None to rely on checkpoints")
        local = tree.to_local()
        start, end = chunk_rows(tree.shape[0], tree.device_mesh.size(), tree.device_mesh.get_local_rank())
        if local.shape[0] != end - start:
            raise StateError(f"a shard of {tuple(tree.shape)} holds {local.shape[0]} rows where torch.chunk "
                             f"gives {end - start}: this FSDP layout is not one the in-memory copies know")
        return ShardPiece(local.detach().to("cpu", copy=True), start, tuple(tree.shape))
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(v) for v in tree)
    return copy.deepcopy(tree)


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

    def copy_of(self, generation: int, rank: int) -> dict[str, Any]:
        for kept in self._pair:
            if (kept.generation, kept.rank) == (generation, rank):
                return kept.state
        held = [(c.generation, c.rank, c.step) for c in self._pair]
        raise StateError(f"asked for the in-memory copy of rank {rank} of generation {generation}, but this "
                         f"worker holds {held} (generation, rank, step)")

    def refresh(self, state: TrainState, *, generation: int, rank: int, world_size: int, step: int,
                device: torch.device) -> None:
        """Collective: take this rank's copy and swap copies around the ring."""
        from elastic._worker.broadcast import swap_ring
        self._pair = ()     # the previous pair is dropped first: memory holds one pair, not two
        own = Copy(generation, world_size, rank, step, to_host(state.state_dict()))
        self._pair = (own,)
        if world_size == 1:
            return
        theirs = swap_ring(own.state, device)
        if device.type != "cpu":
            theirs = to_host(theirs)
        self._pair = (own, Copy(generation, world_size, (rank - 1) % world_size, step, theirs))


class Rebuild:
    """A new generation's state from the old generation's copies, one old rank's at a time.

    `template` is the new generation's own state dict (its DTensors name the mesh, placement and
    full shape of every shard): each DTensor is cut from the copies' pieces to this rank's rows;
    every other value is taken from the first copy (replicated: the same on every old rank)."""

    def __init__(self, template: dict[str, Any]):
        self._template = template
        self._rows: dict[tuple, list[tuple[int, torch.Tensor]]] = {}   # path -> (offset, rows) kept
        self._rest: dict[str, Any] | None = None

    def take(self, state: dict[str, Any]) -> None:
        """One old rank's copy: keep what falls in this rank's new pieces."""
        if self._rest is None:
            self._rest = state
        self._cut(self._template, state, ())

    def _cut(self, template: Any, copied: Any, path: tuple) -> None:
        """Keep the rows of every shard of `template` that `copied` has (a shard the copies do
        not cover at all is caught in `result`)."""
        from torch.distributed.tensor import DTensor
        if isinstance(template, DTensor):
            if not isinstance(copied, ShardPiece):
                raise StateError(f"the in-memory copy holds {type(copied).__name__} at {_name(path)} where this "
                                 f"generation has a shard")
            mesh = template.device_mesh
            start, end = chunk_rows(template.shape[0], mesh.size(), mesh.get_local_rank())
            low, high = max(start, copied.offset), min(end, copied.offset + copied.local.shape[0])
            if low < high:
                rows = copied.local[low - copied.offset:high - copied.offset].clone()
                self._rows.setdefault(path, []).append((low, rows))
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
            mesh = template.device_mesh
            start, end = chunk_rows(template.shape[0], mesh.size(), mesh.get_local_rank())
            parts = sorted(self._rows.get(path, []), key=lambda p: p[0])
            if sum(rows.shape[0] for _, rows in parts) != end - start:
                raise StateError(f"the in-memory copies cover {sum(r.shape[0] for _, r in parts)} of the "
                                 f"{end - start} rows of {_name(path)} this rank needs: pass ctx.restore the same "
                                 f"objects, by the same names, as before the rescale")
            local = torch.cat([rows for _, rows in parts]) if parts else \
                torch.empty((0, *template.shape[1:]), dtype=template.dtype)
            local = local.to(device=template.to_local().device, dtype=template.dtype)
            return DTensor.from_local(local, mesh, template.placements, run_check=False,
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

"""The warm rung's transfer: every rank that holds the newest state sends one slice of it to
the ranks that do not, in place, so no rank needs more than a slice of memory beyond its state.

Why this shape (against `broadcast.broadcast_state`, one source to all):
- Under DDP every survivor at the newest step holds the same state (the same all-reduced
  gradients went through the same optimizer step), so each of them is as good a source as any.
  With k sources, each sends 1/k of the bytes: the time a receiver waits for the state is bound
  by what the slowest source sends, not by one source sending everything to everyone.
- A survivor that holds the state receives nothing and loads its own copy; when every member
  holds it (a shrink), nothing crosses the network at all. A survivor of an older step (it
  finished one step fewer) receives like a new rank.
- Slices are cut by bytes through tensors, not along whole tensors: the `base` GPT's embedding
  and its Adam moments are a large share of the state, and a whole-tensor split would leave one
  source sending far more than 1/k (and needing that much of a send buffer if it had to pack).
  A cut is a byte range of a tensor's contiguous storage, so it is sent as a view: a source
  sends its tensors in place, and a receiver receives into the tensors its own new objects
  already have (the template: `TrainState.state_dict()` of the new generation's model and
  optimizer), so its extra memory is none either. Buffers are allocated only for a tensor that
  cannot travel in place (not contiguous, or not on the communication device, e.g. Adam's
  `step` counters under NCCL) or that the template lacks (its state is then received whole, as
  the state to load).
- Point-to-point sends (one batch per rank) rather than a broadcast per source over a subgroup:
  a subgroup per source would cost a communicator per source at every re-form, and the sources
  would still need to know every receiver. The skeleton (structure, shapes, dtypes, plain
  values) is small and goes by one object broadcast from the first source; every other source
  checks that its own state has the same tensors, and all ranks learn of a mismatch together
  (one small all-reduce), so none is left waiting on a send that never comes.

Every rank ends with the state the first source holds, bitwise: sources' tensors are equal by
DDP's construction, and receivers get exact bytes. (State that DDP does not keep equal across
ranks, such as buffers a forward pass updates locally, was the first source's alone before this
module; here each source keeps its own. The framework's contract is that every object handed to
`ctx.restore` other than FSDP modules is replicated: the same on every rank.)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic._worker.broadcast import _fill_tree, _is_record, _split_tree, _TensorSlot
from elastic.errors import StateError

Path = tuple[Any, ...]


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of the tensor at position `slot` of the skeleton's tensors."""

    slot: int
    start: int
    end: int


@dataclass
class Transfer:
    """What `send_slices` returns on one rank: the state to load, and the bytes of the buffers it
    allocated besides the state's own tensors (0 when everything went in place)."""

    state: Any
    extra_bytes: int = 0


def cut_slices(sizes: list[int], parts: int) -> list[list[Piece]]:
    """The tensors (`sizes` in bytes, in skeleton order) cut into `parts` runs of consecutive
    bytes of at most ceil(total / parts) bytes each; part i is source i's slice."""
    total = sum(sizes)
    cuts = [total * i // parts for i in range(parts + 1)]
    slices: list[list[Piece]] = [[] for _ in range(parts)]
    offset, part = 0, 0
    for slot, size in enumerate(sizes):     # one walk: O(tensors + parts), thousands of sources included
        end_of_slot = offset + size
        while offset < end_of_slot:
            while cuts[part + 1] <= offset:
                part += 1
            end = min(cuts[part + 1], end_of_slot)
            slices[part].append(Piece(slot, offset - (end_of_slot - size), end - (end_of_slot - size)))
            offset = end
    return slices


def send_slices(held: Any | None, sources: tuple[int, ...], device: torch.device, *,
                into: Any | None = None, group: dist.ProcessGroup | None = None) -> Transfer:
    """Collective over `group` (default: the world): ranks in `sources` (global ranks) pass the
    state they hold (`held`), every other rank passes None and, as `into`, a state of the same
    structure whose tensors receive the bytes in place where shape, dtype and device allow.
    Sources get their own state back; the others get the first source's skeleton filled with the
    received tensors. DTensors travel as their local shards (`localized`) and arrive as DTensors
    again, on the mesh and placements of `into`'s: a source that passes `into` (its new
    generation's state) gets its own shards back on the new mesh too."""
    rank = dist.get_rank()
    members = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    holding = set(sources)
    receivers = [r for r in members if r not in holding]
    if rank in holding and held is None:
        raise StateError(f"rank {rank} was named a warm source but passed no state")
    own = held if into is None or rank not in holding else delocalized(localized(held), into)
    if not receivers:
        return Transfer(own)       # every rank holds the state: nothing to move
    transfer = _send_local(localized(held), sources, receivers, device, localized(into), group)
    if rank in holding:
        return Transfer(own, transfer.extra_bytes)
    return Transfer(delocalized(transfer.state, into), transfer.extra_bytes)


def _send_local(held: Any | None, sources: tuple[int, ...], receivers: list[int], device: torch.device,
                into: Any | None, group: dist.ProcessGroup | None) -> Transfer:
    rank = dist.get_rank()
    holding = set(sources)
    box = [_split_tree(held, []) if rank == sources[0] else None]
    dist.broadcast_object_list(box, src=sources[0], group=group)
    skeleton = box[0]
    paths = [path for path, _ in _leaves(skeleton)]
    slots: list[_TensorSlot] = [slot for _, slot in _leaves(skeleton)]
    mine = dict(_leaves(held if rank in holding else into))
    _agree_on_structure(rank, sources, _mismatch(paths, slots, mine) if rank in holding else None, device, group)

    slices = cut_slices([_nbytes(s) for s in slots], len(sources))
    ops: list[dist.P2POp] = []
    extra = 0
    if rank in holding:
        tensors = []
        for path in paths:
            flat, staged = _bytes_of(mine[path], device)
            tensors.append(flat)
            extra += staged
        mine_to_send = slices[sources.index(rank)]
        for receiver in receivers:
            for tag, piece in enumerate(mine_to_send):
                ops.append(dist.P2POp(dist.isend, tensors[piece.slot][piece.start:piece.end], receiver, group,
                                      tag=tag))
        _run(ops)
        return Transfer(held, extra)
    received: dict[int, torch.Tensor] = {}
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []     # (received whole, the template's tensor)
    used: set[int] = set()
    targets = []
    for path, slot in zip(paths, slots, strict=True):
        found = mine.get(path)
        template = (found if isinstance(found, torch.Tensor) and tuple(found.shape) == slot.shape
                    and found.dtype == slot.dtype else None)
        if (template is not None and template.device == device and template.is_contiguous()
                and template.data_ptr() not in used):       # a tied weight's second name gets a buffer
            used.add(template.data_ptr())
            target = received[slot.index] = template.detach()
        else:
            target = torch.empty(slot.shape, dtype=slot.dtype, device=device)
            extra += _nbytes(slot)
            if template is not None:
                copy_back.append((target, template))
            received[slot.index] = template if template is not None else target
        targets.append(target.reshape(-1).view(torch.uint8))
    for source, pieces in zip(sources, slices, strict=True):
        for tag, piece in enumerate(pieces):
            ops.append(dist.P2POp(dist.irecv, targets[piece.slot][piece.start:piece.end], source, group, tag=tag))
    _run(ops)
    with torch.no_grad():
        for buffer, target in copy_back:
            target.copy_(buffer)
    return Transfer(_fill_tree(skeleton, received), extra)


def _agree_on_structure(rank: int, sources: tuple[int, ...], mismatch: str | None, device: torch.device,
                        group: dist.ProcessGroup | None) -> None:
    """Every rank raises, or none, naming the first source whose tensors differ from the first
    source's (one scalar reduced, whatever the world size)."""
    world = dist.get_world_size()
    first_bad = torch.tensor([rank if mismatch is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(first_bad, op=dist.ReduceOp.MIN, group=group)
    bad = int(first_bad.item())
    if bad < world:
        detail = f" (here: {mismatch})" if mismatch else ""
        raise StateError(f"warm source {bad} holds tensors other than source {sources[0]}'s{detail}: the survivors "
                         f"are not replicas of one state; restore from a checkpoint instead")


def localized(tree: Any) -> Any:
    """`tree` with every DTensor replaced by its local shard (the same storage: a receiver's
    bytes land in the DTensor's own tensor)."""
    from torch.distributed.tensor import DTensor
    if isinstance(tree, DTensor):
        with torch.no_grad():       # to_local() is then the local tensor itself, not an autograd view
            return tree.to_local()
    if isinstance(tree, torch.Tensor) or tree is None:
        return tree
    if _is_record(tree):
        return dataclasses.replace(tree, **{f.name: localized(getattr(tree, f.name)) for f in dataclasses.fields(tree)})
    if isinstance(tree, dict):
        return {k: localized(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(localized(v) for v in tree)
    return tree


def delocalized(tree: Any, template: Any) -> Any:
    """A received `tree` with each local shard made the DTensor that `template` has at its place
    (over the template's storage when the bytes landed there)."""
    from torch.distributed.tensor import DTensor
    if isinstance(template, DTensor) and isinstance(tree, torch.Tensor) and not isinstance(tree, DTensor):
        return DTensor.from_local(tree, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())
    if isinstance(tree, dict):
        sub = template if isinstance(template, dict) else {}
        return {k: delocalized(v, sub.get(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not _is_record(tree):
        items = template if isinstance(template, (list, tuple)) and len(template) == len(tree) else [None] * len(tree)
        return type(tree)(delocalized(v, t) for v, t in zip(tree, items, strict=True))
    return tree


def _mismatch(paths: list[Path], slots: list[_TensorSlot], mine: dict[Path, Any]) -> str | None:
    own = {p for p, v in mine.items() if isinstance(v, torch.Tensor)}
    if own != set(paths):
        return f"tensors at {sorted(map(str, own ^ set(paths)))[:3]} are on one side only"
    for path, slot in zip(paths, slots, strict=True):
        t = mine[path]
        if tuple(t.shape) != slot.shape or t.dtype != slot.dtype:
            return f"{path} is {tuple(t.shape)} {t.dtype}, the first source's is {slot.shape} {slot.dtype}"
    return None


def _leaves(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, tensor or slot) of every tensor of a state tree, in the order `_split_tree` numbers them."""
    if isinstance(tree, (torch.Tensor, _TensorSlot)):
        yield path, tree
    elif _is_record(tree):
        for f in dataclasses.fields(tree):
            yield from _leaves(getattr(tree, f.name), (*path, f.name))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))


def _bytes_of(tensor: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """A source tensor's bytes as a flat uint8 view, and the bytes copied to get one (0: in place)."""
    t = tensor.detach()
    if t.device == device and t.is_contiguous():
        return t.reshape(-1).view(torch.uint8), 0
    staged = t.to(device).contiguous()
    return staged.reshape(-1).view(torch.uint8), staged.numel() * staged.element_size()


def _nbytes(slot: _TensorSlot) -> int:
    n = slot.dtype.itemsize
    for d in slot.shape:
        n *= d
    return n


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

"""Moving a nested state between ranks: a broadcast from one rank to all (each old rank's copy in
a rebuild from memory), and a swap around the ring (FSDP's in-memory copies,
elastic._worker.replicas). The warm rung's many-source slices (elastic._worker.warm_slices) use
the same skeleton of a state.

A state is a tree of dicts, lists, tuples and dataclasses (a TrainState's state dict, a shard's
copy). Pickling every tensor through broadcast_object_list would copy it several times, so only
the skeleton (structure, shapes, dtypes) is pickled; tensor payloads travel as one flat buffer
per dtype.
"""
from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _is_record(tree: Any) -> bool:
    """A dataclass instance (a shard's copy): its fields are walked like a dict's values."""
    return dataclasses.is_dataclass(tree) and not isinstance(tree, type)


def _split_tree(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree.detach())
        return _TensorSlot(len(tensors) - 1, tuple(tree.shape), tree.dtype)
    if _is_record(tree):
        return dataclasses.replace(tree, **{f.name: _split_tree(getattr(tree, f.name), tensors)
                                            for f in dataclasses.fields(tree)})
    if isinstance(tree, dict):
        return {k: _split_tree(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_split_tree(v, tensors) for v in tree)
    return tree


def _fill_tree(skeleton: Any, tensors: dict[int, torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.index]
    if _is_record(skeleton):
        return dataclasses.replace(skeleton, **{f.name: _fill_tree(getattr(skeleton, f.name), tensors)
                                                for f in dataclasses.fields(skeleton)})
    if isinstance(skeleton, dict):
        return {k: _fill_tree(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill_tree(v, tensors) for v in skeleton)
    return skeleton


def _slots(skeleton: Any) -> list[_TensorSlot]:
    if isinstance(skeleton, _TensorSlot):
        return [skeleton]
    if _is_record(skeleton):
        return [s for f in dataclasses.fields(skeleton) for s in _slots(getattr(skeleton, f.name))]
    if isinstance(skeleton, dict):
        return [s for v in skeleton.values() for s in _slots(v)]
    if isinstance(skeleton, (list, tuple)):
        return [s for v in skeleton for s in _slots(v)]
    return []


def broadcast_state(state: Any | None, src: int, device: torch.device, group: dist.ProcessGroup | None = None
                    ) -> Any:
    """Collective over `group` (default: the world): rank `src` (a global rank) passes its
    state, every other rank passes None; all return it.

    The source gets its own objects back (no copy); receivers get fresh tensors on `device`.
    """
    is_src = dist.get_rank() == src
    tensors: list[torch.Tensor] = []
    skeleton = _split_tree(state, tensors) if is_src else None
    box = [skeleton]
    dist.broadcast_object_list(box, src=src, group=group)
    skeleton = box[0]
    slots = _slots(skeleton)
    groups = _dtype_groups(slots)
    flats = _flatten(groups, tensors, device) if is_src else _empty_flats(groups, device)
    for flat in flats:
        dist.broadcast(flat, src=src, group=group)
    if is_src:
        return state
    # Copies, not views of the flat buffers: each tensor is loaded into an object of its own.
    return _fill_tree(skeleton, _unflatten(slots, groups, flats, device, copy=True))


def swap_ring(state: Any, device: torch.device, group: dist.ProcessGroup | None = None, shift: int = 1) -> Any:
    """Collective over `group` (default: the world): every rank sends `state` to the rank
    `shift` places on (around the ring, in group rank order) and returns what the one `shift`
    places back sent it; tensors arrive on `device`.

    Point to point, so the bytes each rank moves do not grow with the world size: a skeleton's
    length, the skeleton, then one flat buffer per dtype, each a send and a receive posted
    together (no rank waits for its receiver before it can receive)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    right, left = _global_rank(group, (rank + shift) % world), _global_rank(group, (rank - shift) % world)
    tensors: list[torch.Tensor] = []
    mine = _split_tree(state, tensors)
    blob = pickle.dumps(mine)
    length = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    their_length = torch.empty(1, dtype=torch.int64, device=device)
    _send_and_receive([length], [their_length], right, left, group)
    theirs = torch.empty(int(their_length.item()), dtype=torch.uint8, device=device)
    _send_and_receive([torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)], [theirs], right, left,
                      group)
    skeleton = pickle.loads(theirs.cpu().numpy().tobytes())   # a peer rank of this same run sent it
    slots = _slots(skeleton)
    groups = _dtype_groups(slots)
    incoming = _empty_flats(groups, device)
    _send_and_receive(_flatten(_dtype_groups(_slots(mine)), tensors, device), incoming, right, left, group)
    # Views: the received buffers are the copy kept (no second copy of a neighbour's state).
    return _fill_tree(skeleton, _unflatten(slots, groups, incoming, device, copy=False))


def _dtype_groups(slots: list[_TensorSlot]) -> list[tuple[torch.dtype, list[_TensorSlot]]]:
    """A state's tensors by dtype, in a fixed order, without the dtypes that have no element:
    both ends of a transfer compute the same groups from the same skeleton, one flat buffer each."""
    groups: dict[torch.dtype, list[_TensorSlot]] = {}
    for s in slots:
        groups.setdefault(s.dtype, []).append(s)
    return [(dtype, group) for dtype, group in sorted(groups.items(), key=lambda item: str(item[0]))
            if sum(_numel(s.shape) for s in group) > 0]


def _flatten(groups: list[tuple[torch.dtype, list[_TensorSlot]]], tensors: list[torch.Tensor],
             device: torch.device) -> list[torch.Tensor]:
    """The sender's flat buffers, one per group."""
    return [torch.cat([tensors[s.index].reshape(-1).to(device) for s in group]) for _, group in groups]


def _empty_flats(groups: list[tuple[torch.dtype, list[_TensorSlot]]], device: torch.device) -> list[torch.Tensor]:
    """The receiver's flat buffers, one per group."""
    return [torch.empty(sum(_numel(s.shape) for s in group), dtype=dtype, device=device) for dtype, group in groups]


def _unflatten(slots: list[_TensorSlot], groups: list[tuple[torch.dtype, list[_TensorSlot]]],
               flats: list[torch.Tensor], device: torch.device, *, copy: bool) -> dict[int, torch.Tensor]:
    """Every slot's tensor out of the received flat buffers (views, or copies with `copy`);
    empty tensors travel as their shape alone."""
    tensors: dict[int, torch.Tensor] = {}
    for (_, group), flat in zip(groups, flats, strict=True):
        offset = 0
        for s in group:
            n = _numel(s.shape)
            view = flat[offset:offset + n].view(s.shape)
            tensors[s.index] = view.clone() if copy else view
            offset += n
    for s in slots:
        if s.index not in tensors:
            tensors[s.index] = torch.empty(s.shape, dtype=s.dtype, device=device)
    return tensors


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _send_and_receive(outgoing: list[torch.Tensor], incoming: list[torch.Tensor], to: int, source: int,
                      group: dist.ProcessGroup | None = None) -> None:
    """`to` and `source` are global ranks (P2POp's peers), members of `group`."""
    ops = [dist.P2POp(dist.isend, t, to, group) for t in outgoing]
    ops += [dist.P2POp(dist.irecv, t, source, group) for t in incoming]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

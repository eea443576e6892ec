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


def broadcast_state(state: Any | None, src: int, device: torch.device) -> Any:
    """Collective: rank `src` passes its state, every other rank passes None; all return it.

    The source gets its own objects back (no copy); receivers get fresh tensors on `device`.
    """
    is_src = dist.get_rank() == src
    tensors: list[torch.Tensor] = []
    skeleton = _split_tree(state, tensors) if is_src else None
    box = [skeleton]
    dist.broadcast_object_list(box, src=src)
    skeleton = box[0]
    if is_src:
        by_index = dict(enumerate(tensors))
    else:
        by_index = {}
    slots = _slots(skeleton)
    for dtype in sorted({s.dtype for s in slots}, key=str):
        group = [s for s in slots if s.dtype == dtype]
        numel = sum(_numel(s.shape) for s in group)
        if is_src:
            flat = torch.cat([by_index[s.index].reshape(-1).to(device) for s in group])   # never empty
        else:
            flat = torch.empty(numel, dtype=dtype, device=device)
        dist.broadcast(flat, src=src)
        if not is_src:
            offset = 0
            for s in group:
                n = _numel(s.shape)
                by_index[s.index] = flat[offset:offset + n].view(s.shape).clone()
                offset += n
    return state if is_src else _fill_tree(skeleton, by_index)


def swap_ring(state: Any, device: torch.device) -> Any:
    """Collective: every rank sends `state` to the next rank (rank + 1, around the ring) and
    returns what the previous one sent it; tensors arrive on `device`.

    Point to point, so the bytes each rank moves do not grow with the world size: a skeleton's
    length, the skeleton, then one flat buffer per dtype, each a send and a receive posted
    together (no rank waits for its receiver before it can receive)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    tensors: list[torch.Tensor] = []
    mine = _split_tree(state, tensors)
    blob = pickle.dumps(mine)
    length = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    their_length = torch.empty(1, dtype=torch.int64, device=device)
    _send_and_receive([length], [their_length], right, left)
    theirs = torch.empty(int(their_length.item()), dtype=torch.uint8, device=device)
    _send_and_receive([torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)], [theirs], right, left)
    skeleton = pickle.loads(theirs.cpu().numpy().tobytes())   # a peer rank of this same run sent it
    # One buffer per dtype that has elements (both ends skip the same empty ones).
    mine_slots = _slots(mine)
    outgoing = [torch.cat([tensors[s.index].reshape(-1).to(device) for s in mine_slots if s.dtype == dtype])
                for dtype in _dtypes(mine_slots)]
    slots = _slots(skeleton)
    dtypes = _dtypes(slots)
    incoming = [torch.empty(sum(_numel(s.shape) for s in slots if s.dtype == dtype), dtype=dtype, device=device)
                for dtype in dtypes]
    _send_and_receive(outgoing, incoming, right, left)
    received: dict[int, torch.Tensor] = {}
    for dtype, flat in zip(dtypes, incoming, strict=True):
        offset = 0
        for s in (s for s in slots if s.dtype == dtype):
            n = _numel(s.shape)
            # Views: the received buffer is the copy kept (no second copy of a neighbour's state).
            received[s.index] = flat[offset:offset + n].view(s.shape)
            offset += n
    for s in slots:
        if s.index not in received:       # empty tensors travel as their shape alone
            received[s.index] = torch.empty(s.shape, dtype=s.dtype, device=device)
    return _fill_tree(skeleton, received)


def _dtypes(slots: list[_TensorSlot]) -> list[torch.dtype]:
    return sorted({s.dtype for s in slots if _numel(s.shape) > 0}, key=str)


def _send_and_receive(outgoing: list[torch.Tensor], incoming: list[torch.Tensor], to: int, source: int) -> None:
    ops = [dist.P2POp(dist.isend, t, to) for t in outgoing] + [dist.P2POp(dist.irecv, t, source) for t in incoming]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

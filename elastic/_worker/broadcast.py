"""Warm recovery's transfer: a nested state broadcast from the source rank to every other.

Warm recovery sends a nested state (a TrainState's state dict) from one rank to all others.
Pickling every tensor through broadcast_object_list would copy it several times, so only the
skeleton (structure, shapes, dtypes) is pickled; tensor payloads travel as one flat
buffer per dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split_tree(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree.detach())
        return _TensorSlot(len(tensors) - 1, tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: _split_tree(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_split_tree(v, tensors) for v in tree)
    return tree


def _fill_tree(skeleton: Any, tensors: dict[int, torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill_tree(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill_tree(v, tensors) for v in skeleton)
    return skeleton


def _slots(skeleton: Any) -> list[_TensorSlot]:
    if isinstance(skeleton, _TensorSlot):
        return [skeleton]
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

"""In-memory training state: broadcast from the warm source rank, and the model hash.

Warm recovery sends a nested state (model + optimizer state dicts, counters) from one rank to
all others. Pickling every tensor through broadcast_object_list would copy it several times, so
only the skeleton (structure, shapes, dtypes) is pickled; tensor payloads travel as one flat
buffer per dtype.
"""
from __future__ import annotations

import hashlib
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
            flat = torch.cat([by_index[s.index].reshape(-1).to(device) for s in group]) if group else None
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


def state_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """Hash of a full model state dict: identical for bitwise-identical training."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        value = state_dict[key]
        digest.update(key.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)
            digest.update(str(t.dtype).encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def mix_seed(*parts: Any) -> int:
    """A 63-bit seed from (seed, step, rank, ...), stable across processes and Python runs."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


DATA_ORDER_START = "0" * 64


def chain_sample_ids(digest: str, ids) -> str:
    """Extend the data-order hash by `ids`, one sample at a time.

    Per sample, not per step, so the hash depends only on the ordered list of consumed samples:
    the same samples in the same order give the same hash at any world size (the global batch,
    hence the grouping into steps, changes with it).
    """
    h = bytes.fromhex(digest)
    for sample in ids:
        h = hashlib.sha256(h + int(sample).to_bytes(8, "little", signed=True)).digest()
    return h.hex()

"""Determinism: the seeds, hashes and data-order digests that make a run reproducible.

Randomness is seeded per (seed, step, rank) from `mix_seed`; the model hash (`state_sha256`) is
equal for bitwise-equal training; the data-order hash chains every consumed sample id, so equal
hashes mean the same samples in the same order at any world size.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch


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

"""A copy's trip to its node's keeper and back (elastic._node_keeper): the tensors travel as
numpy bytes that pickle out of band, and come back bit for bit, as tensors of their own memory."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from elastic._node_keeper import NodeKeeper, PackedState, PackedTensor, pack_tensors, unpack_tensors
from elastic._worker.replicas import ShardPiece

pytestmark = pytest.mark.timeout(30)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=g)
    return {
        "model": {"w": weight.t(),                                   # not contiguous
                  "b": torch.randn(48, generator=g).to(torch.bfloat16),
                  "piece": ShardPiece(torch.randn(8, 48, generator=g), offset=(8, 0), shape=(64, 48))},
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(3, dtype=torch.float64)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "extra": {"step": 7, "rng": torch.get_rng_state(), "mask": torch.tensor([True, False]),
                  "ids": (torch.arange(5), "kept as is")},
    }


def _leaves(value) -> list:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, ShardPiece):
        return _leaves(value.local)
    return [value]


def test_a_packed_copy_holds_no_tensor_and_unpacks_bit_for_bit():
    state = _state()
    packed = pack_tensors(state)
    tensors = [x for x in _leaves(state) if isinstance(x, torch.Tensor)]
    assert isinstance(packed, PackedState) and len(packed.tensors) == len(tensors)
    assert all(isinstance(t, PackedTensor) for t in packed.tensors)
    assert packed.skeleton["model"]["piece"].offset == (8, 0) and packed.skeleton["extra"]["step"] == 7
    back = unpack_tensors(packed)
    for got, want in zip(_leaves(back), _leaves(state), strict=True):
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        else:
            assert got == want
    assert back["extra"]["ids"][1] == "kept as is" and back["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_the_bytes_pickle_out_of_band_and_the_unpacked_tensors_own_their_memory():
    """Ray pickles with protocol 5 and takes out-of-band buffers into the object store as they
    are: a packed copy's pickle is the structure only, where torch tensors pickle their data."""
    state = _state()
    data_bytes = sum(x.numel() * x.element_size() for x in _leaves(state) if isinstance(x, torch.Tensor))
    buffers: list[pickle.PickleBuffer] = []
    in_band = pickle.dumps(pack_tensors(state), protocol=5, buffer_callback=buffers.append)
    assert sum(b.raw().nbytes for b in buffers) >= data_bytes - 1024 and len(in_band) < 8192
    assert len(pickle.dumps(state, protocol=5, buffer_callback=[].append)) > data_bytes     # torch: in band
    # Read-only bytes, as Ray maps the object store: the unpacked tensor is a writable copy.
    received = pickle.loads(in_band, buffers=[memoryview(b.raw()).toreadonly() for b in buffers])
    back = unpack_tensors(received)
    back["model"]["w"].add_(1.0)
    assert torch.equal(back["model"]["w"], state["model"]["w"] + 1.0)


def test_the_keeper_keeps_its_own_bytes_not_the_object_stores():
    readonly = np.frombuffer(bytes(range(16)), dtype=np.uint8)          # as Ray hands an argument over
    assert not readonly.flags.writeable
    keeper = NodeKeeper()
    skeleton = pack_tensors({"w": torch.zeros(4)}).skeleton
    keeper.hold(1, 2, 0, 10, PackedState(skeleton, (PackedTensor(readonly, "float32", (4,)),)))
    kept = keeper.copy(1, 2, 0, 10)
    (bytes_kept,) = kept.tensors
    assert bytes_kept.data.flags.owndata and bytes_kept.data.flags.writeable
    assert bytes(bytes_kept.data) == bytes(range(16))
    assert torch.equal(unpack_tensors(kept)["w"], torch.frombuffer(bytearray(range(16)), dtype=torch.float32))

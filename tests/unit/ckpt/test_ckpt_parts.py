"""Unit tests of the pieces: staging, storage URL handling, manifest, manager validation."""

from __future__ import annotations

import collections

import pytest
import torch

from checkpointing import CheckpointManager, FencedError, read_fence
from checkpointing import manifest as mf
from checkpointing.staging import stage_state_dict, state_nbytes
from checkpointing.storage import Storage, _fs_options


def test_staging_copies_and_reuses_buffers():
    Pair = collections.namedtuple("Pair", "a b")
    state = {"t": torch.arange(6.0).reshape(2, 3), "nested": {"l": [torch.ones(2), 3]},
             "tup": Pair(torch.zeros(1), "x"), "py": {"step": 4, "hist": [1, 2]}}
    staged = stage_state_dict(state)
    state["t"].add_(10)
    state["py"]["hist"].append(3)
    assert torch.equal(staged["t"], torch.arange(6.0).reshape(2, 3))
    assert staged["py"] == {"step": 4, "hist": [1, 2]}
    assert isinstance(staged["tup"], Pair) and staged["tup"].b == "x"
    again = stage_state_dict(state, staged)
    assert again["t"] is staged["t"] and torch.equal(again["t"], state["t"])  # buffer reused
    assert again["t"].data_ptr() != state["t"].data_ptr()
    assert state_nbytes(state) == (6 + 2 + 1) * 4


def test_a_staged_shard_carries_its_sources_spec_not_an_equal_one_of_an_earlier_group(one_rank_group):
    """Meshes compare equal by their ranks, whatever this process's index in them: after a
    re-form that moved this rank, the previous save's spec would place its shard at its old
    rank's offset (found by the mixed-fsdp chaos campaign: a preempted rank's survivors then
    failed every save with DCP's "invalid fill" of the global plan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    old_mesh, new_mesh = init_device_mesh("cpu", (1,)), init_device_mesh("cpu", (1,))
    assert old_mesh == new_mesh and old_mesh is not new_mesh
    before = stage_state_dict({"w": DTensor.from_local(torch.ones(4, 2), old_mesh, [Shard(0)])})
    source = DTensor.from_local(torch.full((4, 2), 2.0), new_mesh, [Shard(0)])
    after = stage_state_dict({"w": source}, before)
    assert after["w"].device_mesh is new_mesh and after["w"]._spec is source._spec
    assert after["w"]._local_tensor is before["w"]._local_tensor      # the buffer is still reused
    assert torch.equal(after["w"].to_local(), torch.full((4, 2), 2.0))


def test_storage_urls_and_s3_options(monkeypatch, tmp_path):
    local = Storage(str(tmp_path / "a"))
    assert local.is_local and local.path("checkpoints", "x") == f"{tmp_path}/a/checkpoints/x"
    assert Storage(f"file://{tmp_path}/a").root == local.root
    mem = Storage("memory://bucket/x/")
    assert not mem.is_local and mem.url_for(mem.path("c")).startswith("memory://")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    opts = _fs_options("s3://b/p", None)
    assert opts["endpoint_url"] == "http://127.0.0.1:1" and opts["use_listings_cache"] is False
    assert opts["skip_instance_cache"] is True
    assert _fs_options("s3://b/p", {"endpoint_url": "http://x"})["endpoint_url"] == "http://x"


def test_manifest_round_trip_and_fence(memory_url):
    raw = mf.encode_manifest(12, 4, 2, "g000002", {"g000002/a": {"size": 3, "sha256": "ab" * 32}})
    info = mf.decode_manifest(raw, "memory://x/checkpoints/step_00000012")
    assert (info.step, info.world_size, info.generation, info.data_dir) == (12, 4, 2, "g000002")
    with pytest.raises(mf.CorruptCheckpointError):
        mf.decode_manifest(b"{not json", "memory://x")
    assert read_fence(memory_url) is None
    mgr = CheckpointManager(memory_url)
    mgr.set_generation(3)
    assert read_fence(memory_url) == 3
    with pytest.raises(FencedError, match="generation 3"):
        mgr.save(1, {"w": torch.zeros(1)}, generation=2)


@pytest.mark.parametrize("kwargs", [{"keep": 0}, {"max_consecutive_failures": 0},
                                    {"collective_timeout_s": 0}])
def test_manager_rejects_bad_settings(memory_url, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CheckpointManager(memory_url, **kwargs)


@pytest.mark.timeout(30)
def test_abandon_does_not_block_and_next_save_works(memory_url):
    import threading

    from ckpt_conformance import flaky, make_state

    mgr = CheckpointManager(memory_url)
    fs = flaky(mgr)
    fs.gate = threading.Event()
    mgr.save(1, make_state(1), generation=0)
    assert fs.writes_started.wait(10)
    mgr.abandon()  # returns although the upload is stuck
    assert mgr.in_flight_step is None and mgr.consecutive_failures == 0
    fs.gate.set()
    mgr.save(2, make_state(2), generation=0)
    assert mgr.wait().step == 2
    mgr.close()
    with pytest.raises(Exception, match="after close"):
        mgr.save(3, make_state(3), generation=0)

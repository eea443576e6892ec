"""The storage conformance suite: one set of checkpoint tests every backend must pass.

Subclasses provide a `url` fixture (a fresh, empty checkpoint root): memory:// and local files
in tests/unit/ckpt/test_ckpt_conformance.py, a real S3 endpoint (moto server over HTTP) in
tests/integration/ckpt/test_ckpt_conformance_s3.py. Single process, no Ray.
"""

from __future__ import annotations

import json
import logging
import pickle
import threading

import pytest
import torch

from checkpointing import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    FencedError,
    StorageError,
    latest_committed,
)
from checkpointing import manifest as mf


class FlakyFS:
    """Wraps an fsspec filesystem: refuses writes, or holds them at a gate, on demand."""

    def __init__(self, fs) -> None:
        self._fs = fs
        self.fail_writes = False
        self.gate: threading.Event | None = None
        self.writes_started = threading.Event()
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def _before_write(self, path: str) -> None:
        self.writes_started.set()
        if self.gate is not None and not self.gate.wait(timeout=60):
            raise TimeoutError("test gate never opened")
        if self.fail_writes:
            self.refused += 1
            raise PermissionError(f"injected: storage refuses writes ({path})")

    def open(self, path, mode="rb", **kwargs):
        if any(c in mode for c in "wa+"):
            self._before_write(path)
        return self._fs.open(path, mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        self._before_write(path)
        return self._fs.pipe_file(path, value, **kwargs)


def flaky(mgr: CheckpointManager) -> FlakyFS:
    wrapper = FlakyFS(mgr.storage.fs)
    mgr.storage.fs = wrapper
    return wrapper


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "optim": {"state": {"w": {"step": torch.tensor(float(seed))}}, "param_groups": [{"lr": 0.1}]},
        "extra": {"step": seed, "samples_seen": seed * 8, "rng": b"\x01\x02" * seed, "hist": [seed, 2]},
    }


def blank_state() -> dict:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
        "optim": {"state": {"w": {"step": torch.tensor(0.0)}}, "param_groups": [{"lr": 0.0}]},
        "extra": {"step": -1, "samples_seen": -1, "rng": b"", "hist": []},
    }


def assert_state(state: dict, seed: int) -> None:
    want = make_state(seed)
    assert torch.equal(state["model"]["w"], want["model"]["w"])
    assert torch.equal(state["model"]["b"], want["model"]["b"])
    assert torch.equal(state["optim"]["state"]["w"]["step"], want["optim"]["state"]["w"]["step"])
    assert state["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert state["extra"] == want["extra"]


def flip_byte(mgr: CheckpointManager, step: int, name_suffix: str = ".distcp") -> str:
    """Flip one byte in the middle of a shard of `step`, keeping its size."""
    info = mf.read_manifest(mgr.storage, step)
    rel = next(r for r in sorted(info.files) if r.endswith(name_suffix))
    path = f"{mf.step_path(mgr.storage, step)}/{rel}"
    data = bytearray(mgr.storage.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    mgr.storage.fs.pipe_file(path, bytes(data))
    return rel


class ConformanceSuite:
    """Every test gets a fresh, empty `url` from the subclass."""

    @pytest.mark.timeout(30)
    @pytest.mark.parametrize("async_save", [False, True])
    def test_commit_roundtrip(self, url, async_save):
        with CheckpointManager(url, async_save=async_save) as mgr:
            assert mgr.load_latest(blank_state()) is None
            assert latest_committed(url) is None
            mgr.save(10, make_state(10), generation=4)
            info = mgr.wait()
        assert info is not None and (info.step, info.world_size, info.generation) == (10, 1, 4)
        assert any(r.endswith(".metadata") for r in info.files)
        assert all(set(f) == {"size", "sha256"} and f["size"] > 0 for f in info.files.values())
        doc = json.loads(mgr.storage.read_bytes(f"{mf.step_path(mgr.storage, 10)}/COMMITTED"))
        assert {"step", "world_size", "generation", "files"} <= set(doc)
        assert latest_committed(url) == info
        state = blank_state()
        result = CheckpointManager(url).load_latest(state)
        assert (result.step, result.world_size, result.generation, result.skipped) == (10, 1, 4, [])
        assert result.path == info.path
        assert_state(state, 10)

    @pytest.mark.timeout(30)
    def test_uncommitted_directory_is_not_a_checkpoint_and_is_collected(self, url):
        mgr = CheckpointManager(url, async_save=False)
        mgr.save(1, make_state(1), generation=0)
        mgr._before_commit = lambda: (_ for _ in ()).throw(RuntimeError("crash before commit"))
        mgr.save(2, make_state(2), generation=0)
        assert mgr.wait() is None and isinstance(mgr.last_error, CheckpointError)
        assert mgr.storage.find(mf.step_path(mgr.storage, 2))  # shards were written...
        assert [c.step for c in mgr.committed()] == [1]  # ...but step 2 is not a checkpoint
        state = blank_state()
        assert mgr.load_latest(state).step == 1
        assert_state(state, 1)
        mgr.gc()
        assert mf.list_steps(mgr.storage) == [1]

    @pytest.mark.timeout(30)
    def test_flipped_byte_falls_back_with_warning(self, url, caplog):
        mgr = CheckpointManager(url, async_save=False, keep=None)
        for step in (1, 2, 3):
            mgr.save(step, make_state(step), generation=0)
        rel = flip_byte(mgr, 3)
        state = blank_state()
        with caplog.at_level(logging.WARNING, logger="checkpointing"):
            result = mgr.load_latest(state)
        assert result.step == 2
        assert [s["step"] for s in result.skipped] == [3] and rel in result.skipped[0]["reason"]
        assert "sha256" in result.skipped[0]["reason"]
        assert any("step 3" in r.message and "falling back" in r.message for r in caplog.records)
        assert_state(state, 2)

    @pytest.mark.timeout(30)
    def test_truncated_file_falls_back_and_all_corrupt_raises(self, url):
        mgr = CheckpointManager(url, async_save=False, keep=None)
        mgr.save(1, make_state(1), generation=0)
        mgr.save(2, make_state(2), generation=0)
        info = mf.read_manifest(mgr.storage, 2)
        meta = next(r for r in info.files if r.endswith(".metadata"))
        path = f"{mf.step_path(mgr.storage, 2)}/{meta}"
        mgr.storage.fs.pipe_file(path, mgr.storage.read_bytes(path)[:-3])
        result = mgr.load_latest(blank_state())
        assert result.step == 1 and "size" in result.skipped[0]["reason"]
        flip_byte(mgr, 1)
        with pytest.raises(CorruptCheckpointError, match="verify"):
            mgr.load_latest(blank_state())

    @pytest.mark.timeout(30)
    def test_retention_keeps_newest_and_gc_removes_partials(self, url):
        mgr = CheckpointManager(url, async_save=True, keep=2)
        for step in (1, 2, 3, 4):
            mgr.save(step, make_state(step), generation=0)
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [3, 4]
        # A partial directory (no COMMITTED) of a crashed save.
        with mgr.storage.open_write(f"{mf.step_path(mgr.storage, 5)}/g000000/__0_0.distcp") as f:
            f.write(b"x")
        assert mf.list_steps(mgr.storage) == [3, 4, 5]
        mgr.gc()
        assert mf.list_steps(mgr.storage) == [3, 4]
        mgr.close()

    @pytest.mark.timeout(30)
    def test_gc_spares_a_live_save_and_staging_snapshots_state(self, url):
        mgr = CheckpointManager(url, async_save=True, keep=1)
        mgr.save(1, make_state(1), generation=0)
        mgr.wait()
        fs = flaky(mgr)
        fs.gate = threading.Event()
        state = make_state(2)
        mgr.save(2, state, generation=0)
        state["model"]["w"].add_(100.0)  # training goes on during the upload
        state["extra"]["hist"].append("later")
        assert fs.writes_started.wait(10) and mgr.in_flight_step == 2
        mgr.gc()  # must not delete the live save's directory
        fs.gate.set()
        assert mgr.wait().step == 2
        loaded = blank_state()
        CheckpointManager(url).load_latest(loaded)
        assert_state(loaded, 2)
        assert [c.step for c in mgr.committed()] == [2]  # keep=1
        mgr.close()

    @pytest.mark.timeout(30)
    def test_second_save_waits_for_previous_upload(self, url):
        mgr = CheckpointManager(url, async_save=True)
        fs = flaky(mgr)
        fs.gate = threading.Event()
        order: list[str] = []
        mgr.save(1, make_state(1), generation=0)
        assert fs.writes_started.wait(10)

        def second():
            mgr.save(2, make_state(2), generation=0)
            order.append("save2 returned")

        t = threading.Thread(target=second)
        t.start()
        order.append("gate opened")
        fs.gate.set()
        t.join(20)
        assert not t.is_alive()
        assert order == ["gate opened", "save2 returned"]
        assert mgr.last_commit.step == 1  # recorded before save 2 started staging
        assert mgr.wait().step == 2
        mgr.close()

    @pytest.mark.timeout(60)
    def test_failed_uploads_are_recorded_then_raise_after_limit(self, url):
        mgr = CheckpointManager(url, async_save=True, max_consecutive_failures=2)
        mgr.save(1, make_state(1), generation=0)
        assert mgr.wait().step == 1
        fs = flaky(mgr)
        fs.fail_writes = True
        mgr.save(2, make_state(2), generation=0)
        assert mgr.wait() is None  # recorded, not raised: training goes on
        assert isinstance(mgr.last_error, StorageError) and mgr.consecutive_failures == 1
        assert mf.read_manifest(mgr.storage, 2) is None
        fs.fail_writes = False
        mgr.save(3, make_state(3), generation=0)
        assert mgr.wait().step == 3 and mgr.consecutive_failures == 0
        assert mgr.last_error is None      # a commit clears it: it never names an older save's failure
        fs.fail_writes = True
        mgr.save(4, make_state(4), generation=0)
        assert mgr.wait() is None
        mgr.save(5, make_state(5), generation=0)
        with pytest.raises(CheckpointError) as err:
            mgr.wait()
        msg = str(err.value)
        assert url.split("://")[-1] in msg and "max_consecutive_failures=2" in msg
        assert "refuses writes" in msg
        with pytest.raises(CheckpointError):
            mgr.save(6, make_state(6), generation=0)
        assert [c.step for c in mgr.committed()] == [1, 3]
        mgr.close()

    @pytest.mark.timeout(30)
    def test_fenced_generation_writes_nothing(self, url):
        zombie = CheckpointManager(url, async_save=True)  # has not seen the new generation
        zombie.save(1, make_state(1), generation=1)
        assert zombie.wait().step == 1
        controller = CheckpointManager(url)
        controller.set_generation(2)
        zombie.save(5, make_state(5), generation=1)
        assert zombie.wait() is None and isinstance(zombie.last_error, FencedError)
        assert zombie.consecutive_failures == 0
        assert not zombie.storage.exists(mf.step_path(zombie.storage, 5))
        with pytest.raises(FencedError, match="generation 2"):
            zombie.save(6, make_state(6), generation=1)
        with pytest.raises(FencedError):
            controller.set_generation(1)
        controller.set_generation(2)  # idempotent
        worker = CheckpointManager(url, async_save=False)
        worker.save(5, make_state(5), generation=2)
        assert [c.step for c in worker.committed()] == [1, 5]

    @pytest.mark.timeout(30)
    def test_fence_raised_during_upload_blocks_the_commit(self, url):
        mgr = CheckpointManager(url, async_save=False)
        mgr._before_commit = lambda: CheckpointManager(url).set_generation(9)
        mgr.save(3, make_state(3), generation=8)
        assert isinstance(mgr.last_error, FencedError)
        assert mf.read_manifest(mgr.storage, 3) is None
        assert latest_committed(url) is None


def test_errors_pickle_round_trip():
    for cls in (CheckpointError, StorageError, CorruptCheckpointError, FencedError):
        err = cls("writing s3://b/x failed; set storage_options", url="s3://b/x")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err) and back.url == "s3://b/x"
        assert isinstance(back, CheckpointError)

"""Regressions of the reliability review's checkpointing findings (F1, F2, F3, F7, F16, F20).

Each test reproduces a finding on memory:// and local files; it failed on the code the review
read (9ef712a..3cd9f98) and passes now. The S3 variants are in
tests/integration/ckpt/test_ckpt_conditional_s3.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import threading
import weakref

import pytest
import torch

from checkpointing import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    FencedError,
    StorageError,
    latest_committed,
    read_fence,
    retention,
)
from checkpointing import manifest as mf
from checkpointing.storage import Storage
from ckpt_conformance import assert_state, blank_state, flaky, make_state


def _dummy_files(storage: Storage, step: int, generation: int) -> dict:
    """A generation's data directory with a fake `.metadata` and shard; its file records."""
    data_dir = mf.data_dir_name(generation)
    records = {}
    for name, payload in ((".metadata", b"meta %d" % generation), ("__0_0.distcp", b"shard %d" % generation)):
        with storage.open_write(f"{mf.step_path(storage, step)}/{data_dir}/{name}") as f:
            f.write(payload)
        records[name] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    return records


def _manifest_bytes(step: int, generation: int, records: dict) -> bytes:
    data_dir = mf.data_dir_name(generation)
    return mf.encode_manifest(step, 1, generation, data_dir, {f"{data_dir}/{k}": v for k, v in records.items()})


def _before_commit_put(storage: Storage, action) -> None:
    """Run `action` once, right before `storage` issues its PUT of a COMMITTED (whichever write
    method the commit protocol uses), as a stalled writer would see the world change."""
    fired = []
    for name in ("write_atomic", "put_if"):
        original = getattr(storage, name, None)
        if original is None:
            continue

        def wrapped(path, *args, _original=original, **kwargs):
            if path.endswith("/" + mf.MANIFEST_NAME) and not fired:
                fired.append(path)
                action()
            return _original(path, *args, **kwargs)

        setattr(storage, name, wrapped)


# ---- F1 ------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_f1_late_commit_of_a_fenced_writer_cannot_replace_the_newer_generations_manifest(url):
    """The review's repro: generation 1 passes its checks, then stalls; meanwhile FENCE goes to 2
    and generation 2 commits the same step. Generation 1's PUT must not replace that manifest,
    and GC must not delete generation 2's data."""
    from checkpointing._groups import GroupView
    from checkpointing._save import SaveJob, _commit

    st = Storage(url)
    rec1 = _dummy_files(st, 100, 1)
    rec2 = _dummy_files(st, 100, 2)
    other = Storage(url)  # generation 2's own process

    def generation_2_commits():
        mf.write_fence(other, 2)
        other.write_atomic(f"{mf.step_path(other, 100)}/{mf.MANIFEST_NAME}", _manifest_bytes(100, 2, rec2))

    _before_commit_put(st, generation_2_commits)
    with pytest.raises(FencedError):
        _commit(SaveJob(st, 100, 1, {}, GroupView(None, 0, 1)), [rec1])
    assert read_fence(url) == 2
    assert mf.read_manifest(st, 100).generation == 2
    report = retention.collect(Storage(url), keep=1)
    assert not any(p.endswith("g000002") for p in report["deleted"])
    assert Storage(url).exists(f"{mf.step_path(st, 100)}/g000002/__0_0.distcp")
    assert not Storage(url).exists(f"{mf.step_path(st, 100)}/g000001")  # the zombie's data goes


@pytest.mark.timeout(30)
def test_f1_a_fenced_writers_retention_does_not_delete_the_new_generations_save_in_progress(url):
    """Generation 1 commits just before FENCE moves; generation 2 starts writing step 20. The
    retention pass generation 1 runs after its commit must leave step 20 alone."""
    zombie = CheckpointManager(url, async_save=False, keep=1)
    zombie.save(10, make_state(10), generation=1)
    newer = Storage(url)
    in_progress = f"{mf.step_path(newer, 20)}/g000002/__0_0.distcp"
    # Right after the zombie's COMMITTED lands (before its retention pass): generation 2 forms.
    for name in ("write_atomic", "put_if"):
        original = getattr(zombie.storage, name, None)
        if original is None:
            continue

        def wrapped(path, *args, _original=original, **kwargs):
            out = _original(path, *args, **kwargs)
            if path.endswith(f"{mf.step_dir_name(15)}/{mf.MANIFEST_NAME}"):
                mf.write_fence(newer, 2)
                with newer.open_write(in_progress) as f:
                    f.write(b"generation 2 is writing this")
            return out

        setattr(zombie.storage, name, wrapped)
    zombie.save(15, make_state(15), generation=1)
    assert newer.exists(in_progress), "the zombie's retention deleted generation 2's save in progress"


@pytest.mark.timeout(30)
def test_f1_gc_never_touches_a_newer_generations_data(url):
    mgr = CheckpointManager(url, async_save=False, keep=1)
    mgr.set_generation(1)
    mgr.save(10, make_state(10), generation=1)
    st = Storage(url)
    _dummy_files(st, 10, 2)   # a newer generation re-saving step 10
    _dummy_files(st, 30, 2)   # and writing step 30
    report = retention.collect(st, keep=1, writer_generation=1)
    assert report["kept"] == [10] and not report["deleted"]
    assert st.exists(f"{mf.step_path(st, 10)}/g000002/.metadata")
    assert st.exists(f"{mf.step_path(st, 30)}/g000002/.metadata")
    mf.write_fence(st, 2)
    skipped = retention.collect(st, keep=1, writer_generation=1)  # FENCE moved: no pass at all
    assert "skipped" in skipped and not skipped["deleted"]


@pytest.mark.timeout(30)
def test_f1_fence_update_is_a_compare_and_swap(url):
    """Two controllers update FENCE at once: the one whose read is stale must fail, not write the
    fence back to an older generation."""
    a, b = CheckpointManager(url), CheckpointManager(url)
    a.set_generation(3)
    raced = []
    for name in ("read_bytes", "read_versioned"):  # however the fence is read
        original = getattr(a.storage, name, None)
        if original is None:
            continue

        def read_then_race(path, *args, _original=original, **kwargs):
            data = _original(path, *args, **kwargs)
            if path.endswith("/" + mf.FENCE_NAME) and not raced:
                raced.append(True)
                b.set_generation(7)  # lands between a's read and a's write
            return data

        setattr(a.storage, name, read_then_race)
    with pytest.raises(FencedError, match="7"):
        a.set_generation(5)
    assert raced and read_fence(url) == 7


@pytest.mark.timeout(30)
def test_f1_fence_history_rejects_a_fenced_writers_commit_past_the_new_start_step(url, caplog):
    """Generation 2 restarted from step 10; a stalled generation-1 writer then commits step 15
    (no newer manifest existed to conflict with). Nobody may load it, GC deletes it, and
    generation 2 may commit step 15 over it."""
    writer = CheckpointManager(url, async_save=False, keep=None)
    writer.save(10, make_state(10), generation=1)
    controller = CheckpointManager(url)
    # The zombie's late commit: it passed its last fence check before FENCE moved.
    st = Storage(url)
    rec = _dummy_files(st, 15, 1)
    controller.set_generation(2, start_step=10)
    st.write_atomic(f"{mf.step_path(st, 15)}/{mf.MANIFEST_NAME}", _manifest_bytes(15, 1, rec))
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        assert [c.step for c in controller.committed()] == [10]
    assert any("fenced writer" in r.message for r in caplog.records)
    assert latest_committed(url).step == 10
    state = blank_state()
    assert CheckpointManager(url).load_latest(state).step == 10
    assert_state(state, 10)
    retention.collect(st, keep=None)
    assert mf.read_manifest(st, 15) is None
    gen2 = CheckpointManager(url, async_save=False)
    gen2.save(15, make_state(15), generation=2)
    assert latest_committed(url).step == 15 and latest_committed(url).generation == 2


@pytest.mark.timeout(30)
def test_f1_newer_generation_and_same_generation_recommit_of_a_step_still_work(url):
    mgr = CheckpointManager(url, async_save=False, keep=None)
    mgr.save(10, make_state(10), generation=1)
    mgr.set_generation(2, start_step=10)
    mgr.save(10, make_state(11), generation=2)   # a newer generation re-commits the step
    assert mf.read_manifest(mgr.storage, 10).generation == 2
    mgr.save(10, make_state(12), generation=2)   # and the same generation again
    state = blank_state()
    assert CheckpointManager(url).load_latest(state).generation == 2
    assert_state(state, 12)
    assert mgr.consecutive_failures == 0


@pytest.mark.timeout(30)
def test_f1_a_commit_whose_put_response_was_lost_and_retried_is_a_success(url):
    """botocore/s3fs retry a PUT whose response was lost: the retry's If-None-Match fails
    because the first attempt landed. The commit must recognise its own manifest."""
    from checkpointing.storage import PreconditionFailed

    mgr = CheckpointManager(url, async_save=False)
    original = mgr.storage.put_if

    def lands_then_fails(path, data, **kwargs):
        original(path, data, **kwargs)
        if path.endswith(mf.MANIFEST_NAME):
            raise PreconditionFailed("412 on the retry of a PUT that landed")

    mgr.storage.put_if = lands_then_fails
    mgr.save(5, make_state(5), generation=0)
    assert mgr.last_error is None and mgr.last_commit.step == 5


# ---- F2 (generation ownership; the lease itself is in test_ckpt_lease.py) -------------------------
@pytest.mark.timeout(30)
def test_f2_two_controllers_cannot_take_the_same_generation(url):
    from checkpointing import RunConflictError
    a, b = CheckpointManager(url), CheckpointManager(url)
    a.set_generation(4, start_step=0, run_id="run-a")
    with pytest.raises(RunConflictError) as err:
        b.set_generation(4, start_step=0, run_id="run-b")
    assert err.value.owner == "run-a"
    a.set_generation(4, start_step=0, run_id="run-a")  # idempotent for the holder


# ---- F3 ------------------------------------------------------------------------------------------
def _other_run_manifest(victim_url: str) -> dict:
    """Another run's committed step 1, its manifest as JSON."""
    victim = CheckpointManager(victim_url, async_save=False)
    victim.save(1, make_state(1), generation=0)
    return json.loads(victim.storage.read_bytes(f"{mf.step_path(victim.storage, 1)}/{mf.MANIFEST_NAME}"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tamper", ["data_dir_escape", "key_dotdot", "key_absolute", "key_backslash",
                                    "key_outside_data_dir", "data_dir_not_generation"])
def test_f3_a_manifest_naming_paths_outside_its_step_is_corrupt_and_never_read(url, tamper, caplog):
    doc = _other_run_manifest(url + "-victim")
    mgr = CheckpointManager(url, async_save=False)
    sp = mf.step_path(mgr.storage, 1)
    # From <run>/checkpoints/step_00000001/ to <run>-victim/checkpoints/step_00000001/g000000.
    escape = "../../../" + url.rstrip("/").rsplit("/", 1)[-1] + "-victim/checkpoints/step_00000001/g000000"
    files = {k.split("/", 1)[1]: v for k, v in doc["files"].items()}
    if tamper == "data_dir_escape":
        doc["data_dir"] = escape
        doc["files"] = {f"{escape}/{k}": v for k, v in files.items()}
    elif tamper == "key_dotdot":
        doc["files"] = {f"g000000/../../step_00000002/g000000/{k}": v for k, v in files.items()}
    elif tamper == "key_absolute":
        doc["files"] = {f"/g000000/{k}": v for k, v in files.items()}
    elif tamper == "key_backslash":
        doc["files"] = {f"g000000\\..\\{k}": v for k, v in files.items()}
    elif tamper == "key_outside_data_dir":
        doc["files"] = {f"g000007/{k}": v for k, v in files.items()}
    else:
        doc["data_dir"] = "other"
        doc["files"] = {f"other/{k}": v for k, v in files.items()}
    mgr.storage.write_atomic(f"{sp}/COMMITTED", json.dumps(doc).encode())
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        assert mgr.committed() == []
        assert mgr.load_latest(blank_state()) is None  # nothing read from the other run
    assert any("unreadable manifest" in r.message for r in caplog.records)
    with pytest.raises(CorruptCheckpointError):
        mf.read_manifest(mgr.storage, 1)


@pytest.mark.timeout(30)
def test_f3_dcp_metadata_cannot_make_a_load_read_files_the_manifest_does_not_list(url):
    """`.metadata` (verified against the manifest) names the files DCP reads; a tampered one
    pointing elsewhere must not be followed (here: a copy of a shard outside the data dir)."""
    mgr = CheckpointManager(url, async_save=False)
    mgr.save(1, make_state(1), generation=0)
    info = mf.read_manifest(mgr.storage, 1)
    sp = mf.step_path(mgr.storage, 1)
    meta_key = "g000000/.metadata"
    metadata = pickle.loads(mgr.storage.read_bytes(f"{sp}/{meta_key}"))
    shard = next(k for k in info.files if k.endswith(".distcp"))
    outside = f"{sp}/elsewhere.distcp"
    mgr.storage.write_atomic(outside, mgr.storage.read_bytes(f"{sp}/{shard}"))
    for index, si in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(si)(relative_path="../elsewhere.distcp", offset=si.offset,
                                                length=si.length)
    raw = pickle.dumps(metadata)
    mgr.storage.write_atomic(f"{sp}/{meta_key}", raw)
    doc = json.loads(mgr.storage.read_bytes(f"{sp}/COMMITTED"))
    doc["files"][meta_key] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    mgr.storage.write_atomic(f"{sp}/COMMITTED", json.dumps(doc).encode())
    with pytest.raises(CheckpointError, match="does not list"):
        CheckpointManager(url).load_latest(blank_state())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("async_save", [False, True])
def test_f3_meta_is_stored_as_strict_json_in_the_manifest_and_returned_by_load(url, async_save):
    mgr = CheckpointManager(url, async_save=async_save)
    meta = {"samples_seen": 640, "data_order": "abc", "lr_ramp": [1, 2.5], "loss": float("nan"),
            "nested": {"ok": True, "none": None}}
    mgr.save(8, make_state(8), generation=0, meta=meta)
    meta["samples_seen"] = -1  # a later change must not leak into the (async) save
    info = mgr.wait()
    want = {"samples_seen": 640, "data_order": "abc", "lr_ramp": [1, 2.5], "loss": None,
            "nested": {"ok": True, "none": None}}
    assert info.meta == want
    raw = mgr.storage.read_bytes(f"{mf.step_path(mgr.storage, 8)}/{mf.MANIFEST_NAME}")
    assert json.loads(raw)["meta"] == want and b"NaN" not in raw
    result = CheckpointManager(url).load_latest(blank_state())
    assert result.meta == want and latest_committed(url).meta == want
    with pytest.raises(TypeError, match="tensor"):
        mgr.save(9, make_state(9), generation=0, meta={"t": torch.zeros(1)})
    mgr.save(10, make_state(10), generation=0)
    mgr.close()
    assert CheckpointManager(url).load_latest(blank_state()).meta is None


# ---- F7 ------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_f7_the_failure_limit_stops_the_run_and_is_classified_fatal(memory_url, monkeypatch):
    """The review's repro: a save that fails with StorageError 3 times, then would succeed."""
    import checkpointing._save as save_module
    from elastic._worker.worker import classify_error
    real = save_module.run_save
    calls = []

    def flaky_run_save(job):
        calls.append(job.step)
        if len(calls) <= 3:
            raise StorageError("injected: ExpiredToken", url=memory_url)
        return real(job)

    monkeypatch.setattr(save_module, "run_save", flaky_run_save)
    mgr = CheckpointManager(memory_url, async_save=False, max_consecutive_failures=3)
    for step in (10, 20):
        mgr.save(step, make_state(step), generation=0)
    with pytest.raises(CheckpointError) as err:
        mgr.save(30, make_state(30), generation=0)
    assert classify_error(err.value) == "fatal"
    assert "max_consecutive_failures=3" in str(err.value) and "ExpiredToken" in str(err.value)
    assert pickle.loads(pickle.dumps(err.value)).args == err.value.args
    # Final: later saves raise it too (the run is over), without retrying the storage.
    with pytest.raises(CheckpointError) as again:
        mgr.save(40, make_state(40), generation=0)
    assert classify_error(again.value) == "fatal" and calls == [10, 20, 30]


@pytest.mark.timeout(30)
def test_f7_saves_broken_by_a_lost_peer_do_not_count(memory_url, monkeypatch):
    import checkpointing._save as save_module

    def broken_group(job):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: "
                           "Connection reset by peer")

    monkeypatch.setattr(save_module, "run_save", broken_group)
    mgr = CheckpointManager(memory_url, async_save=False, max_consecutive_failures=2)
    for step in range(5):
        mgr.save(step, make_state(step), generation=0)
    assert mgr.consecutive_failures == 0 and isinstance(mgr.last_error, RuntimeError)
    # The runtime may pass its own judgement (e.g. elastic._worker.worker.classify_error(e) == "comm").
    strict = CheckpointManager(memory_url, async_save=False, max_consecutive_failures=2,
                               peer_failure=lambda error: False)
    strict.save(1, make_state(1), generation=0)
    with pytest.raises(CheckpointError, match="max_consecutive_failures=2"):
        strict.save(2, make_state(2), generation=0)


# ---- F16 -----------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_f16_files_collected_during_a_load_because_a_newer_commit_appeared_is_retryable(url, monkeypatch):
    """keep=1: an abandoned save of the previous generation commits step 2 and deletes step 1
    while the new generation is verifying step 1."""
    mgr = CheckpointManager(url, async_save=False, keep=1)
    mgr.save(1, make_state(1), generation=0)
    real_verify = mf.verify_files
    raced = []

    def verify_while_a_late_commit_lands(storage, step, files):
        if not raced:
            raced.append(step)
            CheckpointManager(url, async_save=False, keep=1).save(2, make_state(2), generation=0)
        return real_verify(storage, step, files)

    monkeypatch.setattr(mf, "verify_files", verify_while_a_late_commit_lands)
    with pytest.raises(StorageError, match="retry"):
        CheckpointManager(url).load_latest(blank_state())
    state = blank_state()
    assert CheckpointManager(url).load_latest(state).step == 2  # the retry finds the newer one
    assert_state(state, 2)


@pytest.mark.timeout(30)
def test_f16_missing_files_with_nothing_newer_still_fall_back_and_then_are_corrupt(url):
    mgr = CheckpointManager(url, async_save=False, keep=None)
    mgr.save(1, make_state(1), generation=0)
    mgr.save(2, make_state(2), generation=0)
    info = mf.read_manifest(mgr.storage, 2)
    mgr.storage.rm(f"{mf.step_path(mgr.storage, 2)}/{next(k for k in info.files if k.endswith('.distcp'))}")
    result = mgr.load_latest(blank_state())
    assert result.step == 1 and "missing" in result.skipped[0]["reason"]


# ---- F20 -----------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_f20_an_abandoned_upload_stops_writing_commits_nothing_and_frees_its_staged_copy(url):
    mgr = CheckpointManager(url, async_save=True)
    fs = flaky(mgr)
    fs.gate = threading.Event()
    writes_after_abandon = []
    real_open = fs.open

    def counting_open(path, mode="rb", **kwargs):
        if "w" in mode and fs.gate.is_set():
            writes_after_abandon.append(path)
        return real_open(path, mode, **kwargs)

    fs.open = counting_open
    big = {"model": {f"w{i}": torch.randn(64, 64) for i in range(8)}}
    mgr.save(1, big, generation=0)
    assert fs.writes_started.wait(10)
    staged = weakref.ref(mgr._staged["model"]["w0"])
    thread = next(t for t in threading.enumerate() if t.name == "ckpt-upload-1")
    mgr.abandon()
    fs.gate.set()
    thread.join(20)
    assert not thread.is_alive()
    assert mf.read_manifest(mgr.storage, 1) is None  # cancelled: never committed
    assert writes_after_abandon == []  # no further file (.metadata) was started
    import gc
    gc.collect()
    assert staged() is None, "the abandoned save still holds its staged host copy"
    mgr.save(2, make_state(2), generation=0)
    assert mgr.wait().step == 2
    mgr.close()


def test_f20_a_failed_atomic_write_leaves_no_temp_file(tmp_path, monkeypatch):
    st = Storage(str(tmp_path / "run"))
    st.write_atomic(st.path("status.json"), b"{}")

    def no_space(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    for _ in range(3):
        with pytest.raises(StorageError, match="No space"):
            st.write_atomic(st.path("status.json"), b'{"a": 1}')
    assert sorted(os.listdir(tmp_path / "run")) == ["status.json"]


@pytest.mark.timeout(30)
def test_f20_the_latest_checkpoint_reads_one_manifest_not_all(url, monkeypatch):
    mgr = CheckpointManager(url, async_save=False, keep=None)
    for step in range(1, 7):
        mgr.save(step, make_state(step), generation=0)
    reads = []
    real = Storage.read_bytes

    def counting(self, path):
        if path.endswith(mf.MANIFEST_NAME):
            reads.append(path)
        return real(self, path)

    monkeypatch.setattr(Storage, "read_bytes", counting)
    if hasattr(Storage, "read_versioned"):
        real_v = Storage.read_versioned

        def counting_v(self, path):
            if path.endswith(mf.MANIFEST_NAME):
                reads.append(path)
            return real_v(self, path)

        monkeypatch.setattr(Storage, "read_versioned", counting_v)
    assert latest_committed(url).step == 6
    assert len(reads) == 1
    reads.clear()
    assert CheckpointManager(url).load_latest(blank_state()).step == 6
    assert len(reads) == 1
    reads.clear()
    assert [c.step for c in mgr.committed_since(4)] == [5, 6] and len(reads) == 2
    reads.clear()
    mgr.keep = 2
    mgr.gc()  # retention reads the manifests of the kept steps only
    assert len(reads) == 2 and [c.step for c in mgr.committed()] == [5, 6]


# ---- F21 -----------------------------------------------------------------------------------------
def test_f21_cli_option_values_are_typed():
    from checkpointing.cli import _options
    opts = _options(["anon=false", "use_ssl=True", "max_concurrency=4", "timeout=2.5",
                     "endpoint_url=http://127.0.0.1:9000", "client_kwargs={\"region_name\": \"eu-west-1\"}",
                     "profile=none", "key=0123"])
    assert opts == {"anon": False, "use_ssl": True, "max_concurrency": 4, "timeout": 2.5,
                    "endpoint_url": "http://127.0.0.1:9000", "client_kwargs": {"region_name": "eu-west-1"},
                    "profile": None, "key": "0123"}
    assert opts["anon"] is False


# ---- conditional-write fallbacks -------------------------------------------------------------------
def test_a_store_without_conditional_writes_is_detected_and_falls_back_with_a_warning(memory_url, caplog,
                                                                                      monkeypatch):
    import checkpointing.storage as storage_module
    from checkpointing.storage import PreconditionFailed

    monkeypatch.setattr(storage_module, "_WARNED", set())  # warned once per process otherwise

    class IgnoresConditions:
        """An S3-compatible store that accepts If-None-Match / If-Match and overwrites anyway."""

        def __init__(self):
            self.objects = {}

        def pipe_file(self, path, data, **kwargs):
            self.objects[path] = data
            return {"ETag": '"x"'}

        def rm(self, path):
            self.objects.pop(path, None)

    st = Storage(memory_url)
    st.fs, real_fs = IgnoresConditions(), st.fs
    assert st._probe_s3_conditional() is False and st.fs.objects == {}  # probe object removed
    st.fs = real_fs
    st._is_memory = lambda: False  # a protocol with no conditional writes at all (say gcs://)
    path = st.path("checkpoints", "FENCE")
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        st.put_if(path, b"1", if_token=None)
        with pytest.raises(PreconditionFailed):
            st.put_if(path, b"2", if_token=None)  # check-then-put still sees a sequential conflict
    assert any("no conditional writes" in r.message for r in caplog.records)


@pytest.mark.timeout(30)
def test_f1_fence_first_then_record_the_planned_start_step(url):
    """The controller fences the new generation before it reads the latest checkpoint for its
    plan (a commit racing the plan is then fenced), and records the start step once planned."""
    ctl = CheckpointManager(url)
    ctl.set_generation(2, run_id="run-a")
    ctl.set_generation(2, start_step=40, run_id="run-a")
    doc = mf.read_fence_doc(Storage(url))
    assert doc.generation == 2 and [(e.generation, e.start_step) for e in doc.history] == [(2, 40)]
    ctl.set_generation(2, start_step=40, run_id="run-a")  # idempotent
    assert len(mf.read_fence_doc(Storage(url)).history) == 1

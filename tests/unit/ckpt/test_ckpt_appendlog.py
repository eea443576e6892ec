"""F20 of the reliability review: an append-only log (metrics.jsonl) that an object store does not
rewrite whole on every append. memory:// stands in for an object store here (`segmented`
forced on); tests/integration/ckpt/test_ckpt_conditional_s3.py runs it on a real S3 endpoint."""

from __future__ import annotations

import random

import pytest

from checkpointing.appendlog import PARTS_SUFFIX, AppendLog
from checkpointing.storage import Storage


class CountingStorage(Storage):
    """Counts the bytes written (PUT bodies) and the objects read."""

    def __init__(self, url):
        super().__init__(url)
        self.bytes_written = 0
        self.reads = 0

    def write_atomic(self, path, data):
        self.bytes_written += len(data)
        return super().write_atomic(path, data)

    def append(self, path, data):  # what an object store pays for an in-place "append"
        try:
            old = len(super().read_bytes(path))
        except FileNotFoundError:
            old = 0
        self.bytes_written += old + len(data)
        return super().append(path, data)

    def read_bytes(self, path):
        self.reads += 1
        return super().read_bytes(path)


def segmented(storage: Storage, path: str, **kwargs) -> AppendLog:
    log = AppendLog(storage, path, **kwargs)
    log.segmented = True  # as on s3:// (memory:// appends in place)
    return log


def line(i: int) -> bytes:
    return b'{"step": %d, "loss": %f, "pad": "%s"}\n' % (i, 1.0 / (i + 1), b"x" * 200)


@pytest.mark.timeout(60)
def test_appends_cost_linear_bytes_and_readers_see_one_file(memory_url):
    st = CountingStorage(memory_url)
    path = st.path("metrics.jsonl")
    log = segmented(st, path, min_compact_bytes=8 << 10)
    want = b""
    for i in range(1, 2001):
        log.append(line(i))
        want += line(i)
        if i % 97 == 0:
            assert segmented(Storage(memory_url), path).read() == want  # a reader mid-run
    total = len(want)
    assert segmented(Storage(memory_url), path).read() == want
    # Rewriting the object on every append would cost sum(i * line) ~ n^2/2 lines: ~430 MB here.
    assert st.bytes_written < 20 * total, (st.bytes_written, total)
    names = Storage(memory_url).listdir(path + PARTS_SUFFIX)
    assert len(names) < 16  # O(log n) segments (plus the marker)
    log.compact()
    assert Storage(memory_url).read_bytes(path) == want  # the contract's one file, after the run
    assert Storage(memory_url).listdir(path + PARTS_SUFFIX) == ["BASE"]


@pytest.mark.timeout(60)
def test_a_storage_error_at_any_write_leaves_exactly_the_appends_that_returned(memory_url):
    """The same writer goes on after a failed write (the run recorder retries its lines)."""
    for fail_at in range(1, 150, 2):
        url = f"{memory_url}-{fail_at}"
        st = Storage(url)
        path = st.path("metrics.jsonl")
        writes = {"n": 0}
        real = st.write_atomic

        def flaky_write(p, data, _real=real, _fail=fail_at, _writes=writes):
            _writes["n"] += 1
            if _writes["n"] == _fail:
                raise OSError(5, "injected: 503 after retries")
            return _real(p, data)

        st.write_atomic = flaky_write
        log = segmented(st, path, min_compact_bytes=1 << 10)
        done = b""
        for i in range(1, 80):
            try:
                if i == 40:
                    log.rewrite(done[: done.index(line(30))])
                    done = done[: done.index(line(30))]
                log.append(line(i))
                done += line(i)
            except OSError:
                pass
            assert segmented(Storage(url), path).read() == done, (fail_at, i)


@pytest.mark.timeout(60)
def test_the_old_in_place_append_is_quadratic(memory_url):
    """What F20 measured: Storage.append on an object store rewrites the whole object."""
    st = CountingStorage(memory_url)
    path = st.path("metrics.jsonl")
    total = 0
    for i in range(1, 401):
        st.append(path, line(i))
        total += len(line(i))
    assert st.bytes_written > 100 * total


@pytest.mark.timeout(60)
def test_a_crash_at_any_write_never_loses_or_duplicates_a_line(memory_url):
    """Kill the writer at every write in turn; a reader and a new writer must see exactly the
    lines whose append returned (plus at most the one in flight), in order, once."""
    rng = random.Random(7)
    for crash_at in range(1, 120, 3):
        url = f"{memory_url}-{crash_at}"
        st = Storage(url)
        path = st.path("metrics.jsonl")
        writes = {"n": 0}
        real = st.write_atomic

        def dying_write(p, data, _real=real, _crash=crash_at, _writes=writes):
            _writes["n"] += 1
            if _writes["n"] == _crash:
                raise KeyboardInterrupt("writer killed")
            return _real(p, data)

        st.write_atomic = dying_write
        log = segmented(st, path, min_compact_bytes=1 << 10)
        done, inflight = b"", b""
        try:
            for i in range(1, 60):
                inflight = line(i)
                if i == 30:
                    log.rewrite(done[: done.index(line(20))])  # a resume truncating to step 19
                    done = done[: done.index(line(20))]
                log.append(inflight)
                done += inflight
                inflight = b""
        except KeyboardInterrupt:
            pass
        got = segmented(Storage(url), path).read()
        assert got in (done, done + inflight) or (inflight == b"" and got == done), crash_at
        # A new writer (the resumed run) carries on from what is there.
        again = segmented(Storage(url), path, min_compact_bytes=1 << 10)
        extra = b"".join(line(1000 + k) for k in range(rng.randint(1, 20)))
        for k in range(0, len(extra), len(line(1000))):
            again.append(extra[k:k + len(line(1000))])
        assert segmented(Storage(url), path).read() == got + extra


def test_local_files_and_memory_append_in_place(url):
    st = Storage(url)
    path = st.path("metrics.jsonl")
    log = AppendLog(st, path)
    assert not log.segmented
    log.append(b"a\n")
    log.append(b"b\n")
    log.rewrite(b"a\n")
    log.append(b"c\n")
    log.compact()
    assert st.read_bytes(path) == b"a\nc\n" == log.read()
    assert not st.exists(path + PARTS_SUFFIX)


def test_a_base_written_by_the_old_code_is_kept(memory_url):
    st = Storage(memory_url)
    path = st.path("metrics.jsonl")
    st.write_atomic(path, b"old 1\nold 2\n")   # a previous run's file, no marker
    log = segmented(st, path)
    log.append(b"new 3\n")
    assert segmented(Storage(memory_url), path).read() == b"old 1\nold 2\nnew 3\n"


def test_read_log_takes_a_runs_url_as_the_docs_name_it(tmp_path):
    """Issue 34: `checkpointing.read_log` took only a Storage, while the docs and the CLIs name a
    run by its URL."""
    from checkpointing import read_log
    storage = Storage(str(tmp_path))
    log = AppendLog(storage, storage.path("metrics.jsonl"))
    log.append(b'{"step": 1}\n')
    log.append(b'{"step": 2}\n')
    assert read_log(str(tmp_path)) == read_log(storage, storage.path("metrics.jsonl")) == b'{"step": 1}\n{"step": 2}\n'
    assert read_log(str(tmp_path), "other.jsonl") == b""
    with pytest.raises(TypeError, match="give the log's path"):
        read_log(storage)

"""Storage's edges (review R3): the S3 conditional-write probe's verdicts, URLs shown without their
password, and the root URLs (`file:///`, `memory://`). No server: an S3 store is a fake behind a
Storage, its errors made as botocore and s3fs make them."""
from __future__ import annotations

import logging
import os
import uuid

import pytest
from botocore.exceptions import ClientError
from s3fs.errors import translate_boto_error

import checkpointing.storage as storage_module
from checkpointing import CheckpointManager, FencedError, RunConflictError, SaveFailureLimitError, StorageError
from checkpointing.lease import acquire_run_lease
from checkpointing.storage import PreconditionFailed, Storage
from ckpt_conformance import make_state

pytestmark = pytest.mark.timeout(30)


def s3_error(status: int, code: str, message: str, **fields: str) -> OSError:
    """What s3fs raises for an S3 error response: an OSError caused by botocore's ClientError."""
    response = {"Error": {"Code": code, "Message": message, **fields},
                "ResponseMetadata": {"HTTPStatusCode": status}}
    return translate_boto_error(ClientError(response, "PutObject"))


class ConditionalStore:
    """An S3 store that honours If-None-Match / If-Match, and raises `failures` first (one per
    PUT), as a store with an expired token or a timeout would."""

    endpoint_url = "http://fake-s3:9000"
    protocol = ("s3", "s3a")

    def __init__(self, failures=()):
        self.objects: dict[str, bytes] = {}
        self.failures = list(failures)
        self.puts = 0

    def pipe_file(self, path, data, mode="overwrite", IfMatch=None):
        self.puts += 1
        if self.failures:
            raise self.failures.pop(0)
        if mode == "create" and path in self.objects:
            raise s3_error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold",
                           Condition="If-None-Match")
        if IfMatch is not None and (path not in self.objects or IfMatch != self.etag(path)):
            raise s3_error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold",
                           Condition="If-Match")
        self.objects[path] = data
        return {"ETag": self.etag(path)}

    def etag(self, path):
        return f'"{hash(self.objects[path]) & 0xffffffff:08x}"'

    def rm(self, path):
        self.objects.pop(path, None)

    def unstrip_protocol(self, path):
        return f"s3://{path}"


@pytest.fixture
def s3_storage(memory_url, monkeypatch):
    """A Storage that takes the S3 path of put_if against a ConditionalStore, with the
    process's probe verdicts and warnings of its own."""
    monkeypatch.setattr(storage_module, "_PROBED", {})
    monkeypatch.setattr(storage_module, "_WARNED", set())
    st = Storage(memory_url)
    st._is_s3 = lambda: True
    st._is_memory = lambda: False

    def use(store):
        st.fs = store
        return st
    return use


@pytest.mark.parametrize("error", [
    s3_error(400, "ExpiredToken", "The provided token has expired."),
    s3_error(400, "RequestTimeout", "Your socket connection to the server was not read from or written to "
                                    "within the timeout period."),
    s3_error(400, "AuthorizationHeaderMalformed", "The authorization header is malformed; the region "
                                                  "'us-east-1' is wrong; expecting 'eu-west-1'"),
    s3_error(400, "InvalidArgument", "Invalid argument."),
    s3_error(500, "InternalError", "We encountered an internal error. Please try again."),
    s3_error(503, "SlowDown", "Please reduce your request rate."),
    TimeoutError("connect timeout"),
], ids=["expired-token", "request-timeout", "auth-header", "invalid-argument", "500", "503", "timeout"])
def test_r3_7_an_inconclusive_probe_is_raised_not_cached_and_probed_again(s3_storage, error, caplog):
    """R3-7: a 400 ExpiredToken (or any error that does not name the conditional header) said
    "this store ignores conditional writes" for the rest of the process: FENCE and commits
    became check-then-put. Now it is the storage error it is, and the next write probes again."""
    store = ConditionalStore(failures=[error])
    st = s3_storage(store)
    path = st.path("checkpoints", "FENCE")
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        with pytest.raises(StorageError, match="conditional write"):
            st.put_if(path, b"1", if_token=None)
        assert storage_module._PROBED == {}              # no verdict from a failed probe
        token = st.put_if(path, b"1", if_token=None)     # the token refreshed: probed again
    assert storage_module._PROBED == {("http://fake-s3:9000", st.root.split("/", 1)[0]): True}
    assert not any("no conditional writes" in r.message for r in caplog.records)
    with pytest.raises(PreconditionFailed):              # still a compare-and-swap
        st.put_if(path, b"2", if_token=None)
    with pytest.raises(PreconditionFailed):
        st.put_if(path, b"2", if_token='"stale"')
    assert st.put_if(path, b"2", if_token=token) is not None


@pytest.mark.parametrize("error", [
    s3_error(501, "NotImplemented", "A header you provided implies functionality that is not implemented",
             Header="If-None-Match"),
    s3_error(400, "InvalidArgument", "If-None-Match is not supported for this operation"),
    s3_error(400, "InvalidRequest", "Conditional writes are not supported"),
], ids=["501", "400-names-if-none-match", "400-names-conditional"])
def test_r3_7_a_store_that_refuses_the_header_is_cached_as_unconditional(s3_storage, error, caplog):
    store = ConditionalStore(failures=[error])
    st = s3_storage(store)
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        assert st._s3_conditional_ok() is False
        assert st._s3_conditional_ok() is False          # cached: no second probe
    assert store.puts == 1
    assert any("no conditional writes" in r.message for r in caplog.records)


# ---- R3-8: no URL password in a message or a log line ----------------------------------------------
SECRET_URL = "http://alice:hunter2@127.0.0.1:9/runs/x"


def test_r3_8_a_storage_error_shows_no_password_of_the_url_nor_of_the_wrapped_error():
    st = Storage(SECRET_URL)

    class Refusing:
        def __init__(self, fs):
            self._fs = fs

        def __getattr__(self, name):
            return getattr(self._fs, name)

        def pipe_file(self, path, data):
            raise OSError(f"Cannot connect to host for {path}")     # a backend's text names the URL

    st.fs = Refusing(st.fs)
    with pytest.raises(StorageError) as raised:
        st.write_atomic(st.path("status.json"), b"{}")
    text = str(raised.value)
    assert "hunter2" not in text, text
    assert "http://alice:***@127.0.0.1:9/runs/x/status.json" in text
    assert raised.value.url == SECRET_URL                # the attribute still opens the storage
    assert st.display_url == "http://alice:***@127.0.0.1:9/runs/x"


def test_r3_8_checkpointing_errors_mask_every_url_in_their_text():
    error = StorageError(f"x {SECRET_URL}/a failed: OSError: GET 'https://u:pw@host:1/b' (storage 'http://tok@h/c')")
    assert str(error) == ("x http://alice:***@127.0.0.1:9/runs/x/a failed: OSError: GET 'https://u:***@host:1/b' "
                          "(storage 'http://***@h/c')")
    assert str(StorageError("http://host:9000/a@b and s3://bucket/k")) == "http://host:9000/a@b and s3://bucket/k"


class _RefusingWrites:
    """The storage's filesystem, refusing every write (a quota, a revoked credential)."""

    def __init__(self, fs):
        self._fs = fs

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            raise PermissionError("injected: storage refuses writes")
        return self._fs.open(path, mode, **kwargs)


def test_r3_8_the_managers_and_the_leases_messages_show_no_password(caplog):
    """A URL's user-info as memory:// keeps it: in the URL and, as text, in every path under it."""
    url = f"memory://alice:hunter2@ckpt-{uuid.uuid4().hex[:10]}/run"
    mgr = CheckpointManager(url, async_save=False, max_consecutive_failures=1)
    mgr.set_generation(3)
    with caplog.at_level(logging.INFO, logger="checkpointing"):
        mgr.save(1, make_state(1), generation=3)
        assert mgr.wait().step == 1
        with pytest.raises(FencedError) as fenced:
            mgr.save(2, make_state(2), generation=2)
        mgr.storage.fs = _RefusingWrites(mgr.storage.fs)
        with pytest.raises(SaveFailureLimitError) as limit:
            mgr.save(4, make_state(4), generation=3)
    shown = [str(fenced.value), str(limit.value), limit.value.last_cause or ""]
    # checkpointing's own lines (torch's DCP logger, a NullHandler unless configured, names its paths)
    logged = [r.getMessage() for r in caplog.records if r.name == "checkpointing"]
    assert any("committed step 1" in line and "alice:***@" in line for line in logged), logged
    assert any("checkpoint save to" in line and "alice:***@" in line for line in logged), logged
    assert "alice:***@" in str(fenced.value) and "alice:***@" in str(limit.value)
    acquire_run_lease(url, "run-a")
    with pytest.raises(RunConflictError) as conflict:
        acquire_run_lease(url, "run-b")
    shown.append(str(conflict.value))
    assert "alice:***@" in str(conflict.value)
    assert not [text for text in shown + logged if "hunter2" in text], shown + logged
    assert mgr.storage.display_url == url.replace("hunter2", "***")


# ---- R3-9: the root URLs --------------------------------------------------------------------------
def test_r3_9_file_root_url_is_the_filesystem_root_not_the_cwd(tmp_path, monkeypatch):
    """`file:///` was stripped to "file:", a relative path: every process wrote under its own cwd."""
    monkeypatch.chdir(tmp_path)
    for url in ("file:///", "file:////", "/"):
        st = Storage(url)
        assert st.is_local and st.root == "/" and st.path("checkpoints") == "/checkpoints", url
    assert Storage("file:///").url == "file:///"
    assert Storage("file:///tmp//").root == "/tmp"
    from elastic.config import normalized_storage
    assert Storage(normalized_storage("file:///")).root == Storage(normalized_storage("/")).root == "/"
    assert not os.listdir(tmp_path)


def test_r3_9_the_memory_root_url_is_the_memory_store_not_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    st = Storage("memory://")
    assert st._is_memory() and not st.is_local
    assert st.url == "memory://"

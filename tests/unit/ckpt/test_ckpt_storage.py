"""Storage's edges (review R3): the S3 conditional-write probe's verdicts, URLs shown without their
password, and the root URLs (`file:///`, `memory://`). No server: an S3 store is a fake behind a
Storage, its errors made as botocore and s3fs make them."""
from __future__ import annotations

import logging

import pytest
from botocore.exceptions import ClientError
from s3fs.errors import translate_boto_error

import checkpointing.storage as storage_module
from checkpointing import StorageError
from checkpointing.storage import PreconditionFailed, Storage

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

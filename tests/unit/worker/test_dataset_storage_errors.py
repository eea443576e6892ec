"""A storage failure while reading a Parquet shard is a StorageError (the run recovers), not a
"corrupt shard" DatasetError (the run fails): reliability review F9."""
import io
import pickle

import numpy as np
import pytest

from checkpointing import StorageError
from checkpointing.storage import Storage
from elastic import DatasetError, ParquetTokens, write_token_shards
from elastic._worker.worker import classify_error

pytestmark = pytest.mark.timeout(60)

SEQ = 6


class Flaky(io.RawIOBase):
    """A storage file whose reads after the first `good` ones raise `error` (the connection went)."""

    def __init__(self, raw, error, good):
        self.raw, self.error, self.good = raw, error, good

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, *args):
        return self.raw.seek(*args)

    def tell(self):
        return self.raw.tell()

    def _maybe_fail(self):
        if self.good <= 0:
            raise self.error
        self.good -= 1

    def read(self, n=-1):
        self._maybe_fail()
        return self.raw.read(n)

    def readinto(self, buffer):
        self._maybe_fail()
        return self.raw.readinto(buffer)

    def close(self):
        self.raw.close()
        super().close()


def aiohttp_payload_error():
    kind = type("ClientPayloadError", (Exception,), {"__module__": "aiohttp.client_exceptions"})
    return kind("Response payload is not completed: <ContentLengthError: 400, message='Not enough data'>")


@pytest.fixture
def corpus(tmp_path):
    url = str(tmp_path / "corpus")
    write_token_shards(url, [np.ones((8, SEQ + 1), dtype=np.int64)], row_group_size=4)
    return url


def flaky_storage(monkeypatch, error, good):
    opened = Storage.open_read
    monkeypatch.setattr(Storage, "open_read", lambda self, path: Flaky(opened(self, path), error, good))


@pytest.mark.parametrize("error", [ConnectionResetError(104, "Connection reset by peer"),
                                   TimeoutError("read timed out"), BrokenPipeError(32, "Broken pipe"),
                                   aiohttp_payload_error()], ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("footer_read", [False, True], ids=["footer", "row_group"])
def test_a_connection_lost_mid_read_is_a_storage_error_the_run_recovers_from(corpus, monkeypatch, error, footer_read):
    dataset = pickle.loads(pickle.dumps(ParquetTokens(corpus, SEQ)))     # as a worker gets it: nothing read yet
    if footer_read:
        dataset._metadata(0)                                             # the footer read fine ...
    flaky_storage(monkeypatch, error, good=0)                            # ... the next read does not
    with pytest.raises(StorageError, match="reading .*shard-00000.parquet' failed") as caught:
        dataset[0]
    assert caught.value.__cause__ is error and classify_error(caught.value) == "infra"


def test_bytes_that_are_not_parquet_are_still_the_users_dataset_error(corpus, monkeypatch):
    dataset = ParquetTokens(corpus, SEQ)
    monkeypatch.setattr(Storage, "open_read", lambda self, path: io.BytesIO(b"PAR1 not a parquet file at all"))
    fresh = pickle.loads(pickle.dumps(dataset))
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        fresh[0]

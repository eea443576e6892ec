"""ParquetTokens on local files: index from footers, rows across shard boundaries, the row-group
cache, pickling, the corpus marker, and typed errors that name the file."""
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import gpt
from elastic import DatasetError, ParquetTokens, read_corpus_marker, write_token_shards
from elastic._worker.loader import ElasticLoader

pytestmark = pytest.mark.timeout(60)

SEQ = 6
GROUP_BYTES = 4 * (SEQ + 1) * 4     # a full row group: 4 rows of int32 tokens


def rows(start: int, n: int) -> np.ndarray:
    """Row k holds global id k in every token, so a row says where it came from."""
    return np.repeat(np.arange(start, start + n)[:, None], SEQ + 1, axis=1)


@pytest.fixture
def corpus(tmp_path):
    """Three shards of 10, 7 and 13 rows, row groups of 4 rows; written out of name order."""
    url = str(tmp_path / "corpus")
    write_token_shards(url, [rows(0, 10), rows(10, 7), rows(17, 13)], row_group_size=4)
    return url


def test_index_comes_from_footers_in_sorted_shard_order(corpus):
    ds = ParquetTokens(corpus, SEQ)
    assert len(ds) == 30 and ds.shards == ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    assert ds.cache_info()["reads"] == 0            # no data read to build the index
    assert ParquetTokens("file://" + corpus, SEQ).shards == ds.shards


def test_rows_across_shard_and_row_group_boundaries(corpus):
    ds = ParquetTokens(corpus, SEQ)
    for i in [0, 3, 4, 9, 10, 11, 16, 17, 29, -1, -30]:
        row = ds[i]
        assert row.dtype == torch.int64 and row.shape == (SEQ + 1,)
        assert row.tolist() == [i % 30] * (SEQ + 1)
    for bad in (30, -31):
        with pytest.raises(IndexError):
            ds[bad]
    x, y = ParquetTokens(corpus, SEQ, pairs=True)[12]
    assert x.shape == y.shape == (SEQ,) and x.tolist() == y.tolist() == [12] * SEQ


def test_sequential_access_reads_each_row_group_once(corpus):
    ds = ParquetTokens(corpus, SEQ, cache_bytes=0)       # keeps only the newest row group
    assert [int(ds[i][0]) for i in range(30)] == list(range(30))
    # 10 rows in groups of 4 -> 3 groups, 7 -> 2, 13 -> 4: nine row groups in all.
    # The newest group is cached: 1 row (13 = 4+4+4+1).
    assert ds.cache_info() == {"reads": 9, "cached": 1, "bytes": (SEQ + 1) * 4}


def test_the_cache_is_lru_and_bounded(corpus):
    ds = ParquetTokens(corpus, SEQ, cache_bytes=2 * GROUP_BYTES)
    for i in (0, 10, 0, 10, 1, 11):                 # two row groups, alternating: read once each
        ds[i]
    assert ds.cache_info()["reads"] == 2
    ds[20]                                           # a third group evicts the least recent (0..3)
    ds[11]
    assert ds.cache_info()["reads"] == 3
    ds[0]
    assert ds.cache_info() == {"reads": 4, "cached": 2, "bytes": 2 * GROUP_BYTES}


def test_pickles_without_its_filesystem_and_reopens_it(corpus):
    ds = ParquetTokens(corpus, SEQ)
    ds[5]
    blob = pickle.dumps(ds)
    assert b"LocalFileSystem" not in blob and len(blob) < 2000
    copy = pickle.loads(blob)
    assert copy.cache_info()["reads"] == 0 and copy._storage is None
    assert len(copy) == 30 and copy[29].tolist() == ds[29].tolist()


def test_the_loader_reads_the_corpus_in_its_global_order(corpus):
    class Ctx:
        dp_size, dp_rank, seed, step, samples_seen, total_steps = 1, 0, 3, 0, 0, 1

        def begin_step(self, global_batch, ids):
            self.ids = ids

    ctx = Ctx()
    batch = next(iter(ElasticLoader(ctx, ParquetTokens(corpus, SEQ), batch_size=5)))
    assert batch.shape == (5, SEQ + 1) and batch[:, 0].tolist() == ctx.ids


def test_empty_folder_and_wrong_seq_len_are_typed_errors(tmp_path, corpus):
    with pytest.raises(DatasetError, match="no \\*.parquet shards"):
        ParquetTokens(str(tmp_path / "nothing"), SEQ)
    with pytest.raises(DatasetError, match="shard-00000.parquet.*7 tokens.*seq_len=9 needs 10"):
        ParquetTokens(corpus, 9)
    with pytest.raises(DatasetError, match="column 'text'"):
        ParquetTokens(corpus, SEQ, column="text")


def test_variable_length_rows_are_checked_when_read(tmp_path):
    folder = tmp_path / "var"
    folder.mkdir()
    pq.write_table(pa.table({"tokens": pa.array([[1] * (SEQ + 1), [2] * (SEQ + 1)], pa.list_(pa.int64()))}),
                   folder / "a.parquet")
    pq.write_table(pa.table({"tokens": pa.array([[3] * (SEQ + 1), [4] * SEQ], pa.list_(pa.int64()))}),
                   folder / "b.parquet")
    ds = ParquetTokens(str(folder), SEQ)
    assert ds[1].tolist() == [2] * (SEQ + 1)
    with pytest.raises(DatasetError, match="b.parquet.*row group 0.*6 tokens"):
        ds[2]


def test_corrupt_and_missing_shards_name_the_file(tmp_path, corpus):
    with open(os.path.join(corpus, "shard-00003.parquet"), "wb") as f:
        f.write(b"not parquet at all")
    with pytest.raises(DatasetError, match="shard-00003.parquet.*not a readable Parquet file"):
        ParquetTokens(corpus, SEQ)
    os.remove(os.path.join(corpus, "shard-00003.parquet"))
    ds = ParquetTokens(corpus, SEQ)
    os.remove(os.path.join(corpus, "shard-00001.parquet"))
    ds[0]
    with pytest.raises(DatasetError, match="shard-00001.parquet.*is missing"):
        pickle.loads(pickle.dumps(ds))[12]


def test_marker_is_written_last_and_a_failed_write_leaves_none(tmp_path):
    url = str(tmp_path / "c")
    marker = write_token_shards(url, [rows(0, 3)], extra={"seed": 1})
    assert read_corpus_marker(url) == marker and marker["rows"] == 3 and marker["seq_len"] == SEQ

    def crashing():
        yield rows(0, 3)
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        write_token_shards(url, crashing())
    assert read_corpus_marker(url) is None
    with pytest.raises(DatasetError, match="same row length"):
        write_token_shards(url, [rows(0, 3), np.zeros((2, 3), dtype=np.int64)])


def test_synthetic_corpus_is_written_once_and_reused(tmp_path):
    url = str(tmp_path / "corpus")
    os.makedirs(url)
    with open(os.path.join(url, "shard-00009.parquet"), "wb") as f:
        f.write(b"left over by a crashed write")     # no marker: not a corpus, so rewritten
    assert gpt.ensure_synthetic_corpus(url, seq_len=16, vocab=64)
    ds = ParquetTokens(url, 16)
    assert len(ds) == 8 * 1024 and ds.shards[-1] == "shard-00007.parquet"
    assert not gpt.ensure_synthetic_corpus(url, seq_len=16, vocab=64)
    row = ds[100]
    # The example's learnable rule: x[t+1] = (a x[t] + b) mod vocab, a odd, 1 <= b < 8.
    assert any(torch.equal(row[1:], (a * row[:-1] + b) % 64) for a in (1, 3, 5, 7) for b in range(1, 8))

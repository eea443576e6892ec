"""Token datasets on object storage: Parquet shards read with pyarrow over fsspec.

A corpus is a folder (local path, ``file://`` or ``s3://bucket/prefix``) of ``*.parquet`` shards.
Each row is one training sample: a column (``tokens`` by default) holding exactly ``seq_len + 1``
integer tokens, as a fixed-size list (the length is then checked from the schema alone) or a
plain list (checked when its row group is read). Sample ids are global row numbers over the
shards in sorted name order, so the same folder always gives the same ids.

`ParquetTokens` is a map-style dataset for ``ctx.prepare_data``: its index comes from the shards'
footers only (row counts per row group), row groups are read when first needed and kept in a
small LRU cache, and it pickles without its filesystem, which each process reopens lazily.
`write_token_shards` writes such a corpus and a `CORPUS.json` marker last, so a folder without the
marker is an unfinished write, never a corpus.

Storage goes through `checkpointing.storage.Storage`: uncached listings, the standard ``AWS_*``
variables, transient failures as `StorageError` (an infrastructure failure the controller
recovers from), reads included: pyarrow reads a shard through a file that turns what the
storage backend raises mid-read (a connection reset, a timeout) into `StorageError` before
pyarrow can take it for a bad file. A missing or corrupt shard, or a corpus of another sequence
length, is a `DatasetError` (user error: retrying cannot fix it).
"""
from __future__ import annotations

import bisect
import io
import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from checkpointing.errors import StorageError
from checkpointing.masking import mask_url
from checkpointing.storage import Storage
from elastic.errors import DatasetError

MARKER = "CORPUS.json"
SUFFIX = ".parquet"


class ParquetTokens(torch.utils.data.Dataset):
    """Fixed-length token sequences from the Parquet shards under `url`.

    Args:
        url: folder of ``*.parquet`` shards (only its direct children are shards).
        seq_len: model context; every row must hold ``seq_len + 1`` tokens.
        column: name of the token column.
        pairs: return ``(input, target)`` = ``(x[:-1], x[1:])`` instead of the whole row.
        cache_bytes: budget of the per-process LRU cache of decoded row groups (the most recent
            one is always kept); sequential access reads each row group once. Shuffled access
            reads a whole row group per miss: keep row groups small (a few thousand rows).
        storage_options: fsspec options (endpoint, credentials); default: ``AWS_*`` variables.

    ``dataset[i]`` is a LongTensor of ``seq_len + 1`` tokens (or the pair); ``len(dataset)`` is
    the total row count. Raises `DatasetError` when the folder has no shards, a shard is missing
    or not Parquet, lacks the column, or holds rows of another length.
    """

    def __init__(self, url: str, seq_len: int, *, column: str = "tokens", pairs: bool = False,
                 cache_bytes: int = 64 << 20, storage_options: dict | None = None):
        if seq_len < 1:
            raise DatasetError(f"ParquetTokens: seq_len must be >= 1, got {seq_len}")
        if cache_bytes < 0:
            raise DatasetError(f"ParquetTokens: cache_bytes must be >= 0, got {cache_bytes}")
        self.url, self.seq_len, self.column, self.pairs = url.rstrip("/"), seq_len, column, pairs
        self.cache_bytes = cache_bytes
        self.storage_options = dict(storage_options or {})
        self._reset_process_state()
        names = [n for n in self._store().listdir(self._store().root) if n.endswith(SUFFIX)]
        if not names:
            raise DatasetError(f"no *{SUFFIX} shards under {mask_url(self.url)!r}: check the data URL "
                               f"(a folder of Parquet shards), or write a corpus first")
        self.shards: list[str] = names           # sorted by Storage.listdir: deterministic ids
        # Global row offset of every row group, in (shard, row group) order; one extra end entry.
        self._groups: list[tuple[int, int]] = []
        self._starts: list[int] = []
        total = 0
        for s in range(len(self.shards)):
            meta = self._metadata(s)
            for g in range(meta.num_row_groups):
                self._groups.append((s, g))
                self._starts.append(total)
                total += meta.row_group(g).num_rows
        self._starts.append(total)
        if total == 0:
            raise DatasetError(f"the shards under {mask_url(self.url)!r} hold no rows: write a non-empty corpus")

    # ---- per-process state (not pickled) ------------------------------------------------
    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._storage: Storage | None = None
        self._meta: dict[int, pq.FileMetaData] = {}
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_bytes = 0
        self.reads = 0          # row groups read from storage by this process (for tests, tuning)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_storage", "_meta", "_cache", "_cached_bytes", "_pid", "reads"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def _store(self) -> Storage:
        # A forked child (a DataLoader worker) must not share its parent's connections.
        if self._storage is None or self._pid != os.getpid():
            self._reset_process_state()
            self._storage = Storage(self.url, self.storage_options)
        return self._storage

    def _path(self, shard: int) -> str:
        store = self._store()
        return store.path(self.shards[shard])

    def _where(self, shard: int) -> str:
        return self._store().url_for(self._path(shard))

    # ---- metadata ------------------------------------------------------------------------
    def _metadata(self, shard: int) -> pq.FileMetaData:
        meta = self._meta.get(shard)
        if meta is None:
            with self._open(shard) as f:
                meta = self._parquet(shard, f).metadata
            self._check_schema(shard, meta.schema.to_arrow_schema())
            self._meta[shard] = meta
        return meta

    def _open(self, shard: int):
        try:
            return _StorageReads(self._store().open_read(self._path(shard)), self._store(), self._path(shard))
        except FileNotFoundError:
            raise DatasetError(f"shard {self._where(shard)!r} is missing: the corpus changed after the "
                               f"dataset was built; restore the shard or rebuild the corpus") from None

    def _parquet(self, shard: int, f, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(f, metadata=metadata)
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(f"shard {self._where(shard)!r} is not a readable Parquet file ({e}): "
                               f"rewrite it or remove it from the corpus") from None

    def _check_schema(self, shard: int, schema: pa.Schema) -> None:
        where = self._where(shard)
        if self.column not in schema.names:
            raise DatasetError(f"shard {where!r} has no column {self.column!r} (columns: {schema.names}): "
                               f"pass column=... naming the token column")
        kind = schema.field(self.column).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
                or not pa.types.is_integer(kind.value_type):
            raise DatasetError(f"shard {where!r}: column {self.column!r} is {kind}, expected a list of "
                               f"integer tokens per row")
        if pa.types.is_fixed_size_list(kind) and kind.list_size != self.seq_len + 1:
            raise DatasetError(self._length_message(where, kind.list_size))

    def _length_message(self, where: str, found: int) -> str:
        return (f"shard {where!r} holds sequences of {found} tokens, but seq_len={self.seq_len} needs "
                f"{self.seq_len + 1} (seq_len + 1): use a model with seq_len={found - 1} or a corpus "
                f"written for seq_len={self.seq_len}")

    # ---- rows ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for a corpus of {n} samples")
        index %= n
        group = bisect.bisect_right(self._starts, index) - 1
        row = torch.from_numpy(self._row_group(group)[index - self._starts[group]].astype(np.int64))
        return (row[:-1], row[1:]) if self.pairs else row

    def _row_group(self, group: int) -> np.ndarray:
        self._store()           # resets the per-process cache in a forked child
        rows = self._cache.get(group)
        if rows is not None:
            self._cache.move_to_end(group)
            return rows
        rows = self._read_row_group(group)
        self._cache[group] = rows
        self._cached_bytes += rows.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            self._cached_bytes -= self._cache.popitem(last=False)[1].nbytes
        return rows

    def _read_row_group(self, group: int) -> np.ndarray:
        shard, g = self._groups[group]
        meta = self._metadata(shard)
        where = self._where(shard)
        try:
            with self._open(shard) as f:
                table = self._parquet(shard, f, meta).read_row_group(g, columns=[self.column])
        except (DatasetError, StorageError):
            raise
        except FileNotFoundError:
            raise DatasetError(f"shard {where!r} is missing: the corpus changed after the dataset was built; "
                               f"restore the shard or rebuild the corpus") from None
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(f"shard {where!r}, row group {g}: cannot read ({e}): the shard is "
                               f"corrupt; rewrite it or remove it from the corpus") from None
        self.reads += 1
        column = table.column(self.column).combine_chunks()
        lengths = column.value_lengths().to_numpy(zero_copy_only=False) if not \
            pa.types.is_fixed_size_list(column.type) else None
        if lengths is not None and len(lengths) and (lengths != self.seq_len + 1).any():
            bad = int(lengths[lengths != self.seq_len + 1][0])
            raise DatasetError(self._length_message(f"{where}, row group {g}", bad))
        values = column.flatten().to_numpy(zero_copy_only=False)
        expected = meta.row_group(g).num_rows
        if len(values) != expected * (self.seq_len + 1):
            raise DatasetError(f"shard {where!r}, row group {g}: {len(values)} tokens for {expected} rows "
                               f"(null rows?): rewrite the shard")
        # Kept in the file's integer type (int32 for most corpora): half the cache of int64.
        return values.reshape(expected, self.seq_len + 1)

    def cache_info(self) -> dict[str, int]:
        """Row groups read from storage by this process, and those (and their bytes) cached."""
        return {"reads": self.reads, "cached": len(self._cache), "bytes": self._cached_bytes}

    def __repr__(self) -> str:
        return (f"ParquetTokens({mask_url(self.url)!r}, seq_len={self.seq_len}, shards={len(self.shards)}, "
                f"samples={len(self)})")


class _StorageReads:
    """A shard opened for reading whose reads fail as the storage's failures, not the file's.

    pyarrow takes any OSError out of a read for a file it cannot parse, and a connection reset
    is an OSError: unwrapped, a transient S3 failure mid-read reads as "the shard is corrupt",
    the user's error, and the run fails at once. Here every error the storage backend raises
    from a read or a seek (ConnectionResetError, a botocore or aiohttp connection error, a
    timeout, an expired credential) becomes `StorageError`, as at open (`Storage.open_read`);
    pyarrow passes a Python exception out of a read unchanged. Errors of the bytes themselves
    (not Parquet, another schema) still come from pyarrow and stay `DatasetError`.
    """

    def __init__(self, raw, storage: Storage, path: str):
        self._raw, self._storage, self._path = raw, storage, path

    def _guard(self, name: str, *args):
        try:
            return getattr(self._raw, name)(*args)
        except FileNotFoundError:
            raise                                   # the shard went away: _read_row_group says so
        except Exception as e:   # whatever the backend raises is a storage failure
            raise StorageError(f"reading {self._storage.display(self._path)!r} failed: {type(e).__name__}: {e} "
                               f"(transient storage trouble: the run recovers; if it persists, check the "
                               f"endpoint and credentials)", url=self._storage.url) from e

    def read(self, *args):
        return self._guard("read", *args)

    def readinto(self, buffer):
        return self._guard("readinto", buffer)

    def read1(self, *args):
        return self._guard("read1", *args)

    def readall(self):
        return self._guard("readall")

    def seek(self, *args):
        return self._guard("seek", *args)

    def tell(self):
        return self._guard("tell")

    def __getattr__(self, name: str):
        return getattr(self._raw, name)             # readable, seekable, closed, size, ...

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> _StorageReads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_token_shards(url: str, shards: Iterable[np.ndarray], *, column: str = "tokens",
                       row_group_size: int = 256, storage_options: dict | None = None,
                       extra: dict | None = None) -> dict[str, Any]:
    """Write a corpus: each array of shape ``(rows, seq_len + 1)`` becomes ``shard-NNNNN.parquet``.

    Every shard is written whole (locally: temp file and rename; S3: one PUT), then the
    `CORPUS.json` marker (shards, rows, seq_len and `extra`) last, so `corpus_exists` is false
    for a write that crashed half-way. Returns the marker's contents.
    """
    store = Storage(url, storage_options)
    store.makedirs(store.root)
    store.rm(store.path(MARKER))        # a rewrite is not a corpus until it has finished
    written, seq_len, rows = [], None, 0
    for i, array in enumerate(shards):
        array = np.asarray(array)
        if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
            raise DatasetError(f"write_token_shards: shard {i} must be a 2-D integer array "
                               f"(rows, seq_len + 1), got {array.dtype} {array.shape}")
        if seq_len not in (None, array.shape[1] - 1):
            raise DatasetError(f"write_token_shards: shard {i} has rows of {array.shape[1]} tokens, "
                               f"shard 0 of {seq_len + 1}: give every shard the same row length")
        seq_len = array.shape[1] - 1
        values = pa.array(array.astype(np.int32 if array.max(initial=0) < 2**31 else np.int64).ravel())
        table = pa.table({column: pa.FixedSizeListArray.from_arrays(values, array.shape[1])})
        buffer = io.BytesIO()
        pq.write_table(table, buffer, row_group_size=row_group_size)
        name = f"shard-{i:05d}{SUFFIX}"
        store.write_atomic(store.path(name), buffer.getvalue())
        written.append(name)
        rows += array.shape[0]
    if not written:
        raise DatasetError("write_token_shards: no shards given")
    marker = {"format": 1, "shards": written, "rows": rows, "seq_len": seq_len, "column": column, **(extra or {})}
    store.write_atomic(store.path(MARKER), json.dumps(marker, indent=1).encode())
    return marker


def read_corpus_marker(url: str, storage_options: dict | None = None) -> dict[str, Any] | None:
    """The `CORPUS.json` of a corpus written by `write_token_shards`, or None if it has none."""
    store = Storage(url, storage_options)
    try:
        return json.loads(store.read_bytes(store.path(MARKER)))
    except FileNotFoundError:
        return None

"""A Ray Dataset as indexable rows: what `ctx.prepare_data` makes of a `ray.data.Dataset`, so that
the elastic loader (elastic._worker.loader) shards, counts and resumes it like any map-style
dataset: by data-parallel rank, exactly once across kills, rescales and resumes, and from the
middle of an epoch.

Ray Data streams its rows; the loader addresses samples by index (a pure function of (seed,
epoch) over indices). So the dataset is materialized once per run and its rows are numbered in the
order Ray Data produced them:

- `DataSourceActor` materializes it (`Dataset.materialize()`, with the DataContext's
  `execution_options.preserve_order` set: a deterministic row order, so that a resumed run, which
  materializes again, numbers the rows as the first one did) and holds the blocks. It is a detached
  actor named after the run and the order of the prepare_data call in the loop
  (elastic._run_names.RunNames.data_source), created with get_if_exists: every rank, every
  generation and every replacement worker finds the one the first rank created, and the blocks'
  owner outlives any worker. Nothing goes through the driver. Blocks the actor does not own (a
  dataset built from in-memory data, with from_items, from_numpy or from_pandas, keeps the blocks
  of the worker that built it) are copied into blocks it owns.
- `RayDatasetRows`, on each rank, asks it for the blocks' refs and row counts, maps a global row
  index to (block, row) (`BlockIndex`), fetches blocks from the object store, converted once to
  numpy columns, into a small LRU cache (`BlockCache`), and returns rows as dicts of numpy values,
  which torch's default_collate batches into tensors (a fixed-size list column, such as tokens,
  into one [B, L] tensor).

Ray Data's read and transform tasks need free CPUs: on a cluster whose workers hold every CPU a
materialization would wait forever, so the actor waits at most `CPU_WAIT_S` for a free one and
then fails, and the ranks raise a ConfigError saying so. DataLoader worker processes are refused
(`check_loader_options`): a forked process has no Ray connection to fetch blocks with.

Lifetime: the controller removes a run's data sources when the run ends
(elastic._run_names.remove_holders, from the worker group's shutdown), the driver's reap of a
run whose controller is lost does too, and each actor ends itself once the run's controller is gone
for good, as a worker's orphan watch does. An actor lost with its node is restarted by Ray and
materializes again on the next request: a rank that finds a block lost asks again (`_reopen`), and
the rows are the same (preserve_order). A context built outside a run (a benchmark's) has no run
id: its actor is named after the storage URL and owned by the process that created it (not
detached), so it ends with that process.
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from elastic._run_names import NAMESPACE, RunNames, end_when_orphaned
from elastic.errors import ConfigError, DatasetError

log = logging.getLogger("elastic.data")

CPU_WAIT_S = 60.0            # a materialization waits this long for a free CPU, then fails
STATE_WAIT_S = 5.0           # a rank's request for the state is held this long while it materializes
SLOW_NOTE_S = 30.0           # a rank logs a materialization still going this often
CACHE_BYTES = 256 << 20      # blocks a rank keeps fetched (the newest always kept)
SOURCE_CONCURRENCY = 64      # requests an actor answers at once (ranks waiting for the materialization)

_NO_WORKERS = ("prepare_data: num_workers > 0 is not supported with a ray.data.Dataset: DataLoader worker "
               "processes are forked from the training process and have no Ray connection to fetch the "
               "dataset's blocks with. Use num_workers=0 (the rows come from the object store, already "
               "decoded), and put per-sample work (decoding, augmentation) in the Dataset itself "
               "(map/map_batches), which Ray Data runs in its own tasks when the dataset is materialized")


def is_ray_dataset(obj: Any) -> bool:
    """Whether `obj` is a ray.data.Dataset. Ray Data is not imported for the question: without it
    imported no object of it exists (training without the `data` extra never imports it)."""
    data = sys.modules.get("ray.data")
    return data is not None and isinstance(obj, data.Dataset)


def is_ray_iterator(obj: Any) -> bool:
    """Whether `obj` is a ray.data.DataIterator (`iter_torch_batches`' source, a shard's iterator)."""
    data = sys.modules.get("ray.data")
    return data is not None and isinstance(obj, data.DataIterator)


def check_loader_options(options: dict[str, Any]) -> None:
    """Refuse the DataLoader options a Ray Dataset cannot honour (see `_NO_WORKERS`)."""
    if options.get("num_workers"):
        raise ConfigError(_NO_WORKERS)


def source_name(names: RunNames | None, n: int, storage: str) -> str:
    """The name of the actor holding the loop's n-th Ray Dataset: the run's, or outside a run (no
    run id) one derived from the storage URL, which a live run holds alone."""
    if names is not None:
        return names.data_source(n)
    return f"local-{hashlib.sha256(storage.encode()).hexdigest()[:16]}.data{n}"


@dataclass(frozen=True)
class Block:
    """One block of a materialized dataset, as the actor hands it to the ranks."""

    ref: Any            # the block's ObjectRef, owned by the actor
    start: int          # its first row that belongs to the dataset (a bundle may hold a slice of it)
    rows: int
    size_bytes: int


class BlockIndex:
    """Global row index -> (block, row within the block), over the blocks' row counts in order."""

    def __init__(self, rows: Sequence[int]):
        self.starts = [0]
        for count in rows:
            self.starts.append(self.starts[-1] + count)

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"row {index} out of range for a Ray Dataset of {n} rows")
        index %= n
        # bisect_right: a block of no rows shares its start with the next one, which holds the row.
        block = bisect.bisect_right(self.starts, index) - 1
        return block, index - self.starts[block]


class BlockCache:
    """The blocks a rank fetched last, up to `budget` bytes (by the blocks' own sizes); the newest
    is always kept, so rows read in order fetch each block once."""

    def __init__(self, budget: int):
        if budget < 0:
            raise ConfigError(f"the Ray Dataset block cache must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.fetches = 0
        self._blocks: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self._bytes = 0

    def get(self, key: int, size_bytes: int, fetch: Callable[[], Any]) -> Any:
        cached = self._blocks.get(key)
        if cached is not None:
            self._blocks.move_to_end(key)
            return cached[0]
        block = fetch()
        self.fetches += 1
        self._blocks[key] = (block, size_bytes)
        self._bytes += size_bytes
        while self._bytes > self.budget and len(self._blocks) > 1:
            self._bytes -= self._blocks.popitem(last=False)[1][1]
        return block

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0

    def info(self) -> dict[str, int]:
        """Blocks fetched from the object store so far, and those (and their bytes) cached."""
        return {"fetches": self.fetches, "cached": len(self._blocks), "bytes": self._bytes}


class _NoFreeCpu(Exception):
    pass


def _wait_for_a_free_cpu(wait_s: float) -> None:
    """Return once the cluster has a CPU free; _NoFreeCpu after `wait_s` without one."""
    import ray
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0.0) <= 0:
        if time.monotonic() >= deadline:
            total = ray.cluster_resources().get("CPU", 0.0)
            raise _NoFreeCpu(
                f"Ray Data needs free CPUs to read and transform the dataset, and none of the cluster's "
                f"{total:g} CPUs was free for {wait_s:g}s (the run's workers, and anything else on the "
                f"cluster, hold them): leave at least one free for the materialization, e.g. with fewer "
                f"workers (ScalingConfig.max_workers, spare_workers) or fewer CPUs each "
                f"(ScalingConfig.cpus_per_worker, resources_per_worker), or add CPUs to the cluster")
        time.sleep(0.5)      # the condition's poll interval (the GCS has no wait for it)


class DataSourceActor:
    """Holds one Ray Dataset of a run, materialized (see the module). Created through `ray.remote`
    by the first rank that prepares it, found by name by the others. Its methods answer at once
    (`state` within `STATE_WAIT_S`): the materialization runs on a thread of its own."""

    def __init__(self, controller: str | None):
        """`controller`: the run's controller actor's name; the actor ends once it is gone for good
        (None: outside a run, the actor is its creator's and ends with it)."""
        self._lock = threading.Lock()
        self._settled = threading.Event()        # ready or failed
        self._phase = "idle"                     # -> "materializing" -> "ready" | "failed"
        self._error: tuple[str, str] | None = None    # ("cpus" | "dataset", message)
        self._blocks: list[Block] = []
        self._started_at = 0.0
        if controller is not None:
            threading.Thread(target=end_when_orphaned, args=(controller, "data source"), name="orphan-watch",
                             daemon=True).start()

    def start(self, dataset: Any, cpu_wait_s: float = CPU_WAIT_S) -> None:
        """Materialize `dataset` unless this actor has already begun (the first rank's dataset is
        the one: every rank builds the same)."""
        with self._lock:
            if self._phase != "idle":
                return
            self._phase, self._started_at = "materializing", time.monotonic()
        threading.Thread(target=self._materialize, args=(dataset, cpu_wait_s), name="materialize",
                         daemon=True).start()

    def state(self, wait_s: float = 0.0) -> dict[str, Any]:
        """The phase, the blocks once ready or the error once failed, and the seconds since the
        materialization began; waits up to `wait_s` for it to settle."""
        self._settled.wait(wait_s)
        with self._lock:
            return {"phase": self._phase, "error": self._error,
                    "blocks": list(self._blocks) if self._phase == "ready" else None,
                    "elapsed_s": time.monotonic() - self._started_at if self._started_at else 0.0}

    def _materialize(self, dataset: Any, cpu_wait_s: float) -> None:
        error: tuple[str, str] | None = None
        blocks: list[Block] = []
        try:
            _wait_for_a_free_cpu(cpu_wait_s)
            # The dataset's own DataContext (a copy travelled with it): the order of its blocks is
            # the order of the source, not the order its tasks finish in.
            dataset.context.execution_options.preserve_order = True
            blocks = self._owned(_blocks_of(dataset.materialize()))
        except _NoFreeCpu as e:
            error = ("cpus", str(e))
        except Exception as e:   # every failure reaches the ranks, as a DatasetError
            log.exception("materializing the Ray Dataset failed")
            error = ("dataset", f"{type(e).__name__}: {e}")
        with self._lock:
            self._phase, self._error, self._blocks = ("failed" if error else "ready"), error, blocks
        self._settled.set()

    @staticmethod
    def _owned(blocks: list[Block]) -> list[Block]:
        """`blocks`, each owned by this actor: one owned by another process (the worker that
        built an in-memory dataset) is copied, or it would be lost with that process."""
        import ray
        mine = ray.put(None).owner_address()
        return [block if block.ref.owner_address() == mine else
                Block(ray.put(ray.get(block.ref)), block.start, block.rows, block.size_bytes)
                for block in blocks]

def _blocks_of(materialized: Any) -> list[Block]:
    """The blocks of a MaterializedDataset in its order, empty ones left out."""
    import ray
    from ray.data.block import BlockAccessor
    blocks = []
    for bundle in materialized.iter_internal_ref_bundles():
        slices = bundle.slices or (None,) * len(bundle.blocks)
        for entry, piece in zip(bundle.blocks, slices, strict=True):
            if piece is not None:
                start, rows = piece.start_offset, piece.num_rows
            else:
                start, rows = 0, entry.metadata.num_rows
                if rows is None:        # metadata without a row count: the block says it
                    rows = BlockAccessor.for_block(ray.get(entry.ref)).num_rows()
            if rows:
                blocks.append(Block(entry.ref, start, rows, int(entry.metadata.size_bytes or 0)))
    return blocks


def _numpy_columns(data: Any, block: Block) -> dict[str, Any]:
    """The rows of `block` (its fetched `data`) as Ray Data's "numpy" batch, each column writable
    (torch warns on every tensor made from a read-only view of the object store) and a column of
    equal-shape arrays (a fixed-size list, such as tokens) stacked into one array: its rows are
    then views that default_collate stacks into a [B, ...] tensor."""
    import numpy as np
    from ray.data.block import BlockAccessor
    piece = BlockAccessor.for_block(data).slice(block.start, block.start + block.rows, copy=False)
    batch = BlockAccessor.for_block(piece).to_batch_format("numpy")
    columns: dict[str, Any] = batch if isinstance(batch, dict) else {"data": batch}
    for name, values in columns.items():
        if values.dtype == object and len(values) and all(
                isinstance(v, np.ndarray) and v.shape == values[0].shape and v.dtype == values[0].dtype
                for v in values):
            columns[name] = np.stack(list(values))
        elif not values.flags.writeable:
            columns[name] = values.copy()
    return columns


def open_rows(dataset: Any, *, names: RunNames | None, n: int, storage: str,
              cache_bytes: int = CACHE_BYTES, cpu_wait_s: float = CPU_WAIT_S) -> RayDatasetRows:
    """The rows of the loop's n-th Ray Dataset (`dataset`), from the run's actor holding it:
    found, or created and started here (see the module)."""
    import ray
    name = source_name(names, n, storage)
    options: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "get_if_exists": True, "num_cpus": 0,
                               "max_concurrency": SOURCE_CONCURRENCY, "max_restarts": -1, "max_task_retries": -1}
    if names is not None:
        options["lifetime"] = "detached"       # the run's, not the creating worker's: it outlives any worker
    source = ray.remote(DataSourceActor).options(**options).remote(names.controller() if names else None)
    return RayDatasetRows(dataset, source, name, cache_bytes=cache_bytes, cpu_wait_s=cpu_wait_s)


class RayDatasetRows:
    """A materialized Ray Dataset's rows by global index (see the module): row i is a dict of
    column name -> numpy value. Waits for the materialization when built. A map-style dataset
    (no torch base class: this module, which the data source's process imports, stays free of
    torch, a second of every actor's start)."""

    def __init__(self, dataset: Any, source: Any, name: str, *, cache_bytes: int = CACHE_BYTES,
                 cpu_wait_s: float = CPU_WAIT_S):
        self._dataset, self._source, self.name, self._cpu_wait_s = dataset, source, name, cpu_wait_s
        self._cache = BlockCache(cache_bytes)
        self._blocks = self._await_blocks()
        self._index = BlockIndex([block.rows for block in self._blocks])

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """The rows at `indices`, in that order."""
        from ray.exceptions import ObjectLostError
        try:
            return self._rows(indices)
        except ObjectLostError as e:
            # Their owner, the data source, was lost (with its node): Ray restarts it, and it
            # materializes the same rows again (preserve_order).
            log.warning("a block of the Ray Dataset %s was lost (%s): asking its data source again", self.name,
                        type(e).__name__)
            self._reopen()
            return self._rows(indices)

    def cache_info(self) -> dict[str, int]:
        """Blocks fetched from the object store so far, and those (and their bytes) cached."""
        return self._cache.info()

    def _rows(self, indices: list[int]) -> list[dict[str, Any]]:
        rows = []
        for index in indices:
            block, row = self._index.locate(index)
            columns = self._columns(block)
            rows.append({name: values[row] for name, values in columns.items()})
        return rows

    def _columns(self, block: int) -> dict[str, Any]:
        """Block `block`'s rows as columns of numpy values, converted once per fetch (cached)."""
        import ray
        entry = self._blocks[block]
        return self._cache.get(block, entry.size_bytes, lambda: _numpy_columns(ray.get(entry.ref), entry))

    def _reopen(self) -> None:
        rows = len(self._index)
        blocks = self._await_blocks()
        index = BlockIndex([block.rows for block in blocks])
        if len(index) != rows:
            raise DatasetError(f"the Ray Dataset {self.name} had {rows} rows and has {len(index)} after its data "
                               f"source was restarted: the source changed during the run; it must not")
        self._blocks, self._index = blocks, index
        self._cache.clear()

    def _await_blocks(self) -> list[Block]:
        """The materialized blocks, once the data source has them (starting it if it had not)."""
        import ray
        ray.get(self._source.start.remote(self._dataset, self._cpu_wait_s))
        noted = time.monotonic()
        while True:
            state = ray.get(self._source.state.remote(STATE_WAIT_S))
            if state["phase"] == "ready":
                return state["blocks"]
            if state["phase"] == "failed":
                kind, message = state["error"]
                if kind == "cpus":
                    raise ConfigError(f"prepare_data: {message}")
                raise DatasetError(f"prepare_data: Ray Data could not materialize the dataset: {message}")
            now = time.monotonic()
            if now - noted >= SLOW_NOTE_S:
                noted = now
                log.warning("prepare_data: Ray Data has been materializing the dataset for %.0fs (%s); the "
                            "cluster has %g CPUs free, which its read and transform tasks need", state["elapsed_s"],
                            self.name, ray.available_resources().get("CPU", 0.0))

    def __repr__(self) -> str:
        return f"RayDatasetRows({self.name!r}, rows={len(self)}, blocks={len(self._blocks)})"

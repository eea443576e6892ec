"""Elastic, resumable data loading: which samples each rank reads at each step, and a torch
DataLoader that fetches them.

The sample order is a pure function of (seed, epoch); consumption is counted in global samples.
At a step with world size W and per-rank batch B, rank r reads global positions
[seen + r*B, seen + (r+1)*B) of that order, so a resume at any world size neither repeats nor
skips a sample. W and r are the data-parallel degree and rank (elastic.layout): under tensor
parallelism every rank of a replica reads its replica's samples, and its step's randomness.

With LRScalingConfig(mode="constant_global_batch") the global batch is G = base_world_size x B
at every W: rank r reads [seen + r*G/W, seen + (r+1)*G/W) as G/(W*B) micro-batches of B, one per
yield (see elastic._worker.accumulation).

The batches come from a torch DataLoader whose batch sampler yields, per micro-batch, a `_Key`:
(step, micro-batch, samples seen, dataset ids, fetch seed), planned from the context's counters
when iteration starts. Worker processes (``num_workers``) fetch whole micro-batches ahead of the
training thread, seeding torch, `random` and numpy from the key first, so what `__getitem__` and
`collate_fn` draw does not depend on the number of workers. The training thread still does the
accounting in step order: it computes the step's ids, calls `begin_step`, takes the next
batch (checked to be that step's), seeds the step's randomness, and yields. Prefetched batches
of steps that never run (a rescale unwinds the loop) are dropped uncounted: only `begin_step`
and `report` count.

The dataset is map-style (`check_map_style` refuses iterables, which can be neither sharded nor
resumed). A ray.data.Dataset reaches the loader as such a dataset: ctx.prepare_data turns it into
indexable rows first (elastic._worker.ray_data).
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import os
import random
import signal
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from elastic._determinism import mix_seed
from elastic._worker.accumulation import rank_positions
from elastic._worker.ray_data import is_ray_dataset, is_ray_iterator
from elastic.config import check_dataset_covers_global_batch
from elastic.errors import ConfigError, ElasticError

numpy: ModuleType | None
try:
    numpy = importlib.import_module("numpy")
except ImportError:   # numpy is optional for torch; without it there is no numpy RNG to seed
    numpy = None

if TYPE_CHECKING:
    from torch import nn

    from elastic._worker.accumulation import Accumulation


class LoaderSide(Protocol):
    """What the loader reads of, and tells, its generation's step boundary
    (elastic._worker.step_boundary.StepBoundary): the counters, and the opening of each step.
    The loader only reads the counters: read-only here."""

    @property
    def dp_rank(self) -> int: ...         # data-parallel rank: the ranks of a TP replica read the same batch
    @property
    def dp_size(self) -> int: ...         # data-parallel degree (elastic.layout.Layout)
    @property
    def total_steps(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def samples_seen(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def accumulation(self) -> Accumulation | None: ...   # constant_global_batch: micro-batches per step
    @property
    def sync_model(self) -> nn.Module | None: ...        # the model whose gradient sync accumulation toggles

    def begin_step(self, global_batch: int, sample_ids: list[int]) -> None: ...

# DataLoader options prepare_data passes on (its own arguments: batch_size, shuffle, collate_fn).
LOADER_OPTIONS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "timeout",
                  "worker_init_fn", "multiprocessing_context")
_ORDER_IS_OURS = ("the elastic loader decides which samples each rank reads at each step, so that a "
                  "resume at any world size neither repeats nor skips one; choose the order with "
                  "prepare_data's shuffle= and the run's seed")
REFUSED_OPTIONS = {
    "sampler": _ORDER_IS_OURS,
    "batch_sampler": _ORDER_IS_OURS,
    "shuffle": "pass shuffle= to prepare_data itself (the order is a pure function of (seed, epoch))",
    "batch_size": "pass batch_size to prepare_data itself (samples per rank per step or micro-batch)",
    "collate_fn": "pass collate_fn= to prepare_data itself",
    "drop_last": "every step reads exactly one global batch and the order runs on into the next epoch, "
                 "so there is never a partial batch to drop",
    "generator": "the order and the per-batch randomness come from the run's seed",
    "in_order": "batches must arrive in step order to be matched with their steps",
}


class _Key(NamedTuple):
    """What the batch sampler yields for one micro-batch; it travels to a worker process."""
    step: int
    micro: int
    samples_seen: int       # at the start of the step: identifies the step's place in the order
    ids: list[int]          # dataset indices of this micro-batch
    seed: int               # seeds torch, random and numpy before the fetch


class _Fetched(NamedTuple):
    key: _Key
    samples: Any


class _Loaded(NamedTuple):
    """What the DataLoader yields: the collated batch with the step it belongs to."""
    step: int
    micro: int
    samples_seen: int
    batch: Any


def seed_everything(seed: int) -> None:
    """Seed torch, `random` and numpy's global RNG (numpy takes 32 bits)."""
    if torch.cuda.is_available():
        torch.manual_seed(seed)
    else:
        # What torch.manual_seed does without CUDA, minus its lazy CUDA seed: queued for a CUDA
        # that never starts, with a stack trace formatted per call (0.1-0.3 ms; twice a step).
        torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


class _SeededFetch(Dataset):
    """The dataset as the DataLoader sees it: `__getitems__` takes a whole `_Key`, seeds the
    process's RNGs from it, then reads the samples (with the dataset's own `__getitems__` when it
    has one). Holds only the user's dataset: it is pickled to workers under spawn/forkserver."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __getitems__(self, key: _Key) -> _Fetched:
        seed_everything(key.seed)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(key.ids) if callable(getitems) else [self.dataset[i] for i in key.ids]
        return _Fetched(key, samples)


class _Collate:
    """The user's collate_fn (or default_collate), keeping the step the batch belongs to."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, fetched: _Fetched) -> _Loaded:
        key = fetched.key
        return _Loaded(key.step, key.micro, key.samples_seen, self.collate_fn(fetched.samples))


_PR_SET_PDEATHSIG = 1
_prctl: Any = None      # libc's prctl, looked up in the parent: a forked child must not dlopen


def _find_prctl() -> Any:
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False      # best effort: torch's watchdog still ends orphaned workers
    return _prctl


class _WorkerStart:
    """worker_init_fn of the loader's processes: on Linux, a worker is killed when the thread
    that started it (the one iterating the loader) ends, with its process or alone. A SIGKILLed
    rank's workers would otherwise live on for seconds (until torch's watchdog notices), holding
    copies of the rank's sockets: its peers would not see its process-group connections close.
    Then the user's worker_init_fn, if any."""

    def __init__(self, parent_pid: int, user_fn: Callable[[int], None] | None):
        self.parent_pid, self.user_fn = parent_pid, user_fn

    def __call__(self, worker_id: int) -> None:
        prctl = _find_prctl()
        if prctl and os.getppid() == self.parent_pid:      # fork, spawn (forkserver: not our child)
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self.parent_pid and not _alive(self.parent_pid):
            # The parent died before this worker started (torch's watchdog, which watches the
            # parent it finds at start, would never notice).
            os._exit(0)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a dead parent not yet reaped is a zombie: not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:          # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class _StepBatches(Sampler):
    """The DataLoader's batch sampler: the loader's keys from the context's current step on,
    planned when iteration starts."""

    def __init__(self, loader: ElasticLoader):
        self._loader = loader

    def __iter__(self) -> Iterator[_Key]:
        return self._loader._keys()

    def __len__(self) -> int:
        return len(self._loader)


# Loaders with worker processes that are being iterated. When a loader of another context (a
# newer generation) starts, the older ones are closed: their loop was unwound, but an iterator
# kept alive by a reference (`it = iter(loader)` in the loop's frame, held by a traceback) would
# keep its workers.
_LIVE: weakref.WeakSet[ElasticLoader] = weakref.WeakSet()


def _to_device(data: Any, device: torch.device, non_blocking: bool) -> Any:
    """`data` with every tensor moved to `device`, through nested dicts, lists and tuples."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, Mapping):
        moved = {k: _to_device(v, device, non_blocking) for k, v in data.items()}
        mapping_type: Any = type(data)      # a concrete mapping class: most are built from a dict
        try:
            return mapping_type(moved)
        except TypeError:      # a mapping type that cannot be built from a dict
            return moved
    if isinstance(data, tuple) and hasattr(data, "_fields"):    # namedtuple
        return type(data)(*(_to_device(v, device, non_blocking) for v in data))
    if isinstance(data, (list, tuple)):
        moved_items = [_to_device(v, device, non_blocking) for v in data]
        try:
            return type(data)(moved_items)
        except TypeError:
            return moved_items
    return data


def check_options(options: dict[str, Any]) -> None:
    """Refuse a DataLoader option prepare_data does not pass on, or a value it cannot take."""
    for name in options:
        if name in REFUSED_OPTIONS:
            raise ConfigError(f"prepare_data: the DataLoader option {name}= is not accepted: {REFUSED_OPTIONS[name]}")
        if name not in LOADER_OPTIONS:
            raise ConfigError(f"prepare_data: unknown option {name}=; the DataLoader options it accepts are "
                              f"{', '.join(LOADER_OPTIONS)}")
    workers = options.get("num_workers", 0)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ConfigError(f"prepare_data: num_workers must be an integer >= 0 (0: load in the training "
                          f"process), got {workers!r}")
    for name in ("pin_memory", "persistent_workers"):
        if not isinstance(options.get(name, False), bool):
            raise ConfigError(f"prepare_data: {name} must be True or False, got {options[name]!r}")
    if workers == 0:
        for name in ("prefetch_factor", "persistent_workers", "multiprocessing_context"):
            if options.get(name):
                raise ConfigError(f"prepare_data: {name}= needs worker processes: set num_workers >= 1 "
                                  f"or leave {name} out")
    prefetch = options.get("prefetch_factor")
    if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1):
        raise ConfigError(f"prepare_data: prefetch_factor (micro-batches each worker loads ahead) must be an "
                          f"integer >= 1, got {prefetch!r}")
    timeout = options.get("timeout", 0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
        raise ConfigError(f"prepare_data: timeout (seconds to wait for a worker's batch; 0: no limit) must be "
                          f"a number >= 0, got {timeout!r}")


_SUPPORTED_SOURCES = ("a map-style dataset (__len__, and __getitem__ by index: a torch Dataset, a list, a tensor), "
                      "elastic.ParquetTokens (Parquet token shards on storage, read on demand), or a "
                      "ray.data.Dataset (materialized once per run; see docs/concepts.md, Ray Data)")


def check_map_style(dataset: Any) -> None:
    """Refuse a source the loader cannot address by index: an iterable (a torch IterableDataset, a
    generator, a Ray DataIterator, anything without __len__ and __getitem__) can be neither sharded
    by rank nor resumed mid-epoch without reading, and throwing away, what came before. A
    ray.data.Dataset is converted by ctx.prepare_data, never here."""
    what = type(dataset).__name__
    if is_ray_dataset(dataset):
        why = (f"a ray.data.Dataset ({what}) must go through ctx.prepare_data, which materializes it once per run "
               f"into indexable rows")
    elif is_ray_iterator(dataset):
        why = (f"a Ray DataIterator ({what}) streams its rows once, in an order no rank can address or resume; pass "
               f"the ray.data.Dataset itself to ctx.prepare_data")
    elif isinstance(dataset, torch.utils.data.IterableDataset):
        why = (f"a torch IterableDataset ({what}) yields its samples in an order of its own: the loader can neither "
               f"give each rank its share nor resume mid-epoch")
    elif isinstance(dataset, Iterator):
        why = f"an iterator or generator ({what}) can be read once, in order, and cannot be resumed"
    elif not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        why = f"{what} has no __len__ and __getitem__ by index"
    else:
        return
    raise ConfigError(f"prepare_data: {why}. The elastic loader reads samples by index, in an order that is a pure "
                      f"function of (seed, epoch), so that each rank reads its share and a resume neither repeats "
                      f"nor skips one. Pass {_SUPPORTED_SOURCES}")


class ElasticLoader:
    """Iterable of per-rank batches from the current step up to `total_steps`.

    Reads the step and sample counters from the context when iterated, so it may be created
    before `ctx.restore`. `loader_options` go to the torch DataLoader (see LOADER_OPTIONS);
    batches are moved to `ctx.device`.
    """

    def __init__(self, ctx: LoaderSide, dataset: Any, batch_size: int, *, shuffle: bool = True,
                 collate_fn: Callable[[list[Any]], Any] | None = None, seed: int | None = None,
                 **loader_options: Any):
        if batch_size < 1:
            raise ElasticError(f"prepare_data: batch_size must be >= 1, got {batch_size}")
        check_map_style(dataset)
        if len(dataset) == 0:
            raise ElasticError("prepare_data: the dataset is empty")
        check_options(loader_options)
        self._ctx = ctx
        self._dataset = dataset
        self.batch_size = batch_size
        self._shuffle = shuffle
        self._seed = ctx.seed if seed is None else seed
        self._orders: dict[int, torch.Tensor] = {}
        check_dataset_covers_global_batch(len(dataset), batch_size=batch_size, world_size=ctx.dp_size,
                                          accum_steps=self.accum_steps)
        device = getattr(ctx, "device", None)
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        options = dict(loader_options)
        options.setdefault("pin_memory", self._device.type == "cuda")
        self._non_blocking = bool(options["pin_memory"]) and self._device.type == "cuda"
        self.num_workers = options.get("num_workers", 0)
        self._persistent = bool(options.get("persistent_workers", False))
        if self.num_workers:
            _find_prctl()
            options["worker_init_fn"] = _WorkerStart(os.getpid(), options.get("worker_init_fn"))
        # A generator of its own: starting workers draws their base seed from it, not from the
        # global RNG the step's randomness is seeded into.
        generator = torch.Generator().manual_seed(mix_seed(self._seed, "loader"))
        try:
            # _SeededFetch.__getitems__ hands the collate a whole step's _Fetched, not the list of
            # samples DataLoader's types assume.
            collate: Any = _Collate(collate_fn or default_collate)
            self._loader: DataLoader[Any] = DataLoader(_SeededFetch(dataset), batch_sampler=_StepBatches(self),
                                                       collate_fn=collate, generator=generator, **options)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"prepare_data: invalid DataLoader options {loader_options}: {e}") from None
        self._iterators: list[Any] = []       # this loader's live DataLoader iterators

    @property
    def accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step (1 unless the global batch is held constant)."""
        accumulation = getattr(self._ctx, "accumulation", None)
        return accumulation.steps if accumulation is not None else 1

    @property
    def global_batch(self) -> int:
        return self.batch_size * self._ctx.dp_size * self.accum_steps

    def __len__(self) -> int:
        """Batches (micro-batches) this loader still yields."""
        return max(0, self._ctx.total_steps - self._ctx.step) * self.accum_steps

    def sample_ids(self, samples_seen: int, rank: int) -> list[int]:
        """Dataset indices rank `rank` reads at the step that starts after `samples_seen`."""
        positions = rank_positions(samples_seen, self.global_batch, self._ctx.dp_size, rank)
        return self._dataset_indices(positions.start, positions.stop)

    def _dataset_indices(self, start: int, stop: int) -> list[int]:
        """Dataset indices at global positions [start, stop): slices of each epoch's order, not one
        tensor read per sample (every rank reads the whole group's ids at every step: 80,000 at
        10,000 ranks of 8)."""
        n, ids = len(self._dataset), []
        while start < stop:
            epoch, position = divmod(start, n)
            end = min(stop - start, n - position) + position
            if self._shuffle:
                ids += self._epoch_order(epoch)[position:end].tolist()
            else:
                ids += range(position, end)
            start += end - position
        return ids

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            generator = torch.Generator().manual_seed(mix_seed(self._seed, "epoch", epoch))
            order = torch.randperm(len(self._dataset), generator=generator)
            self._orders = {epoch: order}   # one epoch cached: bounded memory
        return order

    def _micro_seed(self, step: int, micro: int) -> int:
        """Randomness inside the step (dropout, ...) depends only on (seed, step, rank); with
        accumulation on the micro-batch's place in the global batch, which no W changes."""
        ctx = self._ctx
        if getattr(ctx, "accumulation", None) is None:
            return mix_seed(ctx.seed, "step", step, ctx.dp_rank)
        return mix_seed(ctx.seed, "step", step, "micro", ctx.dp_rank * self.accum_steps + micro)

    def _keys(self) -> Iterator[_Key]:
        """Every micro-batch from the context's step now to total_steps (the batch sampler)."""
        ctx, batch, accum = self._ctx, self.batch_size, self.accum_steps
        step, seen, global_batch = ctx.step, ctx.samples_seen, self.global_batch
        while step < ctx.total_steps:
            ids = self.sample_ids(seen, ctx.dp_rank)
            for micro in range(accum):
                yield _Key(step, micro, seen, ids[micro * batch:(micro + 1) * batch],
                           mix_seed(self._micro_seed(step, micro), "fetch"))
            step, seen = step + 1, seen + global_batch

    def __iter__(self) -> Iterator[Any]:
        ctx, accum = self._ctx, self.accum_steps
        if ctx.step >= ctx.total_steps:
            return
        accumulation = getattr(ctx, "accumulation", None)
        batches = self._start_iterator()
        keep_workers = False
        try:
            while ctx.step < ctx.total_steps:
                step, seen = ctx.step, ctx.samples_seen
                # The whole group's ids of this step, in global order (every rank computes the same).
                group_ids = self._dataset_indices(seen, seen + self.global_batch)
                ctx.begin_step(self.global_batch, group_ids)
                for micro in range(accum):
                    batch = self._next_batch(batches, step, micro, seen)
                    seed_everything(self._micro_seed(step, micro))
                    if accumulation is not None:
                        accumulation.begin_micro(micro, getattr(ctx, "sync_model", None))
                    yield batch
                    # Before the last micro-batch, accum > 1: there is an accumulation.
                    done = ctx.step != step if micro == accum - 1 else (
                        accumulation is not None and accumulation.reported() == micro + 1)
                    if not done:
                        raise ElasticError(
                            "ctx.report() must be called once per batch of ctx.prepare_data's loader. To accumulate "
                            "gradients over several batches per optimizer step, let the framework do it: "
                            "LRScalingConfig(mode='constant_global_batch') runs the loop body per micro-batch "
                            "(report() each time; opt.step() and the scheduler's step take effect on the last one), "
                            "or raise the loader's batch_size; see docs/concepts.md, LR modes")
        except GeneratorExit:
            # The loop left early (break, or a rescale unwound it): persistent workers stay for
            # the next iteration of this loader; close() or the next generation ends them.
            keep_workers = self._persistent
            raise
        finally:
            if not keep_workers:
                self._close_iterator(batches)

    def _start_iterator(self) -> Iterator[_Loaded]:
        if not self.num_workers:
            batches = iter(self._loader)
            self._iterators.append(batches)
            return batches
        for other in list(_LIVE):
            if other._ctx is not self._ctx:
                other.close()
        # Forked workers inherit every object of this process (a Ray worker: process groups,
        # checkpoint threads' state, ...). Frozen, those are never visited by the workers' garbage
        # collections: no destructor of the parent's objects runs in a child, and no page is
        # copied just to update their GC headers (CPython's advice for fork without exec). A
        # process that freezes objects itself is left to it.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            batches = iter(self._loader)
        finally:
            if freeze:
                gc.unfreeze()
        self._iterators.append(batches)
        _LIVE.add(self)
        return batches

    def _next_batch(self, batches: Iterator[_Loaded], step: int, micro: int, seen: int) -> Any:
        if not any(it is batches for it in self._iterators):
            raise ElasticError("this loader was closed (its worker processes shut down) while it was iterated; "
                               "iterate it again for a new iterator")
        try:
            loaded = next(batches)
        except StopIteration:
            loaded = None
        if loaded is None or (loaded.step, loaded.micro, loaded.samples_seen) != (step, micro, seen):
            got = "none" if loaded is None else f"step {loaded.step}, micro-batch {loaded.micro}"
            raise ElasticError(f"the loader's next batch ({got}) is not the one of step {step}, micro-batch {micro}: "
                               f"the step counters changed while the loader was iterated (ctx.restore after the "
                               f"loop began?)")
        if self._device.type == "cpu":
            return loaded.batch
        return _to_device(loaded.batch, self._device, self._non_blocking)

    def _close_iterator(self, batches: Any) -> None:
        self._iterators = [it for it in self._iterators if it is not batches]
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        if getattr(self._loader, "_iterator", None) is batches:
            self._loader._iterator = None     # persistent workers: the next iteration starts new ones
        if not self._iterators:
            _LIVE.discard(self)

    def close(self) -> None:
        """Shut down this loader's worker processes now (a later iteration starts new ones)."""
        for batches in list(self._iterators):
            self._close_iterator(batches)
        persistent = getattr(self._loader, "_iterator", None)
        if persistent is not None:
            self._close_iterator(persistent)
        _LIVE.discard(self)

"""Configuration of an elastic run: frozen, keyword-only dataclasses checked on construction.

`None` means unlimited (ScalingConfig.UNLIMITED names it). Each check says which field to change
and how. Every bad value, an unknown or positional argument included, is a ConfigError (never a
bare TypeError or OverflowError): a count is an int up to 2**63 - 1 (a bool or a float is
refused), a duration a finite number of seconds up to MAX_SECONDS, a flag a bool.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard, TypeVar

from elastic._credentials import mask_secrets, mask_url
from elastic.errors import ConfigError, StorageConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

STRATEGIES = ("ddp", "fsdp", "hsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
GRAD_COMPRESSIONS = (None, "bf16", "powersgd")
STORAGE_SCHEMES = ("file", "memory", "s3", "")
# The longest number of seconds any *_s field takes (about 31.7 years). Each becomes the timeout
# of a wait or a datetime.timedelta handed to torch, and each of those has a smaller range than
# timedelta's 8.6e13 s: a Python lock or event wait raises OverflowError past
# threading.TIMEOUT_MAX (9.2e9 s); torch's TCPStore adds the timeout to the clock in int64
# nanoseconds, so at 9.2e9 s its first connect times out at once, and gloo refuses 8.6e13 s as
# a negative timeout (torch 2.11, checked with a one-rank gloo group). 1e9 s passed both.
MAX_SECONDS = 1e9
MAX_COUNT = 2**63 - 1


class _SameAsMin:
    """ScalingConfig.max_workers when not given: __post_init__ makes it min_workers."""

    def __repr__(self) -> str:
        return "<min_workers>"


# Typed Any: it stands in a field typed `int | None` only until __post_init__ replaces it.
_SAME_AS_MIN: Any = _SameAsMin()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _got(value: Any) -> str:
    """`value` as a message shows it, with its type where the repr hides why it is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} (a {type(value).__name__})"
    return repr(value)


def _count(name: str, value: Any, minimum: int, *, none: str | None = None) -> None:
    """`value` is an int >= minimum, or None when `none` says what None means. A bool is refused
    (True would silently mean 1), and so is a float (2.5 failures means nothing)."""
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value > MAX_COUNT:
        allowed = f"an int >= {minimum}" + (f", or None ({none})" if none is not None else "")
        too_large = (f"; at most {MAX_COUNT} (2**63 - 1: numpy, torch and Ray hold a count as int64)"
                     if isinstance(value, int) and value > MAX_COUNT else "")
        raise ConfigError(f"{name} must be {allowed}, got {_got(value)}{too_large}")


def _finite(value: Any) -> TypeGuard[int | float]:
    """An int or float (not a bool) that is a finite float: nan, inf and an int past the float
    range (10**400, which math.isfinite cannot even convert) are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
            at_most: float | None = None, unit: str = "", none: str | None = None) -> None:
    """`value` is a finite int or float within the bounds (or None when `none` says what None
    means). inf is refused: a timeout of inf disables what it bounds (hang detection) or
    overflows where it is used (torch's timedelta); a bool or a string is refused too. A
    number of seconds is at most MAX_SECONDS: it becomes a timeout of a wait or a timedelta."""
    if value is None and none is not None:
        return
    if unit == "seconds":
        at_most = MAX_SECONDS if at_most is None else min(at_most, MAX_SECONDS)
    if (_finite(value) and (above is None or value > above) and (at_least is None or value >= at_least)
            and (at_most is None or value <= at_most)):
        return
    bounds = [f"> {above:g}" if above is not None else "", f">= {at_least:g}" if at_least is not None else "",
              f"<= {at_most:g}" if at_most is not None else ""]
    allowed = f"a finite number{' of ' + unit if unit else ''} {' and '.join(b for b in bounds if b)}".rstrip()
    if none is not None:
        allowed += f", or None ({none})"
    hint = ("; there is no 'no timeout': pick a large finite value"
            if unit == "seconds" and isinstance(value, float) and math.isinf(value) else "")
    if unit == "seconds" and _finite(value) and value > MAX_SECONDS:
        hint = (f"; {MAX_SECONDS:g} s (about 31 years) is the longest timeout a wait and torch's "
                f"process group take")
    raise ConfigError(f"{name} must be {allowed}, got {_got(value)}{hint}")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {_got(value)}")


# Arguments of other libraries' configs (Ray Train, ...) that users carry over: what to write instead.
_ARGUMENT_HINTS: dict[str, dict[str, str]] = {
    "ScalingConfig": {
        "num_workers": "elastic sizes the group between min_workers and max_workers: a fixed size N is "
                       "min_workers=N, max_workers=N (a smaller min_workers lets the run go on after losses)",
        "placement_strategy": "each worker (each replica, on one node, under tensor parallelism) has a placement "
                              "group of its own; set resources_per_worker",
        "trainer_resources": "the controller reserves no resources; set resources_per_worker for the workers",
        "accelerator_type": "reserve a custom resource in resources_per_worker",
    },
    "CheckpointConfig": {
        "num_to_keep": "use keep=N", "checkpoint_frequency": "use every_n_steps=N",
        "storage_path": "use storage=URL", "path": "use storage=URL", "url": "use storage=URL",
    },
    "FailureConfig": {
        "fail_fast": "user-code errors always fail at once; max_failures counts infrastructure failures",
    },
}


_Config = TypeVar("_Config", bound="DataclassInstance")


def _checked_arguments(cls: type[_Config]) -> type[_Config]:
    """Wrap the dataclass's generated __init__ so that a positional, unknown or missing argument
    is a ConfigError naming it (with the field it likely meant), not Python's TypeError."""
    generated = cls.__init__
    params = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in params]
    required = [f.name for f in params
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    hints = _ARGUMENT_HINTS.get(cls.__name__, {})

    @functools.wraps(generated)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigError(f"{cls.__name__} takes keyword arguments only: write {cls.__name__}("
                              f"{', '.join(n + '=...' for n in (required or names[:1]))}), got {len(args)} "
                              f"positional argument(s) {args!r}")
        for name in kwargs:
            if name not in names:
                hint = hints.get(name) or ", ".join(difflib.get_close_matches(name, names, n=2))
                raise ConfigError(f"{cls.__name__} has no field {name!r}" +
                                  (f": {hint}" if name in hints else f" (did you mean {hint}?)" if hint else "") +
                                  f"; its fields: {', '.join(names)}")
        missing = [name for name in required if name not in kwargs]
        if missing:
            raise ConfigError(f"{cls.__name__} needs {', '.join(n + '=...' for n in missing)}")
        generated(self, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]  # replacing the generated __init__ is the point
    return cls


def normalized_storage(url: Any) -> str:
    """CheckpointConfig.storage as every process of the run must read it: a path-like becomes a
    string; a local path becomes absolute (and `~` expanded), because each process (driver,
    controller, workers) has a cwd of its own; a URL is checked for what would otherwise go
    silently wrong (an s3:// with no bucket became a local folder named `s3:`)."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    _require(isinstance(url, str) and url.strip() != "",
             f"CheckpointConfig.storage must be a non-empty URL or path, got {_got(url)}")
    shown = mask_url(url)
    if "://" not in url:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", url):
            raise StorageConfigError(
                f"CheckpointConfig.storage {shown!r} looks like a URL with a malformed scheme; write "
                f"scheme://... (e.g. s3://bucket/prefix), or ./{shown} for a local folder of that name")
        return os.path.abspath(os.path.expanduser(url))
    scheme, rest = url.split("://", 1)
    if scheme not in STORAGE_SCHEMES:
        raise StorageConfigError(
            f"CheckpointConfig.storage: unsupported URL scheme {scheme!r} in {shown!r}; "
            f"use a local path, file://, memory:// or s3://")
    if scheme == "s3":
        bucket = rest.split("/", 1)[0]
        if not bucket.strip():
            raise StorageConfigError(f"CheckpointConfig.storage {shown!r} names no bucket; write s3://BUCKET/PREFIX")
        if "@" in bucket or ":" in bucket or any(c.isspace() for c in bucket):
            raise StorageConfigError(
                f"CheckpointConfig.storage {shown!r}: {bucket.rpartition('@')[2]!r} is no bucket name; put "
                f"credentials in storage_options (key, secret) or the AWS_* variables, never in the URL")
    if scheme == "file":
        path = rest
        if not path.startswith("/"):
            return "file://" + os.path.abspath(os.path.expanduser(path))
    return url


def check_dataset_covers_global_batch(num_samples: int, *, batch_size: int, world_size: int,
                                      accum_steps: int = 1) -> None:
    """A dataset must hold at least one global batch: with fewer samples the epoch wraps inside
    a step and every step reads some samples twice (silently: no sample is "lost"). Checked
    when a loader is made for a generation (the world size, hence the global batch, may differ
    from one generation to the next)."""
    global_batch = batch_size * world_size * accum_steps
    if num_samples >= global_batch:
        return
    per_rank = world_size * accum_steps
    largest = num_samples // per_rank
    parts = f"batch_size={batch_size} x world size {world_size}" + (f" x {accum_steps} micro-batches"
                                                                   if accum_steps > 1 else "")
    fix = (f"lower prepare_data's batch_size to at most {largest}" if largest >= 1
           else "even batch_size=1 is too many at this world size: lower max_workers")
    raise ConfigError(f"prepare_data: the dataset has {num_samples} samples, fewer than one global batch of "
                      f"{global_batch} ({parts}): every step would read some samples twice; {fix}, or use a "
                      f"larger dataset")


@_checked_arguments
@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """How many workers, on what hardware, with which parallel strategy."""

    UNLIMITED: ClassVar[None] = None
    """`max_workers=ScalingConfig.UNLIMITED`: no upper bound (the name of None, which the field
    keeps meaning, as everywhere in elastic's configs)."""

    min_workers: int = 1
    """Fewest workers the run may continue with; below this it waits for replacements."""
    max_workers: int | None = _SAME_AS_MIN
    """Most workers the run grows to when capacity exists. Not given: min_workers (a fixed size).
    `ScalingConfig.UNLIMITED` (that is, None) grows while the cluster has room.

    Why the bound is explicit: the run keeps a placement request standing for every worker it
    could still add, so an unbounded run on an autoscaling cluster is a standing request for
    nodes, made by whoever forgot to write a maximum. So the default is the safe one (no growth),
    and unlimited is spelled out: `UNLIMITED` rather than a string ("unlimited") because the field
    keeps one type, `int | None`, for every reader (the controller and the policies read None as
    unlimited, a type checker keeps them honest), and a misspelt name fails where it is written
    (AttributeError) instead of at run time. An explicit None means the same as UNLIMITED: since
    the default is no longer None, writing None can only be a request for no bound."""
    startup_wait_s: float = 10.0
    """At start, how long to wait for max_workers to be placed before starting with fewer (at
    least min_workers); the rest join by a warm scale-up once ready. Raise it where every run
    must begin at full size (a slow image pull, a test that checks the starting world size).
    Workers already placed and starting are waited for up to starting_wait_s instead."""
    starting_wait_s: float = 60.0
    """At start, how long to wait for workers that are placed and starting (their process
    importing torch, initialising its device) before starting with fewer: they are coming, and a
    join after the first step re-forms the group, which costs more than the rest of their start
    (7 s at step 1 on a loaded 2-core machine, against seconds). The longer of the two waits
    applies to them; 0 starts as soon as startup_wait_s allows."""
    spare_workers: int = 0
    """Hot spares: workers started beyond max_workers, imported and idle, so that a lost member
    is replaced at once instead of after a new worker's start (seconds of imports, or a new
    node). Each reserves resources_per_worker. Needs max_workers."""
    use_gpu: bool = False
    """One GPU per worker and NCCL; otherwise CPU and gloo."""
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources reserved for each worker (its placement-group bundle): name -> finite amount
    >= 0. A "GPU" amount needs use_gpu=True (else the workers would hold GPUs and train on CPU)."""
    strategy: str = "ddp"
    """"ddp" (replicated; warm recovery from any survivor) or "fsdp" (FSDP2 fully_shard). With
    tensor_parallel_size > 1 it names what is done over the data-parallel dimension, TP inside:
    "ddp" replicates each TP shard over the replicas (FSDP2's replicate), "fsdp" shards it over
    them (FSDP2 on the dp_shard dimension of a 2-D mesh, as torchtitan's FSDP x TP). "hsdp":
    FSDP2 shards the state over `hsdp_shard_size` replicas (a shard group) and replicates it
    across the shard groups (torchtitan's HSDP, TP inside); a lost rank's shard group leaves
    whole and the others restore it warm."""
    tensor_parallel_size: int = 1
    """Ranks per replica for tensor parallelism (T): the model is split over T ranks by the user's
    TP plan (`ctx.prepare_model(model, parallelize=fn)`). min_workers, max_workers and
    spare_workers count ranks and must be multiples of T; the data-parallel degree (world size
    / T) grows and shrinks one replica at a time."""
    pipeline_parallel_size: int = 1
    """Pipeline stages per replica (P): the model is split into P stages (or P x V under an
    interleaved schedule) by `ctx.prepare_pipeline(model, split_points=...)`, each stage on T
    ranks. A replica is a whole pipeline of T x P ranks: min_workers, max_workers and
    spare_workers must be multiples of T x P, and a lost rank takes its pipeline out while the
    others go on (strategies "ddp" and "fsdp"; not "hsdp", not with grad_compression or fp16)."""
    hsdp_shard_size: int | None = None
    """Under strategy "hsdp" (required there, refused elsewhere): replicas per shard group (S).
    FSDP2 shards the state over these S replicas and replicates it across the groups; the run
    grows and shrinks one shard group (S x tensor_parallel_size ranks, `unit_size`) at a time."""
    precision: str = "fp32"
    """"fp32"; "bf16": autocast to bfloat16 around `ctx.autocast()` (CPU and GPU; FSDP casts
    parameters with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) instead); "fp16":
    float16 with a GradScaler, GPU only: the loop calls `ctx.backward(loss)`."""
    grad_compression: str | None = None
    """DDP gradient compression through a communication hook: None, "bf16" (half the bytes) or
    "powersgd" (low-rank, with error feedback; reset after every rescale)."""
    powersgd_rank: int = 1
    """PowerSGD matrix approximation rank: higher sends more and approximates better."""
    powersgd_warmup_steps: int = 10
    """Steps of plain all-reduce before PowerSGD compresses, from the start and again after every
    rescale (its error feedback restarts from zero); at least 2 (DDP rebuilds its buckets after
    the first step)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them to backward
    (ZeRO-2-like: less communication, more memory)."""
    fsdp_cpu_offload: bool = False
    """FSDP2: keep sharded parameters, gradients and optimizer state in host memory
    (CPUOffloadPolicy); the optimizer step runs on the CPU."""
    node_agents: bool = False
    """Carry the controller's polls through one small agent actor per node (no CPU reserved):
    one Ray message per node and round instead of one per worker. For runs of hundreds of
    workers and more, where the controller's process would otherwise spend its CPU on Ray's
    per-message cost (docs/scale.md); it adds a hop of a few milliseconds to every answer, and a
    node whose agent is lost is polled directly until a new one starts."""

    def __post_init__(self) -> None:
        _count("ScalingConfig.min_workers", self.min_workers, 1)
        if self.max_workers is _SAME_AS_MIN:
            object.__setattr__(self, "max_workers", self.min_workers)
        _count("ScalingConfig.max_workers", self.max_workers, 1, none="ScalingConfig.UNLIMITED: no limit")
        _require(self.max_workers is None or self.max_workers >= self.min_workers,
                 f"ScalingConfig.max_workers ({self.max_workers!r}) must be an int >= "
                 f"min_workers ({self.min_workers}); raise max_workers or lower min_workers")
        _count("ScalingConfig.spare_workers", self.spare_workers, 0)
        _require(self.spare_workers == 0 or self.max_workers is not None,
                 "ScalingConfig.spare_workers needs a bounded max_workers (not UNLIMITED): with no maximum "
                 "every placed worker already joins the run")
        _number("ScalingConfig.startup_wait_s", self.startup_wait_s, at_least=0, unit="seconds")
        _number("ScalingConfig.starting_wait_s", self.starting_wait_s, at_least=0, unit="seconds")
        _flag("ScalingConfig.use_gpu", self.use_gpu)
        _flag("ScalingConfig.node_agents", self.node_agents)
        _require(self.strategy in STRATEGIES,
                 f"ScalingConfig.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        self._check_replicas()
        self._check_resources()
        self._check_precision_and_memory()

    def _check_replicas(self) -> None:
        """Counts of ranks come in whole units: replicas of tensor_parallel_size ranks, or under
        hsdp shard groups of hsdp_shard_size replicas."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        _count("ScalingConfig.tensor_parallel_size", tp, 1)
        _count("ScalingConfig.pipeline_parallel_size", pp, 1)
        _require(pp == 1 or self.strategy != "hsdp",
                 f"ScalingConfig.pipeline_parallel_size={pp} does not combine with strategy='hsdp' yet; use "
                 f"strategy='ddp' (replicas hold each stage whole) or 'fsdp' (stages sharded over the replicas)")
        _require(pp == 1 or self.precision != "fp16",
                 f"ScalingConfig.pipeline_parallel_size={pp} does not combine with precision='fp16': the pipeline "
                 f"schedule runs the backward, so there is no ctx.backward to scale the loss; use 'bf16'")
        if self.strategy == "hsdp":
            _require(self.hsdp_shard_size is not None,
                     "ScalingConfig.strategy='hsdp' needs hsdp_shard_size: the replicas per shard group "
                     "(FSDP2 shards over them and replicates across the groups)")
            _count("ScalingConfig.hsdp_shard_size", self.hsdp_shard_size, 1)
        else:
            _require(self.hsdp_shard_size is None,
                     f"ScalingConfig.hsdp_shard_size={self.hsdp_shard_size!r} applies to strategy='hsdp' only; "
                     f"set strategy='hsdp' or leave hsdp_shard_size at None")
        unit = self.unit_size
        if self.strategy == "hsdp":
            size, what = "the unit size", (f"shard groups of hsdp_shard_size x tensor_parallel_size = "
                                           f"{self.hsdp_shard_size} x {tp} = {unit} ranks")
        elif pp > 1:
            size, what = "tensor_parallel_size x pipeline_parallel_size", f"pipelines of {tp} x {pp} ranks"
        else:
            size, what = "tensor_parallel_size", f"replicas of {tp} ranks"
        for name in ("min_workers", "max_workers", "spare_workers"):
            value = getattr(self, name)
            _require(value is None or value % unit == 0,
                     f"ScalingConfig.{name}={value} is not a multiple of {size}={unit}: the run "
                     f"grows and shrinks by whole {what}; set {name} to a multiple of {unit}")
        _require(self.replica_size == 1 or self.grad_compression is None,
                 f"ScalingConfig.grad_compression={self.grad_compression!r} works through DDP communication hooks, "
                 f"which a model split by tensor or pipeline parallelism (tensor_parallel_size={tp}, "
                 f"pipeline_parallel_size={pp}) does not use; set grad_compression=None")

    @property
    def replica_size(self) -> int:
        """Ranks that hold one copy of the model: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def unit_size(self) -> int:
        """Ranks that join and leave the group together: a replica (replica_size), or under hsdp
        a shard group (hsdp_shard_size x tensor_parallel_size)."""
        shard = self.hsdp_shard_size if self.strategy == "hsdp" and self.hsdp_shard_size else 1
        return self.replica_size * shard

    def _check_resources(self) -> None:
        resources = self.resources_per_worker
        _require(isinstance(resources, Mapping),
                 f"ScalingConfig.resources_per_worker must be a dict of Ray resource name -> amount, e.g. "
                 f"{{'CPU': 2}}, got {_got(resources)}")
        for name, amount in resources.items():
            _require(isinstance(name, str) and name != "",
                     f"ScalingConfig.resources_per_worker: a resource name is a non-empty str, got {_got(name)}")
            _number(f"ScalingConfig.resources_per_worker[{name!r}]", amount, at_least=0)
        gpus = resources.get("GPU")
        # A worker holding a GPU it never uses (CPU and gloo) is a mistake, never a choice.
        _require(not gpus or self.use_gpu,
                 f"ScalingConfig.resources_per_worker reserves GPU={gpus} per worker but use_gpu=False, so the "
                 f"workers would hold GPUs and train on CPU with gloo; set use_gpu=True (NCCL, one GPU "
                 f"per worker by default) or drop 'GPU' from resources_per_worker")
        _require(gpus is None or gpus > 0 or not self.use_gpu,
                 "ScalingConfig.use_gpu=True but resources_per_worker reserves GPU=0, so the workers get "
                 "no GPU; drop 'GPU' from resources_per_worker (one per worker) or set use_gpu=False")
        object.__setattr__(self, "resources_per_worker", dict(resources))

    def _check_precision_and_memory(self) -> None:
        _require(self.precision in PRECISIONS,
                 f"ScalingConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        _require(self.precision != "fp16" or self.use_gpu,
                 "ScalingConfig.precision='fp16' needs use_gpu=True (a GradScaler on CPU is not supported); "
                 "use precision='bf16' on CPU")
        _require(self.grad_compression in GRAD_COMPRESSIONS,
                 f"ScalingConfig.grad_compression must be one of {GRAD_COMPRESSIONS}, got {self.grad_compression!r}")
        _require(self.grad_compression is None or self.strategy == "ddp",
                 f"ScalingConfig.grad_compression={self.grad_compression!r} works through DDP communication "
                 f"hooks; with strategy={self.strategy!r} set grad_compression=None (FSDP reduces in reduce_dtype)")
        _count("ScalingConfig.powersgd_rank", self.powersgd_rank, 1)
        _count("ScalingConfig.powersgd_warmup_steps (DDP rebuilds buckets after its first step)",
               self.powersgd_warmup_steps, 2)
        _flag("ScalingConfig.fsdp_reshard_after_forward", self.fsdp_reshard_after_forward)
        _flag("ScalingConfig.fsdp_cpu_offload", self.fsdp_cpu_offload)
        _require(self.strategy in ("fsdp", "hsdp") or (self.fsdp_reshard_after_forward and not self.fsdp_cpu_offload),
                 "ScalingConfig.fsdp_reshard_after_forward / fsdp_cpu_offload apply to strategy='fsdp' or 'hsdp' "
                 "only; set strategy='fsdp' or leave them at their defaults")

    @property
    def cpus_per_worker(self) -> float:
        return float(self.resources_per_worker.get("CPU", 1.0))


@_checked_arguments
@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often the run commits sharded checkpoints."""

    storage: str
    """fsspec URL or local path: the run's home (checkpoints/, status.json, summary.json). A
    pathlib.Path is taken as its string; a relative path is made absolute here, against this
    process's working directory (every process of the run has its own)."""
    every_n_steps: int | None = None
    """Commit a checkpoint every this many steps; None means only at the end."""
    keep: int | None = 3
    """How many committed checkpoints to retain; None keeps all."""
    async_save: bool = True
    """Stage state in host memory at the step boundary and upload in the background."""
    max_consecutive_failures: int = 3
    """Failed saves in a row before the run fails with a CheckpointError."""
    in_memory_every_n_steps: int | None = 10
    """FSDP, and DDP under FailureConfig.sdc_check. Under DDP each rank keeps one copy of its replica in
    host memory, taken every this many steps at a step whose replicas' fingerprints agreed: what a
    silent corruption rolls back to (at most this many steps redone; None: the checkpoint instead).
    It costs a host copy of the model and optimizer state every this many steps (on a GPU, 16 bytes
    per parameter with Adam through PCIe). Under FSDP every this many steps each rank copies its
    shards (parameters, optimizer state) and the run's progress to host memory, and keeps a copy of
    its ring neighbour's. A lost rank's state then comes back from its neighbour's memory, resharded
    to the new world size, with no storage read and at most this many steps redone (the checkpoint
    remains for two neighbours lost together). Costs two copies of each rank's share of the model
    and optimizer state in host memory, and one copy's worth of network per rank every this many
    steps: +2.5 % step time at 10 and +11.5 % at 1 on 2 CPU ranks with the base model (BENCHMARKS.md
    F2). None turns it off."""
    node_copies: bool = True
    """With copies in memory (in_memory_every_n_steps), each rank also hands its own copy to its
    node's keeper, an actor of the run that outlives the workers (elastic._node_keeper): a fault
    that kills every worker at once (a job-wide crash, the OOM killer) restores from there, with
    no storage read and at most in_memory_every_n_steps steps redone, instead of going back to
    the checkpoint. Under DDP one rank per node hands its copy over. Costs one more copy of each
    rank's own state in host memory (the keeper's), handed over in the background every
    in_memory_every_n_steps steps: +1.4 % mean step time against no copies, +3 % against the
    workers' copies alone, for DDP's small GPT on 3 CPU ranks at 10 (BENCHMARKS.md F2). False:
    the workers' copies only."""
    write_process: bool = False
    """With async_save, each rank's checkpoint files are serialised, hashed and uploaded by a child
    process of the worker (checkpointing._write_process) instead of the save's background thread,
    so that work does not hold the training process's GIL while the loop runs. The planning and
    the commit (fence, manifest, retention) stay in the worker. The child starts at the first
    save (a second or more: it imports torch) and ends with the worker. Not for memory:// storage.
    BENCHMARKS.md C3 measures it against the thread and DCP's process-based async save."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Extra fsspec options (for s3: endpoint_url, key, secret); AWS_* variables also work. Shown
    (repr, summary.json) with every secret-named key masked at any depth."""
    takeover: bool = False
    """Take the storage over from another run even if that run looks alive (its lease in FENCE was
    renewed in the last 60 s). Without it a second run on one storage URL refuses to start with
    RunConflictError naming the live run; a dead run's storage (lease older than 60 s, or
    status.json in a final state) is taken over without it. The run taken over is fenced: it
    fails with RunConflictError at its next renewal, and its next checkpoint is refused."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage", normalized_storage(self.storage))
        _count("CheckpointConfig.every_n_steps", self.every_n_steps, 1, none="only at the end")
        _count("CheckpointConfig.keep", self.keep, 1, none="keep all")
        _flag("CheckpointConfig.async_save", self.async_save)
        _flag("CheckpointConfig.takeover", self.takeover)
        _flag("CheckpointConfig.node_copies", self.node_copies)
        _flag("CheckpointConfig.write_process", self.write_process)
        _count("CheckpointConfig.max_consecutive_failures", self.max_consecutive_failures, 1)
        _count("CheckpointConfig.in_memory_every_n_steps", self.in_memory_every_n_steps, 1, none="off")
        _require(isinstance(self.storage_options, Mapping) and all(isinstance(k, str) for k in self.storage_options),
                 f"CheckpointConfig.storage_options must be a dict of fsspec option name -> value, "
                 f"got {_got(mask_secrets(self.storage_options))}")
        object.__setattr__(self, "storage_options", dict(self.storage_options))

    def __repr__(self) -> str:
        """With no secret in it (a config is logged and printed): see elastic._credentials."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown.update(storage=mask_url(self.storage), storage_options=mask_secrets(self.storage_options))
        return f"CheckpointConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


NONFINITE_LOSS_ACTIONS = ("fail", "ignore")


@_checked_arguments
@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """How failures are detected and how many the run tolerates."""

    max_failures: int | None = None
    """Infrastructure failures tolerated over the run's whole life; None (the default) is
    unlimited: a run of weeks meets faults every day, and the two rules below stop a run that is
    failing rather than one that has lived long (TooManyFailuresError). User-code errors fail at once."""
    failure_rate_limit: int | None = 60
    """At most this many infrastructure failures within failure_rate_window_s (FailureRateError
    beyond); None switches the rule off. The default allows a fault every 10 s for 10 minutes."""
    failure_rate_window_s: float = 600.0
    max_failures_without_progress: int | None = 5
    """Fail (NoProgressError) when this many failures in a row each came before the run kept a
    step past where the one before had reached: a crash loop (a rank that dies at the same step
    on every attempt) ends in minutes, while a run that moves on between faults is never stopped
    by it. None switches the rule off."""
    heartbeat_interval_s: float = 0.2
    """How often the controller looks at its workers (and re-polls one that answered). While the
    run trains, a worker holds a poll until something happens, up to 1 s (at most a fifth of
    heartbeat_timeout_s)."""
    heartbeat_timeout_s: float = 10.0
    """A worker that does not answer a poll for this long is declared hung and replaced.
    On a loaded machine raise it to avoid false alarms; lower it for faster hang detection."""
    collective_timeout_s: float = 60.0
    """Process-group timeout: the longest a rank waits in one collective before giving up."""
    rendezvous_timeout_s: float = 120.0
    """Longest wait to place `min_workers` and form a process group."""
    straggler_window: int = 20
    """Steps over which a rank's compute time is compared with the others' (median of the ratios)."""
    straggler_threshold: float | None = 1.35
    """A rank whose compute takes this many times the other ranks' median over the window is
    flagged (summary.json `stragglers`); the ScalingPolicy decides whether to evict it. None
    turns straggler scoring off. The default leaves room for the noise of 4 CPU workers sharing
    2 loaded cores (window medians up to 1.3 seen in clean runs); on GPUs it can go lower."""

    straggler_min_excess_s: float = 0.02
    """A flagged rank must also cost the group at least this many seconds of compute per step
    (median over the window, its time minus the others'): a high ratio on a few milliseconds of
    compute is scheduling noise, not worth a recovery. 0 flags on the ratio alone."""

    on_nonfinite_loss: str = "fail"
    """What a step whose loss (mean over ranks) is NaN or infinite does: "fail" ends the run with
    a NonFiniteLossError naming the step; "ignore" trains on. Either way no checkpoint is
    committed from such a step, so retention never deletes the last good one for it."""

    sdc_check: bool = True
    """Compare the replicas' parameters at every step (silent data corruption): each rank's
    64-bit fingerprint of its parameters, taken before the step's update (and after it at the
    steps whose state is kept), rides the step's exchange, and ranks that differ from
    their replicas are replaced, the run rolled back to a step whose fingerprints agreed (the
    newest in-memory copy from before it, else the newest checkpoint). Needs replicas (DDP, HSDP,
    TP/PP with 2 or more data-parallel replicas); under FSDP without replicas nothing is compared.
    Under DDP it also keeps a copy of the state in host memory every
    CheckpointConfig.in_memory_every_n_steps steps, taken only at steps whose fingerprints agreed,
    to roll back to. Costs one read of the parameters per step (BENCHMARKS.md SDC1)."""

    spot_check_every_n_steps: int | None = 100
    """With sdc_check, under DDP (no tensor or pipeline parallelism): every this many steps, and at
    every step whose checkpoint is committed, every rank recomputes the gradient of one shared
    micro-batch and the ranks compare it (elastic._worker.spot_check). It finds corruption in a
    rank's compute, which the gradient all-reduce hands to every replica and the parameter
    fingerprints therefore cannot see; the run rolls back to before the step after the last
    passed check. A persistent fault is found within this many steps; each check costs about one
    micro-batch's forward and backward: 0.9 % of the steps' time at 100, the default, which keeps
    the run near plain DDP's pace; 1.8 % at 50 (BENCHMARKS.md SDC5). None turns it off."""

    step_timeout_s: float | str | None = "auto"
    """Longest time without a completed step (or ctx.log) while the run trains before every rank
    is declared hung and replaced: catches a training thread stuck outside any collective (a
    dead data service, a deadlock), which no heartbeat sees. "auto": 100 smoothed step times,
    at least 600 s (an evaluation between steps counts against it); None turns it off."""

    hang_timeout_s: float | str | None = "auto"
    """How long the other ranks may wait for one in the step boundary (or in DDP's gradient sync)
    before that rank is declared hung and replaced: one that is silent, or whose training thread
    has not moved since they began to wait (a hung kernel, a dead data service, a frozen process:
    found in seconds instead of heartbeat_timeout_s or the collective timeout). "auto": learned
    from the run, HANG_FACTOR (4) x the p99 of the last 200 step times, at least HANG_FLOOR_S
    (2 s), where the step after a save or a copy to memory (its upload or handover goes on
    beside it) is learned and judged apart; judged only once 20 step times are known, never on a
    generation's first 2 steps nor on a rank in a checkpoint save or ctx.restore. A number pins
    the bound; None turns it off (then heartbeat_timeout_s, the collective timeout and
    step_timeout_s remain). Work one rank does alone between steps (a rank-0 evaluation) longer
    than the bound counts as a hang: pin it above that, or None."""

    HANG_FACTOR: ClassVar[float] = 4.0
    """hang_timeout_s="auto": the bound is this many p99 step times, and at least HANG_FLOOR_S."""
    HANG_FLOOR_S: ClassVar[float] = 2.0
    """hang_timeout_s="auto": the least bound, above the scheduling noise of a loaded machine."""

    def hang_timeout(self, p99_step_s: float | None) -> float | None:
        """The hang bound in force, given the p99 step time learned so far (None: too few steps
        yet; "auto" then judges nothing)."""
        if isinstance(self.hang_timeout_s, str):      # "auto": __post_init__ refuses any other string
            return None if p99_step_s is None else max(self.HANG_FLOOR_S, self.HANG_FACTOR * p99_step_s)
        return self.hang_timeout_s

    def step_timeout(self, step_s: float) -> float | None:
        """The bound in force, given the smoothed step time (0 before any step)."""
        if isinstance(self.step_timeout_s, str):      # "auto": __post_init__ refuses any other string
            return max(600.0, 100.0 * step_s)
        return self.step_timeout_s

    @property
    def poll_hold_s(self) -> float:
        """How long a worker may hold a poll while the run trains (answering at once when
        something happens): 1 s, and at most a fifth of heartbeat_timeout_s, so a healthy
        worker's silence stays far from the timeout."""
        return min(1.0, self.heartbeat_timeout_s / 5)

    def __post_init__(self) -> None:
        _count("FailureConfig.max_failures", self.max_failures, 0, none="unlimited")
        _count("FailureConfig.failure_rate_limit", self.failure_rate_limit, 1, none="no rate rule")
        _number("FailureConfig.failure_rate_window_s", self.failure_rate_window_s, above=0, unit="seconds")
        _count("FailureConfig.max_failures_without_progress", self.max_failures_without_progress, 1,
               none="no progress rule")
        # Every timeout finite: inf would switch hang detection off (heartbeat) or overflow
        # torch's timedelta in the workers (collective), which would read as a user error.
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s", "rendezvous_timeout_s"):
            _number(f"FailureConfig.{name}", getattr(self, name), above=0, unit="seconds")
        _require(self.heartbeat_timeout_s > self.heartbeat_interval_s,
                 f"FailureConfig.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                 f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        _count("FailureConfig.straggler_window", self.straggler_window, 3)
        _number("FailureConfig.straggler_min_excess_s", self.straggler_min_excess_s, at_least=0, unit="seconds")
        _flag("FailureConfig.sdc_check", self.sdc_check)
        _count("FailureConfig.spot_check_every_n_steps", self.spot_check_every_n_steps, 1, none="off")
        _require(self.on_nonfinite_loss in NONFINITE_LOSS_ACTIONS,
                 f"FailureConfig.on_nonfinite_loss must be one of {NONFINITE_LOSS_ACTIONS}, "
                 f"got {self.on_nonfinite_loss!r}")
        _require(self.step_timeout_s is None or _is_auto(self.step_timeout_s) or (
            _finite(self.step_timeout_s) and 0 < self.step_timeout_s <= MAX_SECONDS),
                 f"FailureConfig.step_timeout_s must be a finite number of seconds > 0 and <= {MAX_SECONDS:g}, "
                 f"\"auto\" or None (off), got {_got(self.step_timeout_s)}")
        _require(self.hang_timeout_s is None or _is_auto(self.hang_timeout_s) or (
            _finite(self.hang_timeout_s) and 0 < self.hang_timeout_s <= MAX_SECONDS),
                 f"FailureConfig.hang_timeout_s must be a finite number of seconds > 0 and <= {MAX_SECONDS:g}, "
                 f"\"auto\" (learned from the step times) or None (off), got {_got(self.hang_timeout_s)}")
        _number("FailureConfig.straggler_threshold (a ratio to the other ranks)", self.straggler_threshold,
                above=1.0, none="scoring off")


CONSTANT_GLOBAL_BATCH = "constant_global_batch"
LR_MODES = ("linear", CONSTANT_GLOBAL_BATCH)
LR_SCHEDULES = ("constant", "cosine")


@_checked_arguments
@dataclass(frozen=True, kw_only=True)
class LRScalingConfig:
    """The LR across rescales: "linear" (lr follows the global batch, with warmup and a ramp after
    rescales) or "constant_global_batch" (the global batch is kept by gradient accumulation; the
    LR follows only the schedule)."""

    base_world_size: int
    """Data-parallel degree at which `base_lr` is right (base global batch = base_world_size x
    per-rank batch): ranks, or replicas (tensor_parallel_size x pipeline_parallel_size ranks) when
    that is above 1 (the ranks of a replica read the same batch, so the batch and the rule count
    replicas). In
    constant_global_batch mode the global batch is always this many per-rank batches, so it must
    be divisible by every data-parallel degree the run allows."""
    base_lr: float | None = None
    """The LR at `base_world_size`; None takes the optimizer's initial LR."""
    warmup_steps: int = 0
    """Initial linear warmup, by global step (never restarted by a rescale or resume)."""
    rescale_warmup_steps: int = 0
    """After a rescale that raises the LR, ramp to it over this many steps; a drop applies at once
    (linear mode only: in constant_global_batch mode the LR never changes on a rescale)."""
    mode: str = "linear"
    """"linear": lr = base_lr x global_batch / base_global_batch x schedule(step).
    "constant_global_batch": each rank accumulates base_world_size / world_size micro-batches per
    step; lr = base_lr x schedule(step)."""
    schedule: str = "cosine"
    """"constant" or "cosine" (decay to min_lr_ratio x at total_steps), after the warmup."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay, as a share of the peak LR."""

    def __post_init__(self) -> None:
        _count("LRScalingConfig.base_world_size", self.base_world_size, 1)
        _number("LRScalingConfig.base_lr", self.base_lr, above=0, none="the optimizer's LR")
        _count("LRScalingConfig.warmup_steps", self.warmup_steps, 0)
        _count("LRScalingConfig.rescale_warmup_steps", self.rescale_warmup_steps, 0)
        _require(self.mode in LR_MODES, f"LRScalingConfig.mode must be one of {LR_MODES}, got {self.mode!r}")
        _require(self.mode == "linear" or self.rescale_warmup_steps == 0,
                 "LRScalingConfig.rescale_warmup_steps has no effect in mode 'constant_global_batch' (the LR does "
                 "not change on a rescale); leave it 0 or use mode 'linear'")
        _require(self.schedule in LR_SCHEDULES,
                 f"LRScalingConfig.schedule must be one of {LR_SCHEDULES}, got {self.schedule!r}")
        _number("LRScalingConfig.min_lr_ratio", self.min_lr_ratio, at_least=0, at_most=1)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_LEVEL_ENV = "ELASTIC_LOG_LEVEL"     # how the level reaches the controller and worker processes
# The controller's and the workers' log lines (Ray streams them to the driver without a time of
# its own): a fault's story is read across processes by these times.
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


@_checked_arguments
@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """How much elastic logs (its `elastic.*` loggers), in the driver, the controller and the
    workers (Ray streams the last two to the driver): Ray Train's LoggingConfig(log_level) for
    this runtime. "WARNING" keeps a run to its warnings and errors (no per-generation INFO lines)."""

    level: str = "INFO"
    """One of DEBUG, INFO, WARNING, ERROR (any case)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.level, str) and self.level.upper() in LOG_LEVELS,
                 f"LoggingConfig.level must be one of {LOG_LEVELS}, got {_got(self.level)}")
        object.__setattr__(self, "level", self.level.upper())


def to_jsonable(config: Any) -> Any:
    """The effective configuration as plain JSON (for summary.json)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, dict):
        return {str(k): to_jsonable(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_jsonable(v) for v in config]
    if isinstance(config, (str, int, float, bool)) or config is None:
        return config
    return repr(config)


def allowed_world_sizes(min_workers: int, max_workers: int) -> list[int]:
    return list(range(min_workers, max_workers + 1))


def check_divisible(base_world_size: int, min_workers: int, max_workers: int | None, tp: int = 1,
                    shard: int = 1) -> None:
    """Configuration check: base_world_size must split into whole micro-batches at every allowed
    data-parallel degree (world sizes in replicas of `tp` ranks; under hsdp, multiples of its
    `shard` replicas per shard group)."""
    if max_workers is None:
        raise ConfigError("LRScalingConfig(mode='constant_global_batch') needs a bounded world size: set "
                          "ScalingConfig.max_workers (the global batch must divide by every allowed world size)")
    sizes = [w for w in allowed_world_sizes(min_workers // tp, max_workers // tp) if w % shard == 0]
    bad = [w for w in sizes if base_world_size % w]
    if bad:
        fits = math.lcm(*sizes)
        unit = "world sizes" if tp == 1 else f"data-parallel degrees (replicas of {tp} ranks)"
        raise ConfigError(
            f"LRScalingConfig.base_world_size={base_world_size} (the global batch in per-rank batches) is not "
            f"divisible by {unit} {bad} of ScalingConfig [{min_workers}, {max_workers}]; set "
            f"base_world_size to a multiple of {fits} (the lcm of the allowed sizes) or narrow min/max_workers")

"""The fault gate: every rank waits after one step until a file exists, so that a fault injected
from outside (a signal to a worker, a cut link) lands at exactly that step however fast the
machine is.

A hook for fault-injection tests (the integration and GPU suites), not for training, and kept
out of the user's loop: the driver sets it as the `train_loop_config` entry HOLD_AT_KEY (a `HoldAt`; the
examples' `--hold-at STEP:FILE`), and the framework holds at the step boundary, in
`TrainContext.report()` after the step is counted and its checkpoint started. The config carries
it because it reaches every worker as the driver set it, whichever Ray the run uses; an
environment variable set in the driver does not reach the actors of a Ray that was started
before it (the integration tests' shared instance). Without the entry nothing waits.

The injector watches status.json until the run is past the step, acts on a worker, then creates
the file; the collectives after the hold re-align the ranks, each released within one poll. So
that the controller hears of the held step, its record is settled (its exchange collected,
elastic._worker.step_boundary) before the ranks wait, and the hold is announced (the place HELD,
elastic._worker.thread_position): that step only, the others keep the boundary's pace.

`BitFlipAt` (the entry BITFLIP_AT_KEY) flips one bit of one parameter in one rank's memory
after a step, as a silent data corruption would (elastic._worker.fingerprint must find it); a
marker file disarms it once fired, so the step redone after the rollback is clean.

`BitFlipRequests` (the entry BITFLIP_REQUESTS_KEY) is the same fault on request, for the chaos
suite: at each step boundary a worker looks for a request file named after its process id in
a directory; the injector writes one (a seed), and the worker claims it, flips a bit of the
mantissa or the sign of a parameter element the seed picks, and leaves a record of what it did.

`BadGradientAt` (the entry BAD_GRADIENT_AT_KEY) corrupts one rank's gradient of one parameter in
its backward, before the all-reduce, from a step on (or once): a compute fault the parameters'
fingerprints cannot see, for elastic._worker.spot_check.

`StuckAt` (the entry STUCK_AT_KEY) is the other hook: one rank's training thread stops moving
after a step, as if the next step's compute hung (a hung kernel, a dead data service), while its
process and its poll thread go on answering. Nothing releases it: the controller must find it
(elastic._controller.hang_watch) and replace the worker. A marker file disarms it once fired, so
a replacement that trains through the same step again is not stuck too.
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic._protocol import ThreadPlace
from elastic._worker import thread_position
from elastic._worker.fingerprint import local_data
from elastic.errors import ConfigError, ElasticError

HOLD_AT_KEY = "elastic_hold_at"
STUCK_AT_KEY = "elastic_stuck_at"
BITFLIP_AT_KEY = "elastic_bitflip_at"
BITFLIP_REQUESTS_KEY = "elastic_bitflip_requests"
BAD_GRADIENT_AT_KEY = "elastic_bad_gradient_at"
GRADIENT_REQUEST = "gradient"     # a BitFlipRequests request for a wrong gradient, not a flipped parameter
SILENT_BITS = (*range(23), 31)    # a float32's mantissa and sign: a plausible number that trains on
HOLD_LIMIT_S = 300.0    # the injector's whole run: a fault that never comes fails the run, not the test's timeout
POLL_S = 0.01           # polling a file the injector creates; the hold ends within one poll of it


class HoldTimeoutError(ElasticError, TimeoutError):
    """The release file of a hold was not created in time: the injector that set the hold
    (`--hold-at`, a test's SignalAtStep) never released the run."""


@dataclass(frozen=True)
class HoldAt:
    """Hold every rank after step `step` (steps counted from 1) until `release_file` exists, for
    at most `limit_s` seconds. `release_file` must be visible to every worker (a local path on
    a one-machine run, a shared file system otherwise)."""

    step: int
    release_file: str
    limit_s: float = HOLD_LIMIT_S

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
            raise ConfigError(f"HoldAt.step must be an int >= 1 (the step after which the ranks wait), "
                              f"got {self.step!r}")
        if not isinstance(self.release_file, str) or not self.release_file:
            raise ConfigError(f"HoldAt.release_file must be a path, got {self.release_file!r}")
        if not self.limit_s > 0:
            raise ConfigError(f"HoldAt.limit_s must be > 0, got {self.limit_s!r}")

    @classmethod
    def parse(cls, text: str) -> HoldAt:
        """`STEP:FILE` (the examples' `--hold-at`), step >= 1."""
        step, sep, path = text.partition(":")
        if not (sep and path and step.isdigit() and int(step) >= 1):
            raise ConfigError(f"--hold-at must be STEP:FILE (step >= 1), got {text!r}")
        return cls(int(step), path)

    def as_config(self) -> dict[str, HoldAt]:
        """The `train_loop_config` entry that sets this hold."""
        return {HOLD_AT_KEY: self}

    def wait(self) -> None:
        deadline = time.monotonic() + self.limit_s
        while not os.path.exists(self.release_file):
            if time.monotonic() > deadline:
                raise HoldTimeoutError(
                    f"held after step {self.step}: {self.release_file} was not created within {self.limit_s:.0f} s; "
                    f"the fault injector that set the hold ({HOLD_AT_KEY} / --hold-at) must create it")
            time.sleep(POLL_S)


def _first_time(marker_file: str) -> bool:
    """Creates `marker_file`; False when it existed (the hook fired already, in any process)."""
    try:
        os.close(os.open(marker_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


@dataclass(frozen=True)
class StuckAt:
    """After step `step` (steps counted from 1), the training thread of rank `rank` stops moving
    for `limit_s` seconds, then raises HoldTimeoutError (a fault that is never found fails the run,
    not the test's timeout). The first rank to get there creates `marker_file`, which disarms the
    hook for every later generation and process (a path every worker sees)."""

    step: int
    rank: int
    marker_file: str
    limit_s: float = HOLD_LIMIT_S

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
            raise ConfigError(f"StuckAt.step must be an int >= 1 (the step after which the rank is stuck), "
                              f"got {self.step!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"StuckAt.rank must be an int >= 0, got {self.rank!r}")
        if not isinstance(self.marker_file, str) or not self.marker_file:
            raise ConfigError(f"StuckAt.marker_file must be a path, got {self.marker_file!r}")

    def as_config(self) -> dict[str, StuckAt]:
        """The `train_loop_config` entry that sets this fault."""
        return {STUCK_AT_KEY: self}

    def stick(self, rank: int) -> None:
        """On rank `rank` (the first time only): stop moving, as a hung compute would."""
        if rank != self.rank or not _first_time(self.marker_file):
            return
        thread_position.mark(ThreadPlace.COMPUTING)    # the next step's compute began, and hangs
        deadline = time.monotonic() + self.limit_s
        while time.monotonic() < deadline:
            time.sleep(POLL_S * 10)
        raise HoldTimeoutError(f"rank {rank} was stuck after step {self.step} for {self.limit_s:.0f} s and no one "
                               f"replaced it ({STUCK_AT_KEY}): hang detection missed it")


@dataclass(frozen=True)
class _BitFault:
    """Where a one-bit fault lands: after step `step` (counted from 1), on rank `rank`, bit `bit`
    of element `element` of its `param`-th parameter; `marker_file` (a path every worker sees)
    disarms it once fired. The default bit is a mantissa bit of a float32: a small,
    plausible-looking error that trains on."""

    step: int
    rank: int
    marker_file: str
    param: int = 0
    element: int = 0
    bit: int = 20

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for name in ("step", "rank", "param", "element", "bit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "step" else 0):
                raise ConfigError(f"{kind}.{name} must be an int >= {1 if name == 'step' else 0}, got {value!r}")
        if not isinstance(self.marker_file, str) or not self.marker_file:
            raise ConfigError(f"{kind}.marker_file must be a path, got {self.marker_file!r}")


@dataclass(frozen=True)
class BitFlipAt(_BitFault):
    """After step `step`, rank `rank` flips the bit in its parameter's local data, once: the
    first rank to get there creates `marker_file`, which disarms the hook for every later
    generation and process."""

    def as_config(self) -> dict[str, BitFlipAt]:
        """The `train_loop_config` entry that sets this fault."""
        return {BITFLIP_AT_KEY: self}

    def flip(self, rank: int, params: Callable[[], list[Any]]) -> None:
        """On rank `rank` (the first time only): flip the bit in place."""
        if rank == self.rank and _first_time(self.marker_file):
            _flip(local_data(params()[self.param]), self.element, self.bit)


def _flip(local: Any, element: int, bit: int) -> None:
    """Flip bit `bit` of element `element` of a parameter's local data (fingerprint.local_data)."""
    import torch
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
    with torch.no_grad():
        local.detach().view(ints).view(-1)[element] ^= 1 << bit


@dataclass(frozen=True)
class BadGradientAt(_BitFault):
    """From the boundary after step `step` on, rank `rank`'s backward computes a wrong gradient
    for its `param`-th parameter: the bit flipped, in every backward of this process
    (`persistent`) or in the next one only, as a faulty unit would (a corrupt product before the
    all-reduce, which hands it to every replica: elastic._worker.spot_check must find it). Armed
    once: the first rank to get there creates `marker_file`, so a replacement that trains through
    the same step again computes correctly. The fault lives on that generation's parameter tensor
    (a tensor hook): a re-formed group's new model is clean."""

    persistent: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.persistent, bool):
            raise ConfigError(f"BadGradientAt.persistent must be a bool, got {self.persistent!r}")

    def as_config(self) -> dict[str, BadGradientAt]:
        """The `train_loop_config` entry that sets this fault."""
        return {BAD_GRADIENT_AT_KEY: self}

    def arm(self, rank: int, params: Callable[[], list[Any]]) -> None:
        """On rank `rank` (the first time only): corrupt the parameter's gradients from now on."""
        if rank != self.rank or not _first_time(self.marker_file):
            return
        fired = [False]

        def corrupt(grad: Any) -> Any:
            if fired[0] and not self.persistent:
                return grad
            fired[0] = True
            return _flipped_copy(grad, element=self.element, bit=self.bit)

        params()[self.param].register_hook(corrupt)


def _flipped_copy(grad: Any, *, element: int, bit: int) -> Any:
    """A gradient hook's corrupt result: a copy of `grad` with bit `bit` of element `element` flipped."""
    bad = grad.clone()
    _flip(local_data(bad), element, bit)
    return bad


@dataclass(frozen=True)
class BitFlipRequests:
    """Flip a bit when asked: the file `directory`/pid-<this worker's pid> holds a seed (written
    by chaos's bitflip injector); the worker renames it to claim it, flips one bit the seed picks
    (a parameter with elements, an element, a bit of SILENT_BITS below its element size), and
    writes what it flipped to pid-<pid>.done. A request that reads `gradient SEED` (chaos's
    bad_gradient injector) flips that bit in the parameter's gradient instead, in every backward
    of this generation from now on (BadGradientAt, persistent): a compute fault."""

    directory: str

    def as_config(self) -> dict[str, BitFlipRequests]:
        return {BITFLIP_REQUESTS_KEY: self}

    def serve(self, step: int, rank: int, params: Callable[[], list[Any]]) -> None:
        import json
        import random
        path = os.path.join(self.directory, f"pid-{os.getpid()}")
        if not os.path.exists(path):
            return
        claimed = path + ".claimed"
        try:
            os.rename(path, claimed)
        except FileNotFoundError:
            return
        with open(claimed) as f:
            kind, _, seed = f.read().strip().rpartition(" ")
        rng = random.Random(seed)
        tensors = params()
        held = [(i, local) for i, t in enumerate(tensors) if (local := local_data(t)).numel()
                and (kind != GRADIENT_REQUEST or t.requires_grad)]
        index, local = rng.choice(held)
        element = rng.randrange(local.numel())
        bit = rng.choice([b for b in SILENT_BITS if b < 8 * local.element_size()])
        if kind == GRADIENT_REQUEST:
            tensors[index].register_hook(functools.partial(_flipped_copy, element=element, bit=bit))
        else:
            _flip(local, element, bit)
        with open(path + ".done", "w") as f:
            json.dump({"step": step, "rank": rank, "kind": kind or "bitflip", "param": index, "element": element,
                       "bit": bit}, f)
        os.remove(claimed)


def _entry(loop_config: Mapping, key: str, kind: type, usage: str) -> Any:
    """The loop config's fault-gate entry `key`, of type `kind` (None when absent)."""
    entry = loop_config.get(key)
    if entry is not None and not isinstance(entry, kind):
        raise ConfigError(f"train_loop_config[{key!r}] must be an elastic._worker.fault_gate.{kind.__name__} "
                          f"({usage}), got {type(entry).__name__}")
    return entry


def hold_after(step: int, loop_config: Any, settle: Callable[[], None] | None = None,
               params: Callable[[], list[Any]] | None = None) -> None:
    """At the boundary after step `step`: wait if the driver's loop config holds the run there,
    after `settle()` (which hands the step's record over for the controller); or stop moving
    there on the rank a StuckAt names; or flip a bit of the parameters (`params()`) on the rank a
    BitFlipAt names, or on request (BitFlipRequests); or corrupt the gradients of the rank a
    BadGradientAt names."""
    if not isinstance(loop_config, Mapping):
        return
    # The rank, as the framework set it for this generation (torchrun's variable).
    rank = int(os.environ.get("RANK", "-1"))
    flip = _entry(loop_config, BITFLIP_AT_KEY, BitFlipAt, "BitFlipAt(step, rank, marker_file).as_config()")
    if flip is not None and step == flip.step and params is not None:
        flip.flip(rank, params)
    bad = _entry(loop_config, BAD_GRADIENT_AT_KEY, BadGradientAt, "BadGradientAt(step, rank, marker_file).as_config()")
    if bad is not None and step == bad.step and params is not None:
        bad.arm(rank, params)
    requests = _entry(loop_config, BITFLIP_REQUESTS_KEY, BitFlipRequests, "BitFlipRequests(directory).as_config()")
    if requests is not None and params is not None:
        requests.serve(step, rank, params)
    stuck = _entry(loop_config, STUCK_AT_KEY, StuckAt, "StuckAt(step, rank, marker_file).as_config()")
    if stuck is not None and step == stuck.step:
        stuck.stick(rank)
    hold = _entry(loop_config, HOLD_AT_KEY, HoldAt, "HoldAt(step, release_file).as_config()")
    if hold is not None and step == hold.step:
        if settle is not None:
            settle()
        thread_position.mark(ThreadPlace.HELD)
        hold.wait()

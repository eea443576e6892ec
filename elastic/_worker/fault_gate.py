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
elastic._worker.step_boundary) before the ranks wait: that step only, the others keep the
boundary's pace.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic.errors import ConfigError, ElasticError

HOLD_AT_KEY = "elastic_hold_at"
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


def hold_after(step: int, loop_config: Any, settle: Callable[[], None] | None = None) -> None:
    """At the boundary after step `step`: wait if the driver's loop config holds the run there,
    after `settle()` (which hands the step's record over for the controller)."""
    hold = loop_config.get(HOLD_AT_KEY) if isinstance(loop_config, Mapping) else None
    if hold is None:
        return
    if not isinstance(hold, HoldAt):
        raise ConfigError(f"train_loop_config[{HOLD_AT_KEY!r}] must be an elastic._worker.fault_gate.HoldAt "
                          f"(HoldAt(step, release_file).as_config()), got {type(hold).__name__}")
    if step == hold.step:
        if settle is not None:
            settle()
        hold.wait()

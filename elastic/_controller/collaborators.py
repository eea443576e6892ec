"""The controller's view of its collaborators, as Protocols.

Each is met by the real class and by the unit tests' fake; tests/unit/protocol_checks.py has the
type checker (`make lint`) hold both to it, so a fake cannot drift from what it stands in for.
"""
from __future__ import annotations

from typing import Protocol

from elastic._controller.slot_table import WorkerView
from elastic._controller.worker_group import PollTerms
from elastic._protocol import GenerationPlan


class WorkerGroup(Protocol):
    """The workers (worker_group.RayWorkerGroup; fakes.FakeGroup)."""

    def scale_to(self, n: int) -> None: ...
    def avoid_nodes(self, node_ids: tuple[str, ...]) -> None:
        """Place no new worker on these nodes (bad_nodes.BadNodes)."""
    def tick(self, terms: PollTerms | None = None) -> dict[int, WorkerView]: ...
    def wait(self, timeout_s: float) -> None: ...
    def rendezvous_address(self, wid: int) -> tuple[str, int]: ...
    def start_generation(self, plans: dict[int, GenerationPlan]) -> None: ...
    def request_stop(self, wids: list[int], generation: int, cut_group: bool = False) -> None: ...
    def request_preemption(self, wids: list[int]) -> None: ...
    def kill(self, wid: int, reason: str) -> None: ...
    def shutdown(self, graceful: bool = True) -> None: ...
    @property
    def next_wid(self) -> int:
        """The id the next worker slot gets (the controller's journal keeps it)."""
    def bury(self, wid: int, reason: str) -> None:
        """A replacing controller's: a worker the lost one had, found gone (a dead slot)."""
    def node_copies(self) -> list[tuple[str, int, int, int, int]]:
        """(keeper, generation, world size, rank, step) of every copy of the state the nodes'
        keepers hold (elastic._node_keeper), for a group whose members lost theirs."""


class CheckpointView(Protocol):
    """The committed checkpoints and the fence (actor.CheckpointView; fakes.FakeCheckpoints)."""

    def latest_step(self) -> int | None: ...
    def committed_steps(self) -> list[int]: ...
    def fence(self, generation: int, start_step: int | None = None) -> None: ...
    def committed_since(self, step: int | None) -> list[int]: ...
    def current_fence(self) -> int | None: ...
    def stop_request(self) -> dict | None:
        """The STOP request (`elastic stop`) as last read, or None: a plain value, read from storage on
        another thread (the controller asks at every running tick and must not wait on storage)."""


class LeaseHold(Protocol):
    """The run's hold on its storage (checkpointing.LeaseKeeper; the unit tests' fakes)."""

    def lost(self) -> Exception | None:
        """Why the run no longer holds its storage, or None while it does: a plain value (the
        lease is renewed on another thread), asked at every tick."""

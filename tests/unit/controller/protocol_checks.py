"""The controller's Protocols, held to both their real classes and the unit tests' fakes.

Nothing here runs: the type checker (`make lint`, mypy) reads the assignments below and fails
when a class no longer matches the Protocol it stands for. A fake that drifts from the real
class (a parameter the controller passes and the fake lacks, or the reverse) fails here instead
of keeping every test green. Not a test module: pytest does not collect it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fakes import FakeCheckpoints, FakeGroup, FakeLease, FakeRecorder

    from checkpointing.lease import LeaseKeeper
    from elastic._controller.actor import CheckpointView as RealCheckpoints
    from elastic._controller.collaborators import CheckpointView, LeaseHold, WorkerGroup
    from elastic._controller.run_record import RunRecord, RunRecorder
    from elastic._controller.worker_group import RayWorkerGroup


def _fakes(group: FakeGroup, recorder: FakeRecorder, checkpoints: FakeCheckpoints, lease: FakeLease) -> None:
    _group: WorkerGroup = group
    _recorder: RunRecord = recorder
    _checkpoints: CheckpointView = checkpoints
    _lease: LeaseHold = lease


def _real(group: RayWorkerGroup, recorder: RunRecorder, checkpoints: RealCheckpoints, lease: LeaseKeeper) -> None:
    _group: WorkerGroup = group
    _recorder: RunRecord = recorder
    _checkpoints: CheckpointView = checkpoints
    _lease: LeaseHold = lease

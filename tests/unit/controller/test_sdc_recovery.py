"""The controller's side of silent data corruption: the fault the ranks' SilentCorruptionError
makes (the ranks a majority named are replaced, mere suspects are not; the failure names the
step), and the re-formed group's restore, which never takes the survivors' live state and only a
copy in memory from before the step."""
from __future__ import annotations

import time

import pytest
from fakes import NoNodeCopies

from elastic._controller.forming import GenerationFormer
from elastic._controller.running import reported_fault
from elastic._protocol import ReplicaHeld, RestoreKind, WorkerPhase, WorkerReport
from elastic.config import FailureConfig
from elastic.errors import SilentCorruptionError
from elastic.policies import Cause

pytestmark = pytest.mark.timeout(30)


def _failed(rank: int, error: SilentCorruptionError) -> WorkerReport:
    return WorkerReport(phase=WorkerPhase.FAILED, generation=0, rank=rank, step=24, has_state=True, records=[],
                        error_type=type(error).__name__, error_message=str(error), error_kind="sdc", error=error)


def test_the_named_ranks_are_replaced_and_suspects_stay():
    members = [10, 11, 12]
    named = SilentCorruptionError("at step 24", step=24, ranks=(1,))
    fault = reported_fault({r: _failed(r, named) for r in range(3)}, members)
    assert fault.failure.cause == Cause.SDC and fault.failure.ranks == (1,) and fault.failure.step == 24
    assert fault.lost == [11]
    suspects = SilentCorruptionError("at step 24", step=24, suspects=(0, 1))
    fault = reported_fault({0: _failed(0, suspects)}, members[:2])
    assert fault.failure.ranks == (0, 1) and fault.lost == [] and fault.failure.step == 24


class _Checkpoints:
    def __init__(self, latest: int | None):
        self.latest = latest

    def fence(self, generation: int, start_step: int | None = None) -> None:
        pass

    def latest_step(self) -> int | None:
        return self.latest


def _former(latest: int | None) -> GenerationFormer:
    return GenerationFormer(NoNodeCopies(), _Checkpoints(latest),  # type: ignore[arg-type]
                            lambda what, call: (True, call()), failure=FailureConfig(), clock=time.monotonic)


def _survivor(step: int, copy_step: int) -> WorkerReport:
    return WorkerReport(phase=WorkerPhase.FAILED, generation=0, rank=0, step=step, has_state=True, records=[],
                        replicas=ReplicaHeld(generation=0, world_size=1, step=copy_step, ranks=(0,)))


def test_the_rollback_takes_a_copy_from_before_the_step_never_the_live_state():
    settled = {10: _survivor(24, 20), 12: _survivor(24, 20)}
    ok, plan = _former(16).reform_plan([10, 12, 13], settled)
    assert ok and plan is not None and plan.kind == RestoreKind.BROADCAST and plan.step == 24   # no corruption
    ok, plan = _former(16).reform_plan([10, 12, 13], settled, before=24)
    assert ok and plan is not None and plan.kind == RestoreKind.MEMORY and plan.step == 20
    # A newer checkpoint wins over the copy (it was committed from a step whose replicas agreed).
    ok, plan = _former(22).reform_plan([10, 12, 13], settled, before=24)
    assert plan is not None and plan.kind == RestoreKind.CHECKPOINT and plan.step == 22
    # Copies of the corrupt step itself are not taken.
    settled = {10: _survivor(24, 24), 12: _survivor(24, 24)}
    ok, plan = _former(16).reform_plan([10, 12, 13], settled, before=24)
    assert plan is not None and plan.kind == RestoreKind.CHECKPOINT and plan.step == 16
    assert "not from before step 24" in plan.reason


def test_a_node_is_marked_bad_at_its_second_verdict_and_new_placements_exclude_it(monkeypatch):
    from elastic._controller import placement
    from elastic._controller.bad_nodes import BadNodes
    nodes = BadNodes()
    assert not nodes.flag("n1", "step 4") and nodes.bad == ()
    assert not nodes.flag("n2", "step 6")
    assert nodes.flag("n1", "step 9") and nodes.bad == ("n1",)
    assert not nodes.flag("n1", "step 12") and nodes.bad == ("n1",)     # marked once
    asked = []
    monkeypatch.setattr(placement, "placement_group", lambda bundles, **kw: asked.append((bundles, kw)))
    places = placement.Placements.__new__(placement.Placements)
    places.bundle, places.avoid, places._names = {"CPU": 1.0}, (), None
    places._placement_group(2, "STRICT_PACK")
    places.avoid = ("n1", "n3")
    places._placement_group(2, "STRICT_PACK")
    assert "bundle_label_selector" not in asked[0][1]
    assert asked[1][1]["bundle_label_selector"] == [{"ray.io/node-id": "!in(n1,n3)"}] * 2

"""The nodes' keepers (elastic._node_keeper): copies held outside the workers, by (generation,
world, rank), the newest step of each, two generations kept; the controller's plan from them when
no member holds a copy (every worker lost at once), and only then."""
from __future__ import annotations

import time

import pytest

from elastic._controller.forming import GenerationFormer, keeper_source
from elastic._node_keeper import NodeKeeper
from elastic._protocol import ReplicaHeld, RestoreKind, WorkerPhase, WorkerReport
from elastic.config import FailureConfig

pytestmark = pytest.mark.timeout(30)


def test_a_keeper_holds_the_newest_step_of_each_rank_of_its_two_newest_generations():
    keeper = NodeKeeper()
    keeper.hold(1, 2, 0, 10, {"w": 10})
    keeper.hold(1, 2, 0, 20, {"w": 20})
    keeper.hold(1, 2, 0, 15, {"w": 15})          # an older step, come late: not kept
    keeper.hold(1, 2, 1, 20, {"w": 21})
    assert sorted(keeper.held()) == [(1, 2, 0, 20), (1, 2, 1, 20)]
    assert keeper.copy(1, 2, 0, 20) == {"w": 20}
    with pytest.raises(LookupError, match="no copy of rank 0 of generation 1 .* at step 10"):
        keeper.copy(1, 2, 0, 10)
    keeper.hold(2, 3, 0, 30, {"w": 30})
    keeper.hold(3, 3, 0, 40, {"w": 40})          # generation 1 goes: two generations are kept
    assert sorted(keeper.held()) == [(2, 3, 0, 30), (3, 3, 0, 40)]


def test_the_plan_takes_the_newest_complete_set_across_keepers():
    copies = [("k.a", 4, 3, 0, 20), ("k.a", 4, 3, 1, 20), ("k.b", 4, 3, 2, 20),
              ("k.a", 4, 3, 0, 30), ("k.b", 4, 3, 2, 30)]      # step 30 lacks rank 1
    plan = keeper_source(copies, world=2, unit=1)
    assert not isinstance(plan, str)
    assert plan.kind == RestoreKind.MEMORY and plan.step == 20 and plan.replica is not None
    assert plan.replica.keepers == ("k.a", "k.a", "k.b") and plan.replica.holders == (0, 1, 0)
    assert (plan.replica.generation, plan.replica.world_size) == (4, 3) and "no storage read" in plan.reason
    assert keeper_source(copies[3:], world=2, unit=1) == "no node keeper holds a copy of every rank"
    assert keeper_source([], world=2, unit=1) == "no node keeper holds a copy"
    # Under TP (units of 2) old rank j goes to a new rank at the same place in its replica.
    tp = [("k", 1, 4, r, 10) for r in range(4)]
    plan = keeper_source(tp, world=2, unit=2)
    assert not isinstance(plan, str) and plan.replica is not None and plan.replica.holders == (0, 1, 0, 1)


class _Group:
    def __init__(self, kept):
        self.kept = kept

    def node_copies(self):
        return self.kept


class _Checkpoints:
    def __init__(self, latest):
        self.latest = latest

    def fence(self, generation, start_step=None):
        pass

    def latest_step(self):
        return self.latest


def _former(kept, latest=None) -> GenerationFormer:
    return GenerationFormer(_Group(kept), _Checkpoints(latest),  # type: ignore[arg-type]
                            lambda what, call: (True, call()), failure=FailureConfig(), clock=time.monotonic)


def test_every_worker_lost_restores_from_the_keepers_not_the_checkpoint():
    kept = [("k.node1", 3, 1, 0, 20)]            # DDP: one copy, of the one place of a replica
    fresh = {w: WorkerReport(phase=WorkerPhase.IDLE, generation=0, rank=None, step=0, has_state=False, records=[])
             for w in (7, 8)}
    ok, plan = _former(kept, latest=10).reform_plan([7, 8], fresh)
    assert ok and plan is not None and plan.kind == RestoreKind.MEMORY and plan.step == 20
    assert plan.replica is not None and plan.replica.keepers == ("k.node1",) and plan.replica.holders == (0,)
    # A checkpoint newer than the keepers' copies wins.
    ok, plan = _former(kept, latest=30).reform_plan([7, 8], fresh)
    assert plan is not None and plan.kind == RestoreKind.CHECKPOINT and plan.step == 30
    assert "no node keeper" not in plan.reason
    # Members holding copies of their own are preferred (their copies need no fetch).
    held = {7: WorkerReport(phase=WorkerPhase.FAILED, generation=3, rank=0, step=25, has_state=False, records=[],
                            replicas=ReplicaHeld(generation=3, world_size=1, step=20, ranks=(0,)))}
    ok, plan = _former(kept).reform_plan([7, 8], held)
    assert plan is not None and plan.kind == RestoreKind.MEMORY and plan.replica is not None
    assert plan.replica.keepers == ()
    # Nothing anywhere: the reason says so.
    ok, plan = _former([], latest=10).reform_plan([7, 8], fresh)
    assert plan is not None and plan.kind == RestoreKind.CHECKPOINT and "no node keeper holds a copy" in plan.reason

"""FSDP's copies in host memory (elastic._worker.replicas): the row arithmetic, the controller's
choice of holders and of the ring's step across nodes, and a real rebuild at 2 and 5 ranks (a lost
node, a growth) from copies taken at 4 on two nodes of two (gloo processes,
no Ray), equal to the state the copies were taken from."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from elastic._controller.forming import memory_source
from elastic._protocol import ReplicaHeld, RestoreKind, RestorePlan, WorkerInfo, WorkerPhase, WorkerReport, copy_shift
from elastic._worker.replicas import chunk_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "ckpt"))
from ckpt_ranks import run_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("rows", [0, 1, 5, 7, 37, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_rows_are_torch_chunk_pieces(rows, world):
    pieces = torch.arange(rows).chunk(world) if rows else ()
    for rank in range(world):
        start, end = chunk_rows(rows, world, rank)
        expected = pieces[rank].tolist() if rank < len(pieces) else []
        assert list(range(start, end)) == expected


def _report(replicas: ReplicaHeld | None) -> WorkerReport:
    return WorkerReport(phase=WorkerPhase.INTERRUPTED, generation=1, rank=0, step=9, has_state=False, records=[],
                        replicas=replicas)


def test_memory_source_reads_each_old_rank_from_its_own_copy_where_it_survives():
    # Generation 4 had 3 ranks; old rank 1 was lost. Worker 10 (old rank 0) holds 0 and 2, worker
    # 12 (old rank 2) holds 2 and 1; worker 13 is a spare.
    settled = {10: _report(ReplicaHeld(4, 3, 7, (0, 2))), 12: _report(ReplicaHeld(4, 3, 7, (2, 1))),
               13: _report(None)}
    plan = memory_source([10, 12, 13], settled)
    assert isinstance(plan, RestorePlan) and plan.kind == RestoreKind.MEMORY and plan.step == 7
    assert plan.replica is not None and plan.replica.holders == (0, 1, 1) and plan.replica.world_size == 3
    assert "no storage read" in plan.reason


def test_memory_source_refuses_when_two_neighbours_are_lost_or_the_steps_differ():
    lost_two = {10: _report(ReplicaHeld(4, 4, 7, (0, 3)))}          # ranks 1 and 2 gone with their holders
    why = memory_source([10], lost_two)
    assert isinstance(why, str) and "[1, 2]" in why
    # Old rank 1 died inside the swap of step 8: rank 2 never got its copy (it holds its own
    # only), and the pairs of step 7 were dropped for the swap. No step has every rank.
    torn = {10: _report(ReplicaHeld(4, 3, 8, (0, 2))), 12: _report(ReplicaHeld(4, 3, 8, (2,)))}
    assert isinstance(memory_source([10, 12], torn), str)
    assert memory_source([10], {10: _report(None)}) == "no member holds a copy of the state in memory"


def test_memory_source_takes_the_newest_step_every_rank_has():
    settled = {1: _report(ReplicaHeld(2, 2, 5, (0, 1))), 2: _report(ReplicaHeld(3, 2, 9, (1,)))}
    plan = memory_source([1, 2], settled)
    assert isinstance(plan, RestorePlan) and plan.step == 5 and plan.replica is not None
    assert plan.replica.generation == 2 and plan.replica.holders == (0, 0)


def _on(*nodes: str) -> list[WorkerInfo | None]:
    return [WorkerInfo(pid, node, f"actor{pid}", "ip") for pid, node in enumerate(nodes)]


def test_the_copies_ring_steps_over_each_node_so_no_copy_stays_on_its_ranks_node():
    # Ranks are placed node by node: a step of one keeps 0's copy at 1, on node a.
    assert copy_shift(_on("a", "a", "b", "b")) == 2
    assert copy_shift(_on("a", "a", "a", "b", "b", "b")) == 3
    assert copy_shift(_on("a", "b", "a", "b")) == 1            # interleaved: the next rank is elsewhere
    assert copy_shift(_on("a", "a", "a")) == 1                 # one node: nothing to gain
    assert copy_shift(_on("a")) == 1 and copy_shift([]) == 1
    # Uneven nodes: no step places every copy elsewhere; the one that places most (5 of 6) wins.
    assert copy_shift(_on("a", "a", "a", "a", "b", "b")) == 2
    # A member whose node is not known yet is a node of its own.
    assert copy_shift([None, None]) == 1
    # Under tensor parallelism (replicas of 2 ranks: one, then two per node) the step counts
    # replicas: a copy goes to the same TP rank of a replica on another node.
    assert copy_shift(_on("a", "a", "b", "b"), replica_size=2) == 1
    assert copy_shift(_on("a", "a", "a", "a", "b", "b", "b", "b"), replica_size=2) == 2
    assert copy_shift(_on("a", "a", "b"), replica_size=2) == 1   # not whole replicas: the plain ring


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """Four FSDP ranks on two nodes of two, three steps, a copy at each: the pairs each rank
    holds, on disk. The controller's step for the copies' ring is 2, so 0 -> 2, 1 -> 3, 2 -> 0,
    3 -> 1: each copy on the other node."""
    out = tmp_path_factory.mktemp("copies")
    shift = copy_shift(_on("a", "a", "b", "b"))
    before = run_ranks("replica_ranks:train_and_copy", 4, out=str(out), steps=3, shift=shift)
    assert [b["held"] for b in before] == [[1, 4, 3, [0, 2]], [1, 4, 3, [1, 3]], [1, 4, 3, [2, 0]], [1, 4, 3, [3, 1]]]
    return out, before


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "survivors"), [(2, [2, 3]), (5, [0, 1, 2, 3])],
                         ids=["lose_a_node_4_to_2", "grow_4_to_5"])
def test_a_group_rebuilds_its_shards_from_the_copies_at_another_world_size(copies, world, survivors):
    out, before = copies
    after = run_ranks("replica_ranks:rebuild", world, out=str(out), survivors=survivors)
    truth = before[0]["full"]
    for rank, result in enumerate(after):
        assert result["step"] == 3
        assert result["full"].keys() == truth.keys()
        for key, values in truth.items():
            assert result["full"][key] == values, f"rank {rank}: {key} differs after the rebuild"
    # A lost node: old ranks 0 and 1 went with their copies; the other node held them.
    expected = {2: [0, 1, 0, 1], 5: [0, 1, 2, 3]}[world]
    assert after[0]["holders"] == expected

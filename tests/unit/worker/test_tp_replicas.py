"""FSDP x TP's copies in host memory (elastic._worker.replicas on a 2-D mesh): the block arithmetic
of 2-D shards (pure, no process), and real copies taken by the StateKeeper of TP 2 x DP 2 gloo
ranks, swapped along the data-parallel dimension and rebuilt at another data-parallel degree,
equal to the state they were taken from."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, _StridedShard

from elastic._protocol import GenerationPlan, ReplicaSource, RestoreKind, RestorePlan, RunSpec
from elastic._worker.mesh import GenerationMesh
from elastic._worker.replicas import Assembly, Box, ShardPiece, shard_box
from elastic._worker.restore import Restorer
from elastic._worker.state import WorkerState
from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
from elastic.errors import StateError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "ckpt"))
from ckpt_ranks import run_ranks

pytestmark = pytest.mark.timeout(300)

T = 2
SHAPE = (7, 6)
# FSDP x TP's layouts on the (dp_shard, tp) mesh: a row-wise TP weight, a column-wise one (FSDP2
# shards the TP shard again on dim 0: _StridedShard), a row-wise bias (replicated over tp).
LAYOUTS = {"shard0_shard1": (Shard(0), Shard(1)), "strided_colwise": (_StridedShard(0, split_factor=T), Shard(0)),
           "shard0_replicate": (Shard(0), Replicate())}
# How the data is cut, stated apart from the placements: (mesh dim, tensor dim) in the order the
# cuts are made. The column-wise weight is TP's shard first, then FSDP2's torch.chunk of it (which
# differs from torch's own reading of _StridedShard where 7 rows split unevenly over TP 2).
CUTS = {"shard0_shard1": [(0, 0), (1, 1)], "strided_colwise": [(1, 0), (0, 0)], "shard0_replicate": [(0, 0)]}


def _local(full: torch.Tensor, coordinate: tuple[int, ...], mesh_shape: tuple[int, ...], layout: str) -> torch.Tensor:
    """The shard of the rank at `coordinate`, cut as FSDP2 and TP cut it (torch.chunk pieces, the
    missing last ones empty): the truth the boxes are checked against."""
    local = full
    for mesh_dim, dim in CUTS[layout]:
        chunks = local.chunk(mesh_shape[mesh_dim], dim=dim)
        at = coordinate[mesh_dim]
        local = chunks[at] if at < len(chunks) else local.narrow(dim, local.shape[dim], 0)
    return local


def _pieces(full: torch.Tensor, dp: int, layout: str) -> dict[tuple[int, int], ShardPiece]:
    """Every rank's copy of `full` at a (dp, T) mesh, as to_host takes it."""
    pieces = {}
    for d in range(dp):
        for t in range(T):
            box = shard_box(SHAPE, (dp, T), (d, t), LAYOUTS[layout])
            local = _local(full, (d, t), (dp, T), layout)
            assert box.size == tuple(local.shape), (layout, d, t)
            assert torch.equal(full[box.within(Box((0, 0), SHAPE))], local), f"{layout} ({d}, {t}): not the shard"
            pieces[(d, t)] = ShardPiece(local.clone(), box.offset, SHAPE)
    return pieces


def test_boxes_meet_in_every_dimension():
    a = Box((0, 3), (4, 3))
    assert a.meet(Box((2, 0), (5, 4))) == Box((2, 3), (2, 1))
    assert a.meet(Box((4, 0), (3, 6))) is None          # touching rows share nothing
    assert a.meet(Box((0, 0), (4, 3))) is None          # nor touching columns
    assert Box((2, 3), (2, 1)).within(a) == (slice(2, 4), slice(0, 1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("new_dp", [1, 2, 3, 4], ids=lambda d: f"dp_3_to_{d}")
def test_2d_pieces_rebuild_at_another_data_parallel_degree(layout, new_dp):
    placements = LAYOUTS[layout]
    full = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).view(SHAPE)
    old = _pieces(full, 3, layout)
    for d in range(new_dp):
        for t in range(T):
            box = shard_box(SHAPE, (new_dp, T), (d, t), placements)
            shard = Assembly(box, torch.float32, torch.device("cpu"))
            for old_d in range(3):               # the copies of the same TP rank (its data-parallel group)
                shard.add(old[(old_d, t)])
            assert shard.complete, (d, t)
            assert torch.equal(shard.result(), _local(full, (d, t), (new_dp, T), layout)), (d, t)


def test_a_shard_misses_the_blocks_of_a_lost_copy():
    full = torch.arange(42, dtype=torch.float32).view(SHAPE)
    old = _pieces(full, 3, "shard0_shard1")
    shard = Assembly(shard_box(SHAPE, (2, T), (0, 1), LAYOUTS["shard0_shard1"]), torch.float32, torch.device("cpu"))
    shard.add(old[(0, 1)])       # rows 0-2; the rows 3 of old DP rank 1 are missing
    assert not shard.complete
    shard.add(old[(1, 1)])
    assert shard.complete


def test_layouts_whose_shard_is_not_one_block_are_refused():
    # Strided pieces that interleave (no mesh dim to its right cuts dim 0): rank 0 of 2 holds rows 0 and 2 of 4.
    with pytest.raises(StateError, match=r"_StridedShard\(dim=0, sf=2\).*in_memory_every_n_steps=None"):
        shard_box((4, 3), (2,), (0,), (_StridedShard(0, split_factor=2),))
    with pytest.raises(StateError, match=r"Partial.*in_memory_every_n_steps=None"):
        shard_box((4, 3), (2, 2), (0, 1), (Shard(0), Partial()))


def test_a_memory_restore_refuses_holders_at_another_tp_rank():
    # Old rank 1's copy (TP rank 1) held by new rank 0 (TP rank 0): its data-parallel group never
    # sees it. Every rank refuses before any broadcast (no process group needed to say so).
    spec = RunSpec(user_code=b"", total_steps=10, seed=0,
                   scaling=ScalingConfig(strategy="fsdp", min_workers=4, tensor_parallel_size=T),
                   checkpoint=CheckpointConfig(storage="memory://unused", in_memory_every_n_steps=1),
                   failure=FailureConfig())
    assert spec.in_memory_every == 1
    source = ReplicaSource(generation=1, world_size=4, holders=(0, 0, 2, 3))
    plan = GenerationPlan(generation=2, rank=0, world_size=4, master_addr="127.0.0.1", master_port=0,
                          restore=RestorePlan(RestoreKind.MEMORY, step=3, replica=source), timeout_s=60.0)
    mesh = GenerationMesh(rank=0, world_size=4, scaling=spec.scaling, device=torch.device("cpu"))
    restorer = Restorer(plan=plan, spec=spec, worker=WorkerState(), mesh=mesh, comm_device=torch.device("cpu"))
    with pytest.raises(StateError, match=r"\(old rank, holder\) \[\(1, 0\)\].*place of the copies it holds"):
        restorer._memory(None, source, 3)     # type: ignore[arg-type]  # refused before the state is read


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """TP 2 x DP 2 FSDP ranks, three steps, a copy at each (the StateKeeper's): the pairs each
    rank holds, on disk."""
    out = tmp_path_factory.mktemp("tp_copies")
    before = run_ranks("tp_replica_ranks:train_and_copy", 4, timeout=240, out=str(out), steps=3)
    return out, before


@pytest.mark.multiprocess
def test_each_rank_holds_its_own_copy_and_its_left_data_parallel_neighbours(copies):
    _, before = copies
    # Rank r keeps r - T's copy: the same TP rank in the other replica.
    assert [b["held"] for b in before] == [[1, 4, 3, [0, 2]], [1, 4, 3, [1, 3]], [1, 4, 3, [2, 0]],
                                           [1, 4, 3, [3, 1]]]
    for rank, result in enumerate(before):
        assert result["step"] == 3
        assert result["digests"][1] == before[(rank - T) % 4]["digests"][0], f"rank {rank} holds another copy"
        assert result["two_d_offsets"], "the copies hold no 2-D block"
    assert len({b["digests"][0] for b in before}) == 4      # four different shards


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "survivors", "holders"),
                         [(2, [2, 3], [0, 1, 0, 1]), (4, [0, 3, 2], [0, 1, 2, 1]), (6, [2, 3, 0, 1], [2, 3, 0, 1])],
                         ids=["dp_2_to_1_replica_0_lost", "dp_2_rank_1_lost", "dp_2_to_3"])
def test_a_tp_group_rebuilds_its_2d_shards_from_the_copies(copies, world, survivors, holders):
    out, before = copies
    after = run_ranks("tp_replica_ranks:rebuild", world, timeout=240, out=str(out), survivors=survivors)
    truth = before[0]["full"]
    assert truth.keys() == before[1]["full"].keys() and any(".exp_avg" in k for k in truth)
    for rank, result in enumerate(after):
        assert result["dp_size"] == world // T and result["step"] == 3
        # A lost rank's copy is read from its right data-parallel neighbour, at its own TP rank.
        assert result["holders"] == holders
        assert result["full"].keys() == truth.keys()
        for key, values in truth.items():
            assert result["full"][key] == values, f"rank {rank}: {key} differs after the rebuild"

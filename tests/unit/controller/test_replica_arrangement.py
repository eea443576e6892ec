"""Groups of whole replicas under tensor parallelism (elastic._controller.replica_arrangement):
sizes in multiples of T, survivors at the TP rank of the shard they hold, warm sources for every
TP rank or the reason there are none; and the sizes the controller's parts derive from it."""
from __future__ import annotations

import time

import pytest
from fakes import NoNodeCopies

from elastic._controller.forming import GenerationFormer
from elastic._controller.replica_arrangement import arrange, warm_sources, whole_replicas
from elastic._controller.slots import Slots
from elastic._protocol import ReplicaHeld, RestoreKind, WorkerPhase, WorkerReport
from elastic.config import FailureConfig, ScalingConfig
from elastic.errors import ConfigError
from elastic.layout import Layout


def _held(step: int, tp_rank: int | None, tp: int = 2, rank: int | None = None) -> WorkerReport:
    """A survivor's report: the state of `step` of TP rank `tp_rank` (None: nothing in memory), as
    rank `rank` of generation 1 (None: out of the group)."""
    return WorkerReport(phase=WorkerPhase.INTERRUPTED, generation=1, rank=rank, step=step,
                        has_state=tp_rank is not None, records=[],
                        shard=(tp_rank, tp) if tp_rank is not None else (0, 1))


def test_whole_replicas_and_the_layout_of_a_world():
    assert [whole_replicas(n, 2) for n in range(7)] == [0, 0, 2, 2, 4, 4, 6]
    assert whole_replicas(5, 1) == 5
    assert Layout.of(6, 2).to_dict() == {"dp": 3, "tp": 2, "pp": 1}
    assert [(Layout.of(6, 2).dp_rank(r), Layout.of(6, 2).tp_rank(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(ConfigError, match="does not split into replicas"):
        Layout.of(5, 2)


def test_a_lost_rank_takes_its_replica_out_and_its_peer_waits_outside():
    """TP 2 x DP 3; rank 3 (replica 1, TP rank 1) is lost: five survivors, a group of four. Worker
    ids are the old ranks. The peer of the lost rank (2) stays out; each survivor keeps its TP rank."""
    settled = {w: _held(30, w % 2, rank=w) for w in (0, 1, 2, 4, 5)}
    members = arrange([0, 1, 2, 4, 5], settled, 2, limit=6)
    assert members == [0, 1, 4, 5]          # the two whole replicas, each still together
    warm = warm_sources(members, settled, 2)
    assert warm == (30, (0, 1, 2, 3))


def test_a_replacement_completes_a_replica_with_the_waiting_peer():
    """Growing back: the four members at step 40, the waiting peer (step 30, shard 0) and a new
    worker (no state): the peer keeps TP rank 0, the new worker takes TP rank 1, both receive."""
    settled = {0: _held(40, 0), 1: _held(40, 1), 4: _held(40, 0), 5: _held(40, 1), 2: _held(30, 0), 9: _held(0, None)}
    members = arrange([0, 1, 4, 5, 2, 9], settled, 2, limit=6)
    assert members[4:] == [2, 9]
    step, sources = warm_sources(members, settled, 2)      # type: ignore[misc]
    assert step == 40 and sources == (0, 1, 2, 3)           # the peer is a step behind: it receives


def test_survivors_holding_the_wrong_shard_are_moved_to_it_or_named_as_the_reason():
    # Both survivors hold shard 0: no member holds shard 1, so no warm restore (the checkpoint).
    settled = {7: _held(12, 0), 8: _held(12, 0), 9: _held(0, None), 10: _held(0, None)}
    members = arrange([7, 8, 9, 10], settled, 2, limit=4)
    assert [members[0], members[2]] == [7, 8]               # each at TP rank 0
    reason = warm_sources(members, settled, 2)
    assert isinstance(reason, str) and "position(s) [1] of a unit" in reason
    former = GenerationFormer(NoNodeCopies(), _NoCheckpoints(), lambda what, fn: (True, fn()),  # type: ignore[arg-type]
                              failure=FailureConfig(), clock=time.monotonic, unit=2)
    ok, plan = former.reform_plan(members, settled)
    assert ok and plan is not None and plan.kind == RestoreKind.FRESH and "position(s) [1] of a unit" in plan.reason


def test_without_tensor_parallelism_the_order_is_the_candidates_own():
    settled = {w: _held(5, 0, tp=1) for w in range(5)}
    assert arrange([3, 1, 4, 0, 2], settled, 1, limit=4) == [3, 1, 4, 0]


def test_members_of_one_node_form_a_replica_where_the_workers_allow_it():
    settled = {w: _held(0, None) for w in range(4)}
    node_of = {0: "a", 1: "b", 2: "a", 3: "b"}
    members = arrange([0, 1, 2, 3], settled, 2, limit=4, node_of=node_of)
    assert {node_of[w] for w in members[:2]} == {"a"} and {node_of[w] for w in members[2:]} == {"b"}


def test_the_cap_of_a_group_is_whole_replicas():
    slots = Slots(ScalingConfig(min_workers=4, max_workers=6, tensor_parallel_size=2))
    assert slots.cap(list(range(7))) == list(range(6))
    assert slots.cap(list(range(5))) == list(range(4))
    assert slots.cap(list(range(6)), limit=5) == list(range(4))


class _NoCheckpoints:
    def fence(self, generation: int, start_step: int | None = None) -> None:
        pass

    def latest_step(self) -> int | None:
        return None


def test_holders_of_fsdp_copies_are_placed_at_the_tp_rank_of_their_copies():
    """FSDP x TP, TP 2 x DP 3, old rank 3 lost: each survivor holds its own copy and its left DP
    neighbour's (r - 2); whole replicas stay, and the lost rank's peer (2) waits outside."""
    def copies(rank: int) -> WorkerReport:
        return WorkerReport(phase=WorkerPhase.INTERRUPTED, generation=1, rank=rank, step=20, has_state=False,
                            records=[], replicas=ReplicaHeld(generation=1, world_size=6, step=20,
                                                             ranks=(rank, (rank - 2) % 6)))
    settled = {w: copies(w) for w in (0, 1, 2, 4, 5)}
    members = arrange([2, 0, 1, 4, 5], settled, 2, limit=4)
    assert members == [0, 1, 4, 5]
    assert all(settled[w].replicas.ranks[0] % 2 == rank % 2 for rank, w in enumerate(members))  # type: ignore[union-attr]


def test_a_tp_recovery_replaces_its_lost_rank_after_the_re_form_unless_min_workers_needs_it():
    from elastic._controller.slot_table import DEAD, READY, WorkerView
    views = {w: WorkerView(wid=w, status=DEAD if w == 3 else READY) for w in range(6)}
    tp = Slots(ScalingConfig(min_workers=4, max_workers=6, tensor_parallel_size=2))
    assert tp.target(views, broken_world=6) == 5          # the five alive: no replacement yet
    assert tp.target(views) == 6                          # once the group steps again: max_workers
    assert Slots(ScalingConfig(min_workers=4, max_workers=6)).target(views, broken_world=6) == 6   # DDP: at once
    short = {w: WorkerView(wid=w, status=DEAD if w >= 1 else READY) for w in range(6)}
    assert tp.target(short, broken_world=6) == 4          # below min_workers: replaced at once


def test_replacements_complete_the_replicas_of_the_peers_they_were_placed_beside():
    """TP 2 x DP 3, a replica per node: replica 1 (node b) lost its TP rank 1 and replica 2 (node
    c) its TP rank 0; each replacement was placed in its lost rank's bundle, on its peer's node
    (placement). The peers keep their TP ranks, and each completes a replica with the replacement
    beside it, not with the other node's peer."""
    settled = {0: _held(40, 0, rank=0), 1: _held(40, 1, rank=1), 2: _held(40, 0, rank=2), 5: _held(40, 1, rank=5),
               6: _held(0, None), 7: _held(0, None)}
    node_of = {0: "a", 1: "a", 2: "b", 5: "c", 6: "c", 7: "b"}
    members = arrange([0, 1, 2, 5, 6, 7], settled, 2, limit=6, node_of=node_of)
    assert members[:2] == [0, 1]
    assert sorted(members[2:4]) == [2, 7] and sorted(members[4:]) == [5, 6]
    assert members.index(2) % 2 == 0 and members.index(5) % 2 == 1        # at the TP rank of their shard
    assert all(len({node_of[w] for w in members[r:r + 2]}) == 1 for r in (0, 2, 4))


def test_a_replacement_joins_its_waiting_peer_before_a_spare_elsewhere():
    """The peer holds no state (nothing to place it by) and a spare on another node was ready
    first: the replacement on the peer's node still completes the peer's replica."""
    settled = {0: _held(40, 0, rank=0), 1: _held(40, 1, rank=1), 2: _held(0, None), 4: _held(0, None),
               9: _held(0, None)}
    node_of = {0: "a", 1: "a", 2: "b", 4: "c", 9: "b"}
    assert arrange([0, 1, 2, 4, 9], settled, 2, limit=4, node_of=node_of) == [0, 1, 2, 9]
    # A replica begun by a holder claims its node's worker even where another node's comes first.
    settled[2] = _held(30, 1, rank=3)
    assert arrange([0, 1, 2, 4, 9], settled, 2, limit=4, node_of=node_of) == [0, 1, 9, 2]


def test_hsdp_groups_are_whole_shard_groups_and_each_position_needs_a_source():
    """HSDP, S = 2 x T = 2 (unit 4), three shard groups, old rank 5 (group 1, position 1) lost: the
    whole groups 0 and 2 form the group; group 1's survivors wait outside. A plan whose unit
    position has no survivor holding it is refused with the position named."""
    scaling = ScalingConfig(strategy="hsdp", hsdp_shard_size=2, tensor_parallel_size=2, min_workers=4,
                            max_workers=12)
    unit = scaling.unit_size
    assert unit == 4
    settled = {w: _held(30, w % unit, tp=unit, rank=w) for w in range(12) if w != 5}
    members = Slots(scaling).cap([w for w in range(12) if w != 5], settled=settled)
    assert members == [0, 1, 2, 3, 8, 9, 10, 11]
    warm = warm_sources(members, settled, unit)
    assert warm == (30, tuple(range(8)))
    # Survivors of group 1 rejoin at their own positions beside a replacement (worker 20).
    settled[20] = _held(0, None)
    members = arrange([4, 6, 7, 20], settled, unit, limit=4)
    assert [members.index(w) for w in (4, 6, 7)] == [0, 2, 3] and members[1] == 20
    # Position 1 has no holder: no warm restore, and the reason names it.
    reason = warm_sources(members, settled, unit)
    assert isinstance(reason, str) and "[1]" in reason and "unit of 4" in reason
    assert whole_replicas(11, unit) == 8


def test_hsdp_resizes_by_shard_groups():
    from elastic._controller.slot_table import DEAD, READY, WorkerView
    scaling = ScalingConfig(strategy="hsdp", hsdp_shard_size=2, min_workers=2, max_workers=6)
    slots = Slots(scaling)
    assert slots.cap(list(range(7))) == list(range(6))
    assert slots.cap(list(range(5))) == list(range(4))
    views = {w: WorkerView(wid=w, status=DEAD if w == 3 else READY) for w in range(6)}
    assert slots.target(views, broken_world=6) == 5       # as under TP: the lost unit regrows after the re-form

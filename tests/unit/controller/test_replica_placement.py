"""A TP group lives on one node (elastic._controller.placement): under tensor parallelism one
placement group of T bundles, STRICT_PACK, per replica, a slot in each bundle; a slot that dies
while its peers live is replaced in the same bundle; the group is removed once its replica is
gone. At T = 1 every slot keeps a single-bundle PACK group of its own. Ray itself is faked."""
from __future__ import annotations

import pytest
from fake_ray import Actor, Ref, spec_of

import elastic._controller.placement as placement
import elastic._controller.worker_group as ray_group
from elastic._controller.slot_table import DEAD, PENDING, READY
from elastic._controller.worker_group import RayWorkerGroup
from elastic._protocol import WorkerInfo, WorkerReport
from elastic.config import FailureConfig, ScalingConfig

pytestmark = pytest.mark.timeout(30)


class FakePlacementGroup:
    def __init__(self, bundles: list[dict], strategy: str):
        self.bundles, self.strategy = bundles, strategy

    def ready(self) -> Ref:
        return Ref(self)          # a fresh reference each time, as Ray's


class Launcher:
    """ray.remote(TrainWorker): each launch records the options it was started with."""

    def __init__(self, launches: list[dict]):
        self._launches = launches
        self._options: dict = {}

    def options(self, **options):
        self._options = options
        return self

    def remote(self, spec, controller=None):
        pid = len(self._launches)
        self._launches.append(self._options)
        report = WorkerReport(phase="idle", generation=0, rank=None, step=0, has_state=False, records=[])
        return Actor(info=WorkerInfo(pid=pid, node_id="n", actor_id=str(pid), ip=""), poll=report)


@pytest.fixture
def ray_calls(fake_ray, monkeypatch):
    """The placement groups made, the groups removed and the actors' launch options."""
    made: list[FakePlacementGroup] = []
    removed: list[FakePlacementGroup] = []
    launches: list[dict] = []

    def make(bundles, strategy):
        made.append(FakePlacementGroup(bundles, strategy))
        return made[-1]

    monkeypatch.setattr(placement, "placement_group", make)
    monkeypatch.setattr(ray_group, "remove_placement_group", removed.append)
    fake_ray.remote = lambda cls: Launcher(launches)
    return made, removed, launches


def group_of(tp: int, workers: int) -> RayWorkerGroup:
    scaling = ScalingConfig(min_workers=workers, max_workers=workers, tensor_parallel_size=tp,
                            resources_per_worker={"CPU": 1.0})
    return RayWorkerGroup(spec_of(scaling, FailureConfig(heartbeat_timeout_s=5.0)))


def where(launch: dict) -> tuple[FakePlacementGroup, int]:
    strategy = launch["scheduling_strategy"]
    return strategy.placement_group, strategy.placement_group_bundle_index


def test_each_replica_gets_one_strict_pack_group_of_t_bundles_a_slot_in_each(ray_calls):
    made, removed, launches = ray_calls
    group = group_of(tp=2, workers=4)
    group.scale_to(4)
    assert [(pg.bundles, pg.strategy) for pg in made] == [([{"CPU": 1.0}] * 2, "STRICT_PACK")] * 2
    views = group.tick()
    assert sorted(views) == [0, 1, 2, 3] and all(v.status == READY for v in views.values())
    assert [where(launch) for launch in launches] == [(made[0], 0), (made[0], 1), (made[1], 0), (made[1], 1)]
    group.scale_to(4)                        # nothing missing: nothing asked for
    assert len(made) == 2 and not removed


def test_a_dead_slot_is_replaced_in_its_bundle_beside_its_live_peer(ray_calls):
    made, removed, launches = ray_calls
    group = group_of(tp=2, workers=4)
    group.scale_to(4)
    group.tick()
    group.kill(3, "test")
    assert not removed                       # its peer (worker 2) still holds the other bundle
    group.scale_to(3)                        # a recovery keeps only those alive: no replacement yet
    assert len(launches) == 4 and group.tick()[3].status == DEAD
    group.scale_to(4)
    assert len(made) == 2                    # no new placement group: the replica's own bundle
    views = group.tick()
    assert views[4].status == READY and where(launches[-1]) == (made[1], 1)


def test_a_replicas_group_is_removed_once_every_slot_of_it_is_dead_and_a_new_one_is_made(ray_calls):
    made, removed, launches = ray_calls
    group = group_of(tp=2, workers=4)
    group.scale_to(4)
    group.tick()
    group.kill(0, "node lost")
    group.kill(1, "node lost")
    assert removed == [made[0]]              # once, with its last slot
    group.scale_to(4)
    assert len(made) == 3 and made[2].strategy == "STRICT_PACK"
    views = group.tick()
    assert [where(launch) for launch in launches[4:]] == [(made[2], 0), (made[2], 1)]
    assert views[4].status == views[5].status == READY
    group.shutdown(graceful=False)
    assert removed == [made[0], made[1], made[2]]


def test_a_count_that_is_not_whole_replicas_is_rounded_up_to_them(ray_calls):
    """An unlimited run's probe (one slot more than placed) is one replica more."""
    made, _, _ = ray_calls
    group = group_of(tp=2, workers=4)
    group.scale_to(3)
    assert len(made) == 2 and len(group._slots.in_status(PENDING)) == 4


def test_without_tensor_parallelism_each_slot_keeps_a_pack_group_of_its_own(ray_calls):
    made, removed, launches = ray_calls
    group = group_of(tp=1, workers=2)
    group.scale_to(2)
    assert [(pg.bundles, pg.strategy) for pg in made] == [([{"CPU": 1.0}], "PACK")] * 2
    group.tick()
    assert [where(launch) for launch in launches] == [(made[0], 0), (made[1], 0)]
    group.kill(1, "test")
    assert removed == [made[1]]
    group.scale_to(2)
    assert len(made) == 3 and group.tick()[2].status == READY and where(launches[-1]) == (made[2], 0)

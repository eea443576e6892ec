"""A worker call that raises (RayTaskError) replaces that worker instead of crashing the
controller (reliability review F15). Ray itself is faked: the group's calls go to stand-ins."""
from __future__ import annotations

import pytest
from fake_ray import Actor, Ref, group_of, spec_of, task_error
from ray.exceptions import ActorDiedError, GetTimeoutError

from elastic._controller.slot_table import DEAD, READY, Slot
from elastic._controller.worker_group import RayWorkerGroup
from elastic._protocol import WorkerReport
from elastic.config import FailureConfig, ScalingConfig
from elastic.errors import WorkerLostError

pytestmark = pytest.mark.timeout(30)


REFUSED = "worker asked to join generation 3 while still running generation 2"


def test_a_worker_whose_start_generation_raises_is_replaced_and_the_others_still_start(fake_ray):
    report = WorkerReport(phase="running", generation=3, rank=0, step=0, has_state=True, records=[])
    refusing = Actor(start_generation=task_error("start_generation", REFUSED), poll=report)
    fine = Actor(start_generation=None, poll=report)
    group = group_of(fine, refusing)
    with pytest.raises(WorkerLostError, match="worker 1 could not start the generation") as caught:
        group.start_generation({0: "plan-0", 1: "plan-1"})
    assert REFUSED in str(caught.value)
    assert fake_ray.killed == [refusing]
    views = group.tick()
    assert views[1].status == DEAD and REFUSED in views[1].death and views[0].status == READY


def test_a_rendezvous_lookup_that_raises_replaces_the_worker(fake_ray):
    failing = Actor(rendezvous_address=task_error("rendezvous_address", "no address on this node"))
    group = group_of(failing)
    with pytest.raises(WorkerLostError, match="no address on this node"):
        group.rendezvous_address(0)
    assert fake_ray.killed == [failing] and group.tick()[0].status == DEAD


def test_a_slow_or_dead_worker_is_reported_but_left_to_the_polls(fake_ray):
    slow, dead = Actor(start_generation=GetTimeoutError("slow")), Actor(start_generation=ActorDiedError())
    group = group_of(slow, dead)
    with pytest.raises(WorkerLostError) as caught:
        group.start_generation({0: "plan-0", 1: "plan-1"})
    assert "worker 0" in str(caught.value) and "worker 1" in str(caught.value)
    assert fake_ray.killed == []


def test_a_poll_that_raises_replaces_the_worker_instead_of_ending_the_tick(fake_ray):
    report = WorkerReport(phase="running", generation=0, rank=0, step=3, has_state=True, records=[])
    broken, fine = Actor(poll=task_error("poll", "cannot pickle the report")), Actor(poll=report)
    group = group_of(broken, fine)
    group.tick()                        # sends the polls
    views = group.tick()                # collects them
    assert views[0].status == DEAD and "cannot pickle the report" in views[0].death
    assert fake_ray.killed == [broken]
    assert views[1].status == READY and views[1].report.step == 3


def test_a_placement_that_never_comes_is_said_once(fake_ray, monkeypatch, caplog):
    fake_ray.wait = lambda refs, num_returns=1, timeout=None: ([], list(refs))     # the cluster is full
    fake_ray.available_resources = lambda: {"CPU": 0.5, "node:10.0.0.1": 1.0}
    now = [100.0]
    group = RayWorkerGroup(spec_of(ScalingConfig(min_workers=1, max_workers=1, spare_workers=1),
                                   FailureConfig(heartbeat_timeout_s=5.0)), clock=lambda: now[0])
    group._slots.add(Slot(wid=1, pg=None, pg_ready=Ref(None), created_at=90.0))      # the spare's placement
    with caplog.at_level("WARNING", logger="elastic.group"):
        group.tick()                      # 10 s: not yet
        assert not caplog.records
        now[0] = 200.0
        group.tick()                      # 110 s: said ...
        now[0] = 300.0
        group.tick()                      # ... once
    (record,) = caplog.records
    assert "max_workers + spare_workers = 2" in record.getMessage() and "'CPU': 0.5" in record.getMessage()


def test_a_failed_start_names_each_worker_that_did_not_take_its_plan_and_why(fake_ray):
    """The controller replaces the workers WorkerLostError.lost names, and cuts the others out
    of the rendezvous they joined (reliability review R3-6)."""
    refusing = Actor(start_generation=task_error("start_generation", REFUSED))
    slow, dead, fine = (Actor(start_generation=GetTimeoutError("slow")), Actor(start_generation=ActorDiedError()),
                        Actor(start_generation=None))
    group = group_of(fine, refusing, slow, dead)
    with pytest.raises(WorkerLostError) as caught:
        group.start_generation({0: "plan-0", 1: "plan-1", 2: "plan-2", 3: "plan-3"})
    assert caught.value.lost == {1: "hang", 2: "hang", 3: "worker_died"}
    assert fake_ray.killed == [refusing]                 # the others are the controller's to kill

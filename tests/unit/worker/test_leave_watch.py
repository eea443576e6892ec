"""A training thread that stays in its generation after the controller cut the group is blocked
where no cut reaches: the worker logs its stack (LEAVE_WATCH_S after the cut) before the
controller replaces it, so a recovery that turned cold says where the survivor was stuck."""
import logging
import threading

import pytest

from elastic._protocol import GenerationPlan, RestorePlan, WorkerPhase
from elastic._worker import worker as worker_module

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch):
    monkeypatch.setattr(worker_module, "LEAVE_WATCH_S", 0.05)


def in_generation(worker, generation, target):
    """`worker` runs `generation` on a training thread that runs `target` (no group is formed)."""
    worker._plan = GenerationPlan(generation=generation, rank=3, world_size=4, master_addr="127.0.0.1",
                                  master_port=1, restore=RestorePlan("fresh"), timeout_s=5.0)
    worker._phase = WorkerPhase.RUNNING
    worker._thread = threading.Thread(target=target, daemon=True)
    worker._thread.start()


def watched(caplog, worker, generation, wait_s):
    with caplog.at_level(logging.WARNING, logger="elastic.worker"):
        worker.request_stop(generation, cut_group=True)
        threading.Event().wait(wait_s)
    return [r.getMessage() for r in caplog.records if "after its group was cut" in r.getMessage()]


def test_a_thread_still_in_the_cut_generation_has_its_stack_logged(worker, caplog):
    release = threading.Event()

    def blocked_where_no_cut_reaches():
        release.wait(30)

    in_generation(worker, 5, blocked_where_no_cut_reaches)
    try:
        (message,) = watched(caplog, worker, 5, 1.0)
    finally:
        release.set()
    assert "rank 3's training thread is still in generation 5" in message
    assert "blocked_where_no_cut_reaches" in message and "release.wait(30)" in message


def test_a_thread_that_left_is_not_logged(worker, caplog):
    left = threading.Event()

    def leaves_at_the_cut():
        worker._stop_requested.wait(30)
        with worker._lock:
            worker._phase = WorkerPhase.FAILED     # what a broken collective's error report sets
        left.set()

    in_generation(worker, 5, leaves_at_the_cut)
    assert watched(caplog, worker, 5, 1.0) == []
    assert left.is_set()

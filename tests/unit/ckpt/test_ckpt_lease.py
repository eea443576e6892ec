"""F2 of the reliability review: one run per storage URL (checkpointing.acquire_run_lease)."""

from __future__ import annotations

import json
import pickle
import threading
import time

import pytest

from checkpointing import (
    CheckpointManager,
    FencedError,
    RunConflictError,
    acquire_run_lease,
    read_fence,
)
from checkpointing import manifest as mf
from checkpointing.storage import Storage


def write_status(url: str, *, run_id: str | None, state: str = "running", age_s: float = 0.0) -> None:
    """status.json as the runtime writes it (about once a second while the run is alive)."""
    doc = {"state": state, "generation": 3, "step": 120, "world_size": 2, "last_committed_step": 100,
           "updated_at": time.time() - age_s, "workers": [{"rank": 0, "pid": 4242, "node_id": "n",
                                                            "actor_id": "a"}]}
    if run_id is not None:
        doc["run_id"] = run_id
    st = Storage(url)
    st.write_atomic(st.path("status.json"), json.dumps(doc).encode())


@pytest.mark.timeout(30)
def test_a_second_run_on_a_live_runs_storage_is_refused_with_a_typed_error_naming_it(url):
    first = acquire_run_lease(url, "run-a")
    first.fence(0, start_step=0)
    write_status(url, run_id="run-a")
    with pytest.raises(RunConflictError) as err:
        acquire_run_lease(url, "run-b")
    assert err.value.owner == "run-a" and isinstance(err.value, FencedError)
    msg = str(err.value)
    assert "run-a" in msg and "4242" in msg and "takeover=True" in msg
    back = pickle.loads(pickle.dumps(err.value))
    assert type(back) is RunConflictError and back.owner == "run-a" and str(back) == msg
    assert mf.read_fence_doc(Storage(url)).run_id == "run-a"   # nothing changed
    again = acquire_run_lease(url, "run-a")                      # the holder itself: fine
    assert again.generation == 0


@pytest.mark.timeout(30)
def test_a_fresh_lease_without_status_yet_is_live_and_a_legacy_status_without_run_id_too(url):
    acquire_run_lease(url, "run-a")
    with pytest.raises(RunConflictError, match="took the lease"):
        acquire_run_lease(url, "run-b")
    other = url + "-legacy"
    write_status(other, run_id=None)  # a runtime that predates run ids, no FENCE owner
    with pytest.raises(RunConflictError, match="no run id"):
        acquire_run_lease(other, "run-b")


@pytest.mark.timeout(30)
def test_a_dead_runs_storage_is_taken_over_once_stale_and_the_old_run_is_then_fenced_out(url):
    old = acquire_run_lease(url, "run-a", clock=lambda: time.time() - 600)
    old.fence(3, start_step=100)
    write_status(url, run_id="run-a", age_s=61.0)  # stale: no rewrite for over a minute
    new = acquire_run_lease(url, "run-b")
    assert new.taken_over_from == "run-a" and new.generation == 3
    new.fence(4, start_step=100)
    with pytest.raises(RunConflictError, match="run-b"):   # the old controller's next generation
        old.fence(5, start_step=120)
    assert read_fence(url) == 4
    zombie = CheckpointManager(url, async_save=False)
    from ckpt_conformance import make_state
    zombie.save(130, make_state(1), generation=3)           # the old run's workers: fenced
    assert isinstance(zombie.last_error, FencedError) and mf.read_manifest(zombie.storage, 130) is None


@pytest.mark.timeout(30)
def test_explicit_takeover_and_finished_or_released_runs(url):
    acquire_run_lease(url, "run-a")
    write_status(url, run_id="run-a")
    taken = acquire_run_lease(url, "run-b", takeover=True)      # the operator knows run-a is dead
    assert taken.taken_over_from == "run-a"
    write_status(url, run_id="run-b", state="finished")          # run-b ended: no wait needed
    assert acquire_run_lease(url, "run-c").taken_over_from == "run-b"
    lease = acquire_run_lease(url, "run-c")
    lease.release()
    assert acquire_run_lease(url, "run-d").taken_over_from == "run-c"


@pytest.mark.timeout(30)
def test_two_runs_starting_at_once_cannot_both_win(url):
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def start(run_id):
        barrier.wait(5)
        try:
            results[run_id] = acquire_run_lease(url, run_id)
        except RunConflictError as e:
            results[run_id] = e

    threads = [threading.Thread(target=start, args=(r,)) for r in ("run-a", "run-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    winners = [r for r, v in results.items() if not isinstance(v, Exception)]
    assert len(winners) == 1 and len(results) == 2
    assert mf.read_fence_doc(Storage(url)).run_id == winners[0]


def test_bad_arguments():
    with pytest.raises(ValueError):
        acquire_run_lease("memory://x/y", "")
    with pytest.raises(ValueError):
        acquire_run_lease("memory://x/y", "r", stale_after_s=0)

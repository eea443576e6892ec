"""One run per storage URL (reliability review F2), at fit()'s start: a second ElasticTrainer on
a live run's storage refuses with RunConflictError naming it; takeover=True takes it over, and
the run taken over is fenced at its next generation. The lease lives on its renewal by a thread
of its own (review R3-4): a run that loses it ends, and writes nothing more there."""
import json
import threading

import pytest

from checkpointing import FencedError, RunConflictError
from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig
from elastic._controller.actor import CheckpointView
from elastic._run_names import RunNames

pytestmark = pytest.mark.timeout(30)


def loop(ctx):
    pass


def trainer(storage, takeover=False):
    return ElasticTrainer(loop, scaling=ScalingConfig(min_workers=1, max_workers=1),
                          checkpoint=CheckpointConfig(storage=storage, takeover=takeover), total_steps=1)


def test_a_second_run_on_a_live_runs_storage_refuses_then_takeover_fences_the_first(tmp_path):
    first = trainer(str(tmp_path))
    first._check_storage()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["run_id"] == first._run_id and status["state"] == "scheduling"
    CheckpointView(str(tmp_path), None, None, first._run_id).fence(1, start_step=0)

    with pytest.raises(RunConflictError, match=f"in use by run {first._run_id}"):
        trainer(str(tmp_path))._check_storage()

    second = trainer(str(tmp_path), takeover=True)
    second._check_storage()
    CheckpointView(str(tmp_path), None, None, second._run_id).fence(2, start_step=0)
    with pytest.raises(FencedError):               # the first run's next generation is refused
        CheckpointView(str(tmp_path), None, None, first._run_id).fence(3, start_step=0)


def test_a_refused_claim_is_not_kept_so_fit_meets_the_live_run_again(tmp_path):
    """examples/pretrain.py claims the storage before it starts Ray, and calls fit() even when the
    claim is refused (the live run may be its own, to attach to). A refused claim once left its run
    id behind: fit() then took the claim as held and started a second run beside the live one,
    which took the lease and failed the first run."""
    first = trainer(str(tmp_path))
    first.claim_storage()
    second = trainer(str(tmp_path))
    for _ in range(2):                  # the pre-claim, then fit()'s own
        with pytest.raises(RunConflictError, match=f"in use by run {first._run_id}"):
            second.claim_storage()
    assert second._run_id is None


def test_a_finished_runs_storage_is_free(tmp_path):
    first = trainer(str(tmp_path))
    first._check_storage()
    (tmp_path / "status.json").write_text(json.dumps({"state": "finished", "run_id": first._run_id,
                                                      "updated_at": 0}))
    trainer(str(tmp_path))._check_storage()


# ---- R3-4: the lease is renewed by a thread of its own, and a run that loses it ends -------------
def storage_fence(url):
    from checkpointing import manifest as mf
    from checkpointing.storage import Storage
    return mf.read_fence_doc(Storage(url))


def test_a_live_run_keeps_its_storage_while_its_status_writes_and_listings_stall(tmp_path, monkeypatch):
    """The review's repro (R3-4): run A's newest-commit listing and its status.json writes hang;
    past the staleness bound (4 s here, standing in for 60) run B is still refused, because A's
    lease is renewed by a thread that does nothing else. Before, the lease lived on status.json's
    updated_at, which the stalled writes froze: B took A's storage over."""
    import checkpointing.lease as lease_module
    import elastic._controller.actor as controller_actor
    from chaos.services import wait_until
    from checkpointing import acquire_run_lease
    monkeypatch.setattr(lease_module, "DEFAULT_STALE_AFTER_S", 4.0)      # A renews every 1 s
    monkeypatch.setattr(controller_actor, "RayMetricsListener", lambda run: object())   # no Ray here
    # ... nor a run's named workers to look for: the listing would start a local Ray (seconds to
    # tens of seconds on a loaded machine, past this test's limit).
    monkeypatch.setattr(RunNames, "workers", lambda self: {})
    # ... nor a node of its own: outside an actor, asking Ray for the node id connects to (or
    # starts) a cluster, which hung past the limit in CI where another test's cluster was going.
    monkeypatch.setattr(controller_actor, "ray_node_id", lambda: "node-a")
    released = threading.Event()

    def hang(*args):
        assert released.wait(30), "never released"
        raise OSError("the storage call was stuck")
    monkeypatch.setattr(CheckpointView, "latest_step", hang)
    monkeypatch.setattr(CheckpointView, "committed_since", hang)
    url = str(tmp_path)
    a = trainer(url)
    a._check_storage()                                  # run A takes the storage (status.json: scheduling)
    taken_at = storage_fence(url).lease_at
    actor = controller_actor.ControllerActor(a._spec(), a.effective_config(), None, None, run_id=a._run_id)
    actor._recorder.status_writer._write = hang         # status.json's writes hang too
    try:
        for _ in range(3):                              # the controller's ticks write status on
            actor._controller._write_status(force=True)
        wait_until(lambda: storage_fence(url).lease_at > taken_at + 1.0, 10,
                   "run A's lease renewed while its status writes and listings hang", interval_s=0.02)
        with pytest.raises(RunConflictError, match=f"in use by run {a._run_id}"):
            acquire_run_lease(url, "run-B", stale_after_s=4.0, clock=lambda: taken_at + 4.5)
    finally:
        released.set()
        lease = getattr(actor, "_lease", None)
        if lease is not None:
            lease.close()
        for close in getattr(actor, "_closers", ()):
            close()
        actor._recorder.status_writer._write = lambda status: None
        actor._recorder.status_writer.close()


def test_the_keeper_renews_every_quarter_of_the_bound_and_a_run_taken_over_loses_its_lease(tmp_path):
    from checkpointing import LeaseKeeper, acquire_run_lease
    url, wall = str(tmp_path), [1000.0]
    mine = acquire_run_lease(url, "run-a", clock=lambda: wall[0])
    keeper = LeaseKeeper(mine, stale_after_s=60.0, clock=lambda: wall[0], wall_clock=lambda: wall[0], start=False)
    assert (keeper.renew_every_s, keeper.retry_every_s, keeper.unconfirmed_after_s) == (15.0, 3.0, 45.0)
    wall[0] += 15.0
    assert keeper.renew_once() and storage_fence(url).lease_at == 1015.0
    assert keeper.lost() is None and keeper.holds()
    wall[0] += 70.0                                     # run A looks dead (no renewal for 70 s) ...
    acquire_run_lease(url, "run-b", clock=lambda: wall[0])
    assert not keeper.renew_once()                      # ... and its next renewal finds run B holding FENCE
    lost = keeper.lost()
    assert isinstance(lost, RunConflictError) and lost.owner == "run-b"
    assert "run run-b took the storage over" in str(lost)
    assert not keeper.holds()
    assert storage_fence(url).run_id == "run-b"         # the lost holder wrote nothing


def test_a_lease_that_cannot_be_renewed_stops_the_runs_writes_before_another_run_may_take_it(tmp_path, monkeypatch):
    """A storage stall is not a conflict: an unrenewed lease stops the run's own writes before
    another run may judge it dead (3/4 of the bound), and a renewal that goes through again
    confirms it and the writes resume; only a renewal that finds another holder loses it."""
    from checkpointing import LeaseKeeper, RunLease, acquire_run_lease
    url, now = str(tmp_path), [1000.0]
    mine = acquire_run_lease(url, "run-a", clock=lambda: now[0])
    keeper = LeaseKeeper(mine, stale_after_s=60.0, clock=lambda: now[0], wall_clock=lambda: now[0], start=False)
    real_renew = RunLease.renew

    def unreachable(self, *, clock):
        raise OSError("endpoint unreachable")
    monkeypatch.setattr(RunLease, "renew", unreachable)
    now[0] += 30.0
    assert not keeper.renew_once() and keeper.unconfirmed() is None and keeper.holds()   # within 3/4
    now[0] += 15.1                                                # 45.1 s since the last renewal
    why = keeper.unconfirmed()
    assert why is not None and "could not renew its lease" in why and "endpoint unreachable" in why
    assert not keeper.holds() and keeper.lost() is None          # no writes, but not a conflict: the run goes on
    monkeypatch.setattr(RunLease, "renew", real_renew)
    now[0] += 5.0                                                 # storage back, nobody took over
    assert keeper.renew_once() and keeper.unconfirmed() is None and keeper.holds()
    assert storage_fence(url).lease_at == now[0]
    # A renewal stuck in a storage call (the thread never comes back) is unconfirmed the same way,
    # on the caller's clock: the deadline does not wait for the call.
    stuck = LeaseKeeper(mine, stale_after_s=60.0, clock=lambda: now[0], start=False)
    now[0] += 45.1
    assert "a renewal is stuck in a storage call" in (stuck.unconfirmed() or "") and not stuck.holds()


def test_the_keepers_thread_renews_on_its_own_and_stops_at_close(tmp_path):
    from chaos.services import wait_until
    from checkpointing import LeaseKeeper, acquire_run_lease
    url = str(tmp_path)
    mine = acquire_run_lease(url, "run-a", clock=lambda: 1000.0)
    keeper = LeaseKeeper(mine, stale_after_s=2.0)     # renews at once, then every 0.5 s
    try:
        wait_until(lambda: storage_fence(url).lease_at > 1000.0, 10, "a renewal by the keeper's thread",
                   interval_s=0.01)
        assert keeper.lost() is None
    finally:
        keeper.close()
    mine.release()
    assert storage_fence(url).released and keeper.lost() is None     # closed: never "lost" after


def test_liveness_is_the_lease_not_status_json(tmp_path):
    """A holder whose lease went stale is not live, however fresh its status.json (a run whose
    keeper stopped has ended or lost the lease); one whose lease is fresh is live however stale
    its status.json."""
    from checkpointing import acquire_run_lease
    url = str(tmp_path)
    now = 10_000.0
    acquire_run_lease(url, "run-a", clock=lambda: now - 61)
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "run_id": "run-a", "updated_at": now}))
    assert acquire_run_lease(url, "run-b", clock=lambda: now).taken_over_from == "run-a"
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "run_id": "run-b", "updated_at": 0}))
    with pytest.raises(RunConflictError, match="run run-b .took the lease, renewed 1.0s ago; status.json"):
        acquire_run_lease(url, "run-c", clock=lambda: now + 1)


def test_a_controller_whose_lease_is_lost_fails_the_run_with_the_conflict():
    from fakes import FakeLease
    from harness import make, start

    from elastic._controller.states import RunState
    lease = FakeLease()
    controller, group, _, _ = make(lease=lease)
    start(controller, group)
    lease.lost_with = RunConflictError("run-b took the storage over", url="file:///x", owner="run-b")
    controller.tick()
    assert controller.state.state == RunState.FAILED and controller.error["exception"] is lease.lost_with
    assert controller.error["type"] == "RunConflictError"
    assert controller.recorder.statuses[-1]["state"] == "failed"


def test_a_run_that_lost_its_storage_to_another_writes_none_of_its_files_there(tmp_path):
    from elastic._controller.run_record import RunRecorder
    from elastic._protocol import StepRecord
    holds = [True]
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={}, holds_storage=lambda: holds[0])
    recorder.on_generation_start(0, 1)
    recorder.on_step(StepRecord(step=1, loss=2.5, world_size=1, time=1.0, samples_seen=4, global_batch=4))
    recorder.write_status(force=True, state="running", step=1)
    assert json.loads((tmp_path / "status.json").read_text())["step"] == 1
    holds[0] = False                                    # another run took the storage over
    (tmp_path / "status.json").write_text('{"run_id": "run-b"}')
    recorder.on_step(StepRecord(step=2, loss=2.0, world_size=1, time=2.0, samples_seen=8, global_batch=4))
    recorder.write_status(force=True, state="failed", step=2)
    summary = recorder.write_summary(status="failed", final_step=2, checkpoints=[], model_sha256=None, error=None)
    assert summary["status"] == "failed" and summary["final_step"] == 2      # built and returned ...
    assert json.loads((tmp_path / "status.json").read_text()) == {"run_id": "run-b"}   # ... written nowhere
    assert not (tmp_path / "summary.json").exists()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_run_whose_lease_is_unconfirmed_for_a_while_writes_the_waiting_metrics_lines_after(tmp_path):
    from elastic._controller.run_record import RunRecorder
    from elastic._protocol import StepRecord
    holds = [True]
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={}, holds_storage=lambda: holds[0])
    recorder.on_generation_start(0, 1)
    recorder.on_step(StepRecord(step=1, loss=2.5, world_size=1, time=1.0, samples_seen=4, global_batch=4))
    recorder.flush_metrics()
    holds[0] = False                                    # storage stalled past the renewals' deadline
    recorder.on_step(StepRecord(step=2, loss=2.0, world_size=1, time=2.0, samples_seen=8, global_batch=4))
    recorder.flush_metrics()
    lines = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1]
    holds[0] = True                                     # a renewal went through again
    recorder.flush_metrics()
    lines = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2]

"""The controller at the edges (reliability review F5, F6, F14), driven by fakes (no Ray): a
generation that never starts, transient storage errors in the control loop, a generation in
which no step completes."""
import pytest
from fakes import FakeCheckpoints
from harness import interrupt, make, start

from checkpointing import StorageError
from elastic._controller.states import RunState
from elastic._protocol import WorkerPhase
from elastic.errors import TooManyFailuresError, WorkerLostError

pytestmark = pytest.mark.timeout(30)


def test_a_generation_whose_rendezvous_lookup_times_out_recovers_instead_of_waiting_forever():
    controller, group, clock, _ = make()
    members = start(controller, group)
    group.complete_steps(members[0], 1, 10, 3)
    controller.tick()
    group.die(members[2])
    controller.tick()                                    # recovering
    interrupt(group, members[:2], 0, 10)
    calls = []

    def slow_lookup(wid):
        calls.append(wid)
        if len(calls) == 1:
            raise WorkerLostError("rendezvous lookup timed out (GetTimeoutError)")
        return "127.0.0.1", 29500
    group.rendezvous_address = slow_lookup
    controller.tick()                                    # re-form: the lookup fails
    assert controller.state.state == RunState.RECOVERING and controller.failures[-1].cause == "hang"
    # The members never got the failed generation: the survivors are still out of generation 0,
    # the replacement idle; the next re-form goes through.
    interrupt(group, members[:2], 0, 10)
    (replacement,) = [w for w in group.live() if w not in members]
    group.set_report(replacement, WorkerPhase.IDLE, generation=-1)
    for _ in range(3):
        controller.tick()
        if controller.state.state == RunState.RUNNING:
            break
    assert controller.state.state == RunState.RUNNING and controller.generation == 2 and len(calls) == 2


def test_a_generation_that_never_starts_on_a_member_is_recovered_after_the_rendezvous_timeout():
    controller, group, clock, _ = make()
    members = start(controller, group)
    group.set_report(members[1], WorkerPhase.IDLE, generation=-1)   # never joined generation 0
    clock.advance(30)
    controller.tick()
    assert controller.state.state == RunState.RUNNING
    clock.advance(31)                                    # past rendezvous_timeout_s=60
    controller.tick()
    assert controller.state.state == RunState.RECOVERING
    assert controller.failures[-1].cause == "hang" and controller.failures[-1].ranks == (1,)
    assert [w for w, _ in group.killed] == [members[1]]


class FlakyCheckpoints:
    """Fails `fails` calls of `method` with a StorageError (a 503), then works."""

    def __init__(self, inner, method, fails):
        self.inner, self.method, self.fails = inner, method, fails

    def __getattr__(self, name):
        real = getattr(self.inner, name)
        if name != self.method:
            return real

        def call(*args, **kwargs):
            if self.fails > 0:
                self.fails -= 1
                raise StorageError("503 SlowDown", url="s3://bucket/run")
            return real(*args, **kwargs)
        return call


@pytest.mark.parametrize("method", ["fence", "latest_step"])
def test_a_transient_storage_error_at_recovery_is_retried_and_counted_once(method):
    flaky = FlakyCheckpoints(FakeCheckpoints(), method, fails=0)
    controller, group, clock, _ = make(max_failures=5, checkpoints=flaky)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 10, 3)
    controller.tick()
    for wid in members:                                  # no survivor holds state: the checkpoint rung
        group.views[wid].report = group.views[wid].report.__class__(**{**group.views[wid].report.__dict__,
                                                                       "has_state": False})
    flaky.fails = 3                                      # storage fails from the recovery on
    group.die(members[2])
    controller.tick()
    interrupt(group, members[:2], 0, 10)
    for wid in members[:2]:
        group.views[wid].report = group.views[wid].report.__class__(**{**group.views[wid].report.__dict__,
                                                                       "has_state": False})
    for _ in range(40):
        controller.tick()
        clock.advance(1)
        if controller.state.state == RunState.RUNNING:
            break
    assert controller.state.state == RunState.RUNNING and controller.generation == 1
    assert [f.cause for f in controller.failures] == ["worker_died", "storage_error"]


def test_a_storage_error_that_lasts_past_the_rendezvous_timeout_fails_the_run_with_it():
    controller, group, clock, _ = make(checkpoints=FlakyCheckpoints(FakeCheckpoints(), "fence", fails=10_000))
    controller.tick()
    for _ in range(200):
        controller.tick()
        clock.advance(1)
        if controller.done:
            break
    assert controller.state.state == RunState.FAILED and isinstance(controller.error["exception"], StorageError)


def test_storage_errors_count_against_max_failures():
    flaky = FlakyCheckpoints(FakeCheckpoints(), "fence", fails=1)
    controller, group, clock, _ = make(max_failures=0, checkpoints=flaky)
    controller.tick()
    controller.tick()
    assert controller.state.state == RunState.FAILED
    assert isinstance(controller.error["exception"], TooManyFailuresError)


def test_a_generation_in_which_no_step_completes_within_the_step_timeout_is_replaced():
    controller, group, clock, _ = make(step_timeout_s=120.0)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 5, 3)
    controller.tick()
    clock.advance(100)                                   # every rank still polls: no heartbeat alarm
    controller.tick()
    assert controller.state.state == RunState.RUNNING
    clock.advance(30)
    controller.tick()
    assert controller.state.state == RunState.RECOVERING
    failure = controller.failures[-1]
    assert failure.cause == "hang" and failure.ranks == (0, 1, 2) and "step_timeout_s" in failure.message
    assert sorted(w for w, _ in group.killed) == sorted(members)


def test_the_automatic_step_timeout_follows_the_step_time():
    from elastic.config import FailureConfig
    assert FailureConfig().step_timeout(0.0) == 600.0
    assert FailureConfig().step_timeout(30.0) == 3000.0
    assert FailureConfig(step_timeout_s=None).step_timeout(30.0) is None
    with pytest.raises(ValueError, match="step_timeout_s"):
        FailureConfig(step_timeout_s=float("inf"))

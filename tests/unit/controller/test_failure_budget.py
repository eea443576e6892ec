"""The failure budget's three rules: lifetime count, rate, and no progress (no Ray)."""
import pickle

import pytest
from harness import interrupt, make, start

from elastic._controller.failure_budget import FailureBudget
from elastic._controller.states import RunState
from elastic.config import FailureConfig
from elastic.errors import FailureRateError, NoProgressError, TooManyFailuresError
from elastic.policies import Cause, Failure, FailurePolicy
from support import FakeClock

pytestmark = pytest.mark.timeout(30)

DIED = Failure(Cause.WORKER_DIED, (1,), "lost worker(s) [1]")


def budget(**config):
    clock = FakeClock()
    return FailureBudget(FailurePolicy(), FailureConfig(**config), clock), clock


def test_a_run_that_moves_on_between_faults_is_never_stopped():
    b, clock = budget()                        # the defaults: no lifetime count
    for n in range(2000):                      # a fault every 5 minutes for a week
        clock.advance(300)
        assert b.charge(DIED, reached_step=10 * n).action == "recover"
    assert b.infra_failures == 2000 and b.without_progress == 0


def test_a_crash_loop_ends_on_the_progress_rule_with_its_own_error():
    b, clock = budget(max_failures_without_progress=5)
    decisions = []
    for _ in range(6):                         # every attempt dies at the step the first reached
        clock.advance(10)
        decisions.append(b.charge(DIED, reached_step=40))
    assert [d.action for d in decisions] == ["recover"] * 5 + ["fail"]
    error = b.exhausted(decisions[-1], DIED)
    assert type(error) is NoProgressError and isinstance(error, TooManyFailuresError)
    assert "max_failures_without_progress=5" in str(error) and "worker_died" in str(error)


def test_progress_between_failures_resets_the_streak_and_storage_errors_do_not_count_in_it():
    b, clock = budget(max_failures_without_progress=2)
    assert b.charge(DIED, reached_step=40).action == "recover"
    assert b.charge(DIED, reached_step=40).action == "recover"          # one without progress
    assert b.charge(Failure(Cause.STORAGE_ERROR, (), "fence"), None).action == "recover"
    assert b.without_progress == 1
    assert b.charge(DIED, reached_step=41).action == "recover"          # moved on
    assert b.without_progress == 0


def test_the_rate_rule_counts_only_failures_within_its_window():
    b, clock = budget(failure_rate_limit=3, failure_rate_window_s=60.0)
    for step in range(3):
        clock.advance(1)
        assert b.charge(DIED, reached_step=step).action == "recover"
    clock.advance(1)
    decision = b.charge(DIED, reached_step=10)
    assert decision.action == "fail" and type(b.exhausted(decision, DIED)) is FailureRateError
    b, clock = budget(failure_rate_limit=3, failure_rate_window_s=60.0)
    for step in range(10):                     # the same four, spread over more than the window
        clock.advance(25)
        assert b.charge(DIED, reached_step=step).action == "recover"


def test_the_lifetime_count_stays_and_names_itself():
    b, _ = budget(max_failures=1)
    assert b.charge(DIED, reached_step=1).action == "recover"
    decision = b.charge(DIED, reached_step=2)
    assert decision.action == "fail" and type(b.exhausted(decision, DIED)) is TooManyFailuresError


def test_the_rule_errors_pickle_with_their_type():
    for cls in (FailureRateError, NoProgressError):
        error = pickle.loads(pickle.dumps(cls("spent")))
        assert type(error) is cls and str(error) == "spent"


def test_the_controller_ends_a_crash_loop_with_no_progress_error():
    controller, group, clock, _ = make(capacity=10, min_workers=2, max_workers=2, failure=FailureConfig(
        max_failures_without_progress=2, heartbeat_timeout_s=5.0, collective_timeout_s=30.0, rendezvous_timeout_s=60.0))
    members = start(controller, group)
    attempts = 0
    for _ in range(3):                          # rank 1 dies at step 3 every time
        attempts += 1
        assert controller.state.state == RunState.RUNNING
        group.complete_steps(members[0], 1, 3, 2)
        controller.tick()
        group.die(members[1])
        controller.tick()
        if controller.done:
            break
        interrupt(group, [members[0]], controller.generation, 3)
        controller.tick()                       # re-forms with a new worker
        controller.tick()
        members = controller.state.members
    assert controller.state.state == RunState.FAILED and attempts == 3
    assert isinstance(controller.error["exception"], NoProgressError)

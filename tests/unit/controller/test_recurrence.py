"""elastic._controller.recurrence: when a broken group is the loop's bug rather than a fault (review F8)."""
import pytest

from elastic._controller.recurrence import ErrorSighting, RecurringErrors

pytestmark = pytest.mark.timeout(10)

SIZE = "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (2), got (3))"
CLOSED = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:{port}"


def failure(step, *messages, error_type="RuntimeError"):
    return [ErrorSighting(rank, step, error_type, m) for rank, m in enumerate(messages)]


def test_the_same_error_at_the_same_step_twice_in_a_row_recurs():
    errors = RecurringErrors(attempts=2)
    assert errors.observe(failure(4, CLOSED.format(port=1), SIZE)) is None       # once: maybe a fault
    found = errors.observe(failure(4, CLOSED.format(port=2), SIZE))
    assert found is not None and found.rank == 1 and found.message == SIZE       # the error, not its echo


def test_numbers_in_messages_do_not_make_errors_different():
    errors = RecurringErrors()
    errors.observe(failure(4, "pair.cc:99 bad shape (2, 3) at 0x7f3a from 10.0.0.2:4000"))
    assert errors.observe(failure(4, "pair.cc:101 bad shape (2, 4) at 0x7f3b from 10.0.0.3:4001")) is not None
    errors = RecurringErrors()
    errors.observe(failure(4, "pair.cc:99 bad shape (2, 3)"))
    assert errors.observe(failure(4, "pair.cc:99 bad dtype (2, 3)")) is None


@pytest.mark.parametrize("second", [
    failure(5, SIZE),                                   # another step: the loop made progress
    failure(4, "ProcessGroupGloo::broadcast: invalid root rank: 5"),   # another error
    failure(4, SIZE, error_type="DistBackendError"),    # another type
    failure(4, CLOSED.format(port=7)),                  # only lost connections this time
])
def test_anything_else_is_still_a_fault(second):
    errors = RecurringErrors()
    errors.observe(failure(4, SIZE, CLOSED.format(port=1)))
    assert errors.observe(second) is None


def test_lost_connections_and_timeouts_never_recur_by_themselves():
    errors = RecurringErrors()
    for _ in range(3):
        assert errors.observe(failure(4, CLOSED.format(port=3), "Application timeout caused pair closure",
                                      "[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")) is None


def test_only_consecutive_failures_count_and_attempts_sets_how_many():
    errors = RecurringErrors(attempts=3)
    assert errors.observe(failure(4, SIZE)) is None
    assert errors.observe(failure(4, SIZE)) is None
    assert errors.observe(failure(4, SIZE)) is not None
    errors = RecurringErrors(attempts=2)
    errors.observe(failure(4, SIZE))
    errors.observe(failure(9, SIZE))
    assert errors.observe(failure(4, SIZE)) is None          # not the failure just before
    assert RecurringErrors(attempts=1).observe(failure(4, SIZE)) is not None
    with pytest.raises(ValueError):
        RecurringErrors(attempts=0)

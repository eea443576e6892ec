"""What an error out of the training thread means to the controller (elastic._worker.classify_error)."""
from __future__ import annotations

import pytest

from checkpointing import CheckpointError, FencedError, StorageError
from elastic._worker import classify_error

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:52138: Connection reset by peer.")


def raised_from(outer: BaseException, cause: BaseException) -> BaseException:
    try:
        raise outer from cause
    except BaseException as error:   # noqa: BLE001
        return error


def test_a_broken_collective_is_a_comm_error_and_user_code_is_user():
    assert classify_error(RuntimeError(GLOO_RESET)) == "comm"
    assert classify_error(ValueError("bad shape")) == "user"
    assert classify_error(RuntimeError("CUDA out of memory")) == "user"


def test_a_save_broken_by_a_dead_peer_is_that_peers_failure_not_a_fatal_checkpoint_error():
    # Seen in CI: a worker killed during the final commit broke rank 0's DCP broadcast; the
    # final-commit check re-raised the save's CheckpointError and the run failed instead of recovering.
    error = raised_from(CheckpointError("writing step 60 to /tmp/run failed"), RuntimeError(GLOO_RESET))
    assert classify_error(error) == "comm"


def test_storage_trouble_is_infra_even_wrapped_and_other_checkpoint_errors_are_fatal():
    assert classify_error(StorageError("refused")) == "infra"
    assert classify_error(raised_from(CheckpointError("save failed"), StorageError("refused"))) == "infra"
    assert classify_error(CheckpointError("3 saves in a row failed")) == "fatal"
    assert classify_error(raised_from(CheckpointError("save failed"), ValueError("not a tensor"))) == "fatal"


@pytest.mark.parametrize("cause", [RuntimeError(GLOO_RESET), StorageError("refused")])
def test_a_fenced_worker_is_fatal_whatever_caused_it(cause):
    assert classify_error(raised_from(FencedError("generation 3 is over"), cause)) == "fatal"

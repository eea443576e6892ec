"""What an error out of the training thread means to the controller (elastic._worker.worker.classify_error)."""
from __future__ import annotations

import pytest

from checkpointing import CheckpointError, FencedError, StorageError
from elastic._worker.worker import classify_error

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


def gloo_timeouts() -> list[BaseException]:
    """The errors of a real gloo collective that times out (its peer never joins), and of the next
    collective on the same group: two ranks of one process-less group, in threads."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    # The server binds a port the OS picks (one picked free beforehand can be taken meanwhile).
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    groups = [None, None]

    def form(rank):
        store = server if rank == 0 else dist.TCPStore("127.0.0.1", server.port, 2, False,
                                                       timeout=datetime.timedelta(seconds=30))
        groups[rank] = (store, dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=1)))
    threads = [threading.Thread(target=form, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    errors = []
    for _ in range(2):
        with pytest.raises(RuntimeError) as caught:
            groups[0][1].allreduce([torch.ones(2)]).wait()
        errors.append(caught.value)
    return errors


def test_a_gloo_collective_timeout_is_a_comm_error_even_where_gloo_is_not_named():
    timed_out, closed = gloo_timeouts()
    assert "Timed out waiting" in str(timed_out) and str(closed) == "Application timeout caused pair closure"
    assert classify_error(timed_out) == classify_error(closed) == "comm"
    # The same messages from a gloo built without source paths in them.
    for message in ("Timed out waiting 30000ms for send operation to complete",
                    "Connection closed by peer [10.0.0.2]:41537"):
        assert classify_error(RuntimeError(message)) == "comm"


@pytest.mark.parametrize("message", [
    "CUDA error: uncorrectable ECC error encountered",
    "CUDA error: GPU has fallen off the bus.",
    "CUDA error: unspecified launch failure\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error: Cuda failure 'uncorrectable ECC error "
    "encountered'",
    "[Rank 1] NCCL watchdog thread terminated with exception: CUDA error: an uncorrectable NVLink error was "
    "detected during the execution",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus",
])
def test_a_failed_gpu_is_a_hardware_error_not_the_users(message):
    assert classify_error(RuntimeError(message)) == "hardware"
    assert classify_error(raised_from(CheckpointError("staging step 40 failed"), RuntimeError(message))) == "hardware"


def test_cuda_errors_of_the_loops_own_making_stay_user_errors():
    import torch
    assert classify_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "user"
    for message in ("CUDA error: device-side assert triggered", "CUDA error: an illegal memory access was encountered",
                    "CUDA error: operation not permitted when stream is capturing", "CUDA error: invalid argument"):
        assert classify_error(torch.AcceleratorError(message)) == "user"
        assert classify_error(RuntimeError(message)) == "user"
    # Any other CUDA runtime error is the device's: the worker is replaced.
    assert classify_error(torch.AcceleratorError("CUDA error: operating system call failed")) == "hardware"
    assert classify_error(ValueError("the xid column is missing")) == "user"     # not a RuntimeError from CUDA

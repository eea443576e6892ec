"""A worker's held poll: answered at once when something happens, not at the end of the hold."""
import copy
import dataclasses
import threading

import pytest

from elastic._protocol import WorkerPhase
from elastic._worker.worker import TrainWorker

pytestmark = pytest.mark.timeout(60)

HOLD_S = 120.0     # far longer than the joins below wait: an answer within them came from news


def held_poll(worker):
    answers = []
    thread = threading.Thread(target=lambda: answers.append(worker.poll(HOLD_S)), daemon=True)
    thread.start()
    return thread, answers


@pytest.mark.parametrize("news", ["phase", "error", "first_step"])
def test_news_answers_a_held_poll_at_once(worker, news):
    worker.poll()                                   # drains any news from construction
    thread, answers = held_poll(worker)
    thread.join(0.5)
    assert thread.is_alive(), "nothing happened: the poll is still held"
    if news == "phase":
        worker._set_phase(WorkerPhase.INTERRUPTED)
    elif news == "error":
        worker._record_error(ValueError("bad batch"))
    else:
        worker._state.outbox.news.set()                 # what TrainContext does after a generation's first step
    thread.join(30)
    assert not thread.is_alive() and len(answers) == 1
    if news == "error":
        assert answers[0].phase == WorkerPhase.FAILED and answers[0].error_type == "ValueError"


def test_a_poll_without_hold_answers_at_once(worker):
    assert worker.poll().phase == WorkerPhase.IDLE


def previous_generation_reported_but_not_returned(worker):
    """A training thread that has reported its error (the controller may act on it) but has not
    returned yet, as on a loaded host (reliability review F15). Returns the gate that lets it end."""
    import time
    gate = threading.Event()

    def run():
        worker._record_error(RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection reset by peer"))
        gate.wait(30)
    worker._thread = threading.Thread(target=run, daemon=True)
    worker._thread.start()
    deadline = time.monotonic() + 20
    while worker.poll(1.0).phase != WorkerPhase.INTERRUPTED:
        assert time.monotonic() < deadline, "the error was never reported"
    return gate


def next_plan():
    from elastic._protocol import GenerationPlan, RestorePlan
    return GenerationPlan(generation=1, rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
                          restore=RestorePlan("broadcast", source_rank=0), timeout_s=5.0)


def test_the_next_generation_waits_for_the_previous_thread_that_already_reported(worker, monkeypatch):
    gate = previous_generation_reported_but_not_returned(worker)
    started, outcome = [], []
    monkeypatch.setattr(worker, "_run_generation", lambda plan: started.append(plan.generation))

    def start():
        try:
            worker.start_generation(next_plan())
            outcome.append("started")
        except Exception as error:   # noqa: BLE001 - the outcome is the assertion
            outcome.append(repr(error))
    caller = threading.Thread(target=start, daemon=True)
    caller.start()
    caller.join(0.5)                 # the old thread is still there: start_generation must wait, not refuse
    gate.set()
    caller.join(20)
    worker._thread.join(5)
    assert outcome == ["started"] and started == [1] and worker.poll().phase == WorkerPhase.RUNNING


def test_a_previous_thread_that_does_not_end_is_still_refused(worker, monkeypatch):
    import elastic._worker.worker as worker_module
    monkeypatch.setattr(worker_module, "PREVIOUS_THREAD_JOIN_S", 0.2)
    gate = previous_generation_reported_but_not_returned(worker)
    try:
        with pytest.raises(RuntimeError, match="did not end within"):
            worker.start_generation(next_plan())
    finally:
        gate.set()


def test_the_storage_is_opened_while_the_worker_is_a_spare_and_a_bad_one_fails_at_the_join(worker, tmp_path):
    # Opened at construction: a spare's first join does not make the group wait for it.
    manager = worker._state.checkpoints.manager
    assert manager is not None and manager.storage.root.endswith(tmp_path.name)
    # A storage this worker's host cannot open (the driver's check passed: a backend missing here).
    unusable = copy.copy(worker._spec.checkpoint)
    object.__setattr__(unusable, "storage", "nosuchscheme://bucket/run")
    spec = dataclasses.replace(worker._spec, checkpoint=unusable)
    spare = TrainWorker(spec)                        # an unusable storage does not stop the worker here
    assert spare._state.checkpoints.manager is None
    from checkpointing import StorageError
    with pytest.raises(StorageError, match="nosuchscheme"):
        spare._state.checkpoints.open(spec)         # what the first join does: the typed error, as before

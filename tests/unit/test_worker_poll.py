"""A worker's held poll: answered at once when something happens, not at the end of the hold."""
import threading

import pytest
from ray import cloudpickle

from elastic._protocol import RunSpec, WorkerPhase
from elastic._worker import TrainWorker

pytestmark = pytest.mark.timeout(60)

HOLD_S = 120.0     # far longer than the joins below wait: an answer within them came from news


def loop(ctx):
    pass


@pytest.fixture
def worker(tmp_path):
    spec = RunSpec(user_code=cloudpickle.dumps((loop, None)), total_steps=1, seed=0, strategy="ddp",
                   use_gpu=False, storage=str(tmp_path), storage_options={}, checkpoint_every=None, keep=1,
                   async_save=False, max_consecutive_failures=1, cpus_per_worker=1.0, collective_timeout_s=5.0)
    return TrainWorker(spec)


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

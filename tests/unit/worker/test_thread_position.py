"""Where the training thread is (elastic/_worker/thread_position.py), without Ray: the marks a
poll reports, the step times (without a generation's first step or checkpoint saves), the held
poll that wakes when a wait grows long, the SYNC mark at the end of a syncing backward, and the
fault gate's stuck rank."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from elastic._protocol import ThreadPlace
from elastic._worker import thread_position
from elastic._worker.fault_gate import STUCK_AT_KEY, HoldAt, HoldTimeoutError, StuckAt, hold_after
from elastic._worker.step_timer import StepTimer, stamp_end_of_backward
from elastic._worker.thread_position import ThreadPosition
from elastic.errors import ConfigError
from support import FakeClock

pytestmark = pytest.mark.timeout(30)


class Progress:
    step = 0


@pytest.fixture
def bound():
    """A position bound to this (the test's) thread, as the worker binds its training thread's."""
    progress, news, clock = Progress(), threading.Event(), FakeClock()
    position = ThreadPosition(completed=lambda: progress.step, news=news, clock=clock)
    position.enter(generation=4)
    yield position, progress, news, clock
    thread_position._bound.position = None


def a_step(position: ThreadPosition, progress: Progress, clock: FakeClock, compute_s: float, wait_s: float) -> None:
    """One step as the framework marks it: compute, the sync, the exchange, the boundary."""
    position.mark(ThreadPlace.COMPUTING)
    clock.advance(compute_s)
    position.mark(ThreadPlace.SYNC)
    clock.advance(wait_s)
    position.mark(ThreadPlace.EXCHANGE)
    progress.step += 1
    position.mark(ThreadPlace.BOUNDARY)


def test_a_wait_inside_the_step_is_reported_and_leaves_the_step_time_whole(bound):
    position, progress, _, clock = bound
    position.mark(ThreadPlace.COMPUTING)
    clock.advance(0.2)
    with thread_position.waiting(ThreadPlace.PIPELINE):     # a stage's recv between micro-batches
        clock.advance(0.3)
        report = position.report()
        assert (report.place, report.age_s) == (ThreadPlace.PIPELINE, pytest.approx(0.3))
    clock.advance(0.1)
    report = position.report()
    assert (report.place, report.age_s, report.nth) == (ThreadPlace.COMPUTING, pytest.approx(0.1), 1)
    position.mark(ThreadPlace.SYNC)
    position.mark(ThreadPlace.EXCHANGE)
    progress.step += 1
    position.mark(ThreadPlace.BOUNDARY)
    assert position.report().step_times == (pytest.approx(0.6),)     # from the compute mark: the wait is in it


def test_the_held_poll_wakes_when_a_pipeline_wait_grows_long():
    shift = [0.0]
    position = ThreadPosition(completed=lambda: 0, news=threading.Event(), clock=lambda: time.monotonic() + shift[0])
    position.mark(ThreadPlace.COMPUTING)
    prior = position.wait_begins(ThreadPlace.PIPELINE)
    shift[0] = 0.9                                      # it has waited 0.9 s: the 1 s crossing is near
    started = time.monotonic()
    position.hold(5.0)
    assert 0.05 < time.monotonic() - started < 0.9
    position.wait_ends(prior)                           # back in its compute: no wake, the hold runs out
    started = time.monotonic()
    position.hold(0.3)
    assert time.monotonic() - started >= 0.3


def test_a_wait_outside_a_worker_marks_nothing():
    with thread_position.waiting(ThreadPlace.PIPELINE):
        assert thread_position.current() is None


def test_a_poll_reports_the_place_step_and_age_and_the_step_times_once(bound):
    position, progress, _, clock = bound
    progress.step = 7
    position.enter(generation=4)
    report = position.report()
    assert (report.generation, report.place, report.step, report.nth) == (4, ThreadPlace.JOINING, 7, 1)
    thread_position.mark(ThreadPlace.RESTORING)          # the module function finds the bound position
    clock.advance(3.0)
    position.mark(ThreadPlace.EXCHANGE)                  # the generation's first step: begun in restore
    progress.step += 1
    position.mark(ThreadPlace.BOUNDARY)
    a_step(position, progress, clock, compute_s=0.2, wait_s=0.05)
    position.mark(ThreadPlace.CHECKPOINT)                # a save after step 9 is not in its step time
    clock.advance(5.0)
    position.mark(ThreadPlace.COMPUTING)
    clock.advance(0.1)
    report = position.report()
    assert (report.place, report.step, report.nth, report.age_s) == (ThreadPlace.COMPUTING, 9, 3, pytest.approx(0.1))
    assert report.step_times == (pytest.approx(0.25),)
    assert position.report().step_times == ()            # handed over once
    position.mark(ThreadPlace.EXCHANGE)
    assert position.report().nth == 3                    # the exchange of the generation's 3rd step


def test_a_new_generation_starts_over_at_joining_with_its_own_step_count(bound):
    position, progress, _, clock = bound
    for _ in range(3):
        a_step(position, progress, clock, 0.1, 0.0)
    position.enter(generation=5)
    report = position.report()
    assert (report.generation, report.place, report.nth, report.step) == (5, ThreadPlace.JOINING, 1, 3)


def test_the_held_poll_wakes_when_a_wait_crosses_one_and_two_seconds_and_on_news():
    shift = [0.0]
    news = threading.Event()
    position = ThreadPosition(completed=lambda: 0, news=news, clock=lambda: time.monotonic() + shift[0])
    position.mark(ThreadPlace.SYNC)
    shift[0] = 0.9                                      # it has waited 0.9 s: the 1 s crossing is near
    started = time.monotonic()
    position.hold(5.0)
    assert 0.05 < time.monotonic() - started < 0.9
    shift[0] = 0.0
    position.mark(ThreadPlace.SYNC)
    shift[0] = 1.85                                     # past 1 s before the hold: the next crossing, 2 s
    started = time.monotonic()
    position.hold(5.0)
    assert 0.1 < time.monotonic() - started < 0.9
    position.mark(ThreadPlace.COMPUTING)                # computing: no wake, the hold runs out
    started = time.monotonic()
    position.hold(0.3)
    assert time.monotonic() - started >= 0.3
    threading.Timer(0.05, news.set).start()
    started = time.monotonic()
    position.hold(5.0)
    assert time.monotonic() - started < 1.0


def test_the_held_poll_also_wakes_when_a_wait_crosses_the_controllers_bound():
    # A learned bound of 2.4 s: a wait that passed the 2 s crossing before the hold began is heard
    # at 2.4 s, not when the hold runs out (the next answer, up to a poll hold later).
    shift = [0.0]
    position = ThreadPosition(completed=lambda: 0, news=threading.Event(), clock=lambda: time.monotonic() + shift[0])
    position.mark(ThreadPlace.SYNC)
    shift[0] = 2.15
    started = time.monotonic()
    position.hold(5.0, wake_s=2.4)
    assert 0.2 < time.monotonic() - started < 0.9
    position.mark(ThreadPlace.COMPUTING)                # computing: the bound wakes nothing either
    started = time.monotonic()
    position.hold(0.3, wake_s=0.1)
    assert time.monotonic() - started >= 0.3


def test_a_syncing_backward_marks_sync_and_one_without_the_sync_does_not(bound):
    position = bound[0]
    timer = StepTimer()
    model = torch.nn.Linear(3, 1)
    model.require_backward_grad_sync = True    # what DDP reads; accumulation turns it off
    stamp_end_of_backward(model, timer)
    timer.start()
    assert position.report().place == ThreadPlace.COMPUTING
    model.require_backward_grad_sync = False
    model(torch.randn(2, 3)).sum().backward()
    assert position.report().place == ThreadPlace.COMPUTING and timer.compute_s() > 0
    model.require_backward_grad_sync = True
    model(torch.randn(2, 3)).sum().backward()
    assert position.report().place == ThreadPlace.SYNC


def test_the_fault_gates_hold_is_announced(bound, tmp_path):
    position, _, news, _ = bound
    open(tmp_path / "go", "w").close()
    hold_after(3, HoldAt(3, str(tmp_path / "go")).as_config())
    assert position.report().place == ThreadPlace.HELD and news.is_set()


def test_a_stuck_rank_stops_moving_once_on_its_rank_only(bound, tmp_path, monkeypatch):
    position = bound[0]
    stuck = StuckAt(5, rank=1, marker_file=str(tmp_path / "stuck"), limit_s=0.05)
    monkeypatch.setenv("RANK", "0")
    hold_after(5, stuck.as_config())                     # another rank: goes on
    monkeypatch.setenv("RANK", "1")
    hold_after(4, stuck.as_config())                     # another step: goes on
    position.mark(ThreadPlace.BOUNDARY)
    with pytest.raises(HoldTimeoutError, match="hang detection missed it"):
        hold_after(5, stuck.as_config())
    assert position.report().place == ThreadPlace.COMPUTING   # as if the next step's compute hung
    hold_after(5, stuck.as_config())                     # fired once: a replacement is not stuck again
    with pytest.raises(ConfigError, match=STUCK_AT_KEY):
        hold_after(5, {STUCK_AT_KEY: (5, 1)})
    with pytest.raises(ConfigError, match="StuckAt.rank"):
        StuckAt(5, rank=-1, marker_file="x")


def test_the_step_after_a_save_or_a_copy_is_reported_and_timed_apart(bound):
    """A save (its CHECKPOINT mark) or a copy (`worked()`) at a boundary tags the next step, whose
    time goes apart from the ordinary ones: the hang judge learns the two kinds apart."""
    position, progress, _, clock = bound
    a_step(position, progress, clock, 0.3, 0.1)               # ordinary
    position.mark(ThreadPlace.CHECKPOINT)                     # a save at this boundary
    clock.advance(0.5)
    position.mark(ThreadPlace.COMPUTING)
    report = position.report()
    assert report.after_work and report.step_times == (pytest.approx(0.4),)   # the save follows it
    clock.advance(1.5)                                         # shares the host with the upload
    position.mark(ThreadPlace.SYNC)
    position.mark(ThreadPlace.EXCHANGE)
    progress.step += 1
    position.mark(ThreadPlace.BOUNDARY)
    thread_position.worked()                                   # a copy to memory at this boundary
    a_step(position, progress, clock, 0.9, 0.1)
    a_step(position, progress, clock, 0.3, 0.1)                # ordinary again
    report = position.report()
    assert not report.after_work
    assert report.step_times == (pytest.approx(0.4),)
    assert report.after_work_times == (pytest.approx(1.5), pytest.approx(1.0))
    position.enter(generation=5)                               # a new generation starts untagged
    position.mark(ThreadPlace.COMPUTING)
    assert not position.report().after_work

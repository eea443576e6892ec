"""A worker that belongs to its run ends itself once the run's controller is gone for good, and
not while the controller is only restarting or polling (no process, no Ray: the watch's loop with
its lookups and its exit stubbed)."""
from __future__ import annotations

import time

import pytest

from elastic._worker import worker as worker_module
from elastic._worker.worker import TrainWorker

pytestmark = pytest.mark.timeout(30)


class Ended(Exception):
    pass


def watch(monkeypatch, *, silent_s: float, gone: list[bool]) -> tuple[list[float], list[int]]:
    """Run the orphan watch of a worker last polled `silent_s` ago, the controller's name found
    missing or not at each look (`gone`, in order; then found); returns when each look was made
    (seconds after the start) and the placement-group removals."""
    import elastic._run_names as names
    looks: list[float] = []
    removed: list[int] = []
    answers = iter(gone)
    started = time.monotonic()

    def lookup(name: str) -> bool:
        assert name == "run.controller"
        looks.append(time.monotonic() - started)
        return next(answers, False)

    def exit_(code: int) -> None:
        raise Ended(code)
    monkeypatch.setattr(worker_module, "ORPHAN_CHECK_S", 0.001)
    monkeypatch.setattr(names, "controller_gone", lookup)
    monkeypatch.setattr(worker_module, "_remove_own_placement_group", lambda: removed.append(1))
    monkeypatch.setattr(worker_module.os, "_exit", exit_)
    worker = object.__new__(TrainWorker)
    worker._polled_at = time.monotonic() - silent_s
    try:
        worker._end_when_orphaned("run.controller")
    except Ended:
        pass
    return looks, removed


def test_a_worker_whose_controller_is_gone_for_good_ends_and_removes_its_placement_group(monkeypatch):
    looks, removed = watch(monkeypatch, silent_s=60.0, gone=[True, False, True, True])
    assert len(looks) == 4 and removed == [1]       # two missing looks in a row, not one


def test_a_restarting_controller_is_waited_for_and_a_polled_worker_looks_nothing_up(monkeypatch):
    monkeypatch.setattr(worker_module, "ORPHAN_QUIET_S", 0.05)
    # Polled just now: no lookup until the polls have been quiet; then the name is found (a
    # restarting actor keeps it) until ORPHAN_AFTER_S passes with no poll at all.
    import elastic._run_names as names
    monkeypatch.setattr(names, "ORPHAN_AFTER_S", 0.3)
    started = time.monotonic()
    looks, removed = watch(monkeypatch, silent_s=0.0, gone=[])
    assert removed == [1] and time.monotonic() - started >= 0.3
    assert looks and looks[0] >= 0.05

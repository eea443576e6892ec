"""R3-1: a broken generation's late commit racing the re-form's planning never leaves the new
generation without the checkpoint it planned from.

The writer is the real CheckpointManager over a local directory (keep=1, so retention deletes
everything but the newest commit); the controller's side is the real GenerationFormer and the
controller's CheckpointView over the same directory. The controller's two storage steps (the
re-form plan, then the fence's start step recorded when the generation forms) are injected at
every pair of points among the late save's storage calls, so every interleaving of the late
commit, its retention and the plan is tried. Before the fix the plan listed before it fenced: a
commit landing between the listing and the fence ran its retention (deleting the planned step)
and was then hidden by the fence's start step, leaving nothing committed.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fakes import FakeCheckpoints, NoNodeCopies

from checkpointing import CheckpointError, CheckpointManager
from elastic._controller.actor import CheckpointView
from elastic._controller.forming import GenerationFormer
from elastic._protocol import RestoreKind, RestorePlan
from elastic.config import FailureConfig

_STORAGE_CALLS = ("read_bytes", "open_read", "exists", "size", "listdir", "find", "makedirs", "open_write",
                  "write_atomic", "read_versioned", "put_if", "rm", "rmdir_if_empty")


def _former(view: Any, generation: int) -> GenerationFormer:
    """A former over `view`, its storage calls made at once (reform_plan's whole use of storage)."""
    former = GenerationFormer(NoNodeCopies(), view, lambda what, fn: (True, fn()),  # type: ignore[arg-type]
                              failure=FailureConfig(), clock=lambda: 0.0)
    former.generation = generation
    return former


def _instrument(manager: CheckpointManager, at: dict[int, Callable[[], None]]) -> list[str]:
    """Run at[k] right before the writer's k-th storage call; returns the calls' names."""
    calls: list[str] = []
    storage = manager.storage
    for name in _STORAGE_CALLS:
        original = getattr(storage, name)

        def wrapped(*args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            action = at.pop(len(calls), None)
            calls.append(__name)
            if action is not None:
                action()
            return __original(*args, **kwargs)
        setattr(storage, name, wrapped)
    return calls


def _late_commit_race(url: str, plan_at: int, record_at: int) -> tuple[RestorePlan, int | None]:
    """Generation 1 committed step 100 and commits 125 late, after its group broke; the controller
    plans generation 2 (fence, list) before the writer's call `plan_at` and records the plan's
    start step before call `record_at`. Returns the plan and the newest step committed after."""
    writer = CheckpointManager(url, keep=1, async_save=False)
    writer.set_generation(1, start_step=0)
    writer.save(100, {"w": torch.ones(4)}, generation=1)
    view = CheckpointView(url, None, keep=1)
    former = _former(view, generation=1)
    planned: list[RestorePlan] = []

    def plan() -> None:
        ok, restore = former.reform_plan([0], {})
        assert ok and restore is not None
        planned.append(restore)

    def record() -> None:
        view.fence(former.generation + 1, start_step=planned[0].step)   # what form() writes

    at: dict[int, Callable[[], None]] = ({plan_at: lambda: (plan(), record())[0]} if plan_at == record_at
                                         else {plan_at: plan, record_at: record})
    calls = _instrument(writer, at)
    try:
        writer.save(125, {"w": torch.full((4,), 2.0)}, generation=1)
    except CheckpointError:
        pass    # fenced: the late commit was refused
    for k in sorted(at):      # points past the save's last call: after it
        at.pop(k)()
    assert calls, "the save made no storage call"
    return planned[0], CheckpointView(url, None, keep=1).latest_step()


def _save_calls(tmp_path) -> int:
    writer = CheckpointManager(str(tmp_path / "count"), keep=1, async_save=False)
    writer.set_generation(1, start_step=0)
    writer.save(100, {"w": torch.ones(4)}, generation=1)
    calls = _instrument(writer, {})
    writer.save(125, {"w": torch.full((4,), 2.0)}, generation=1)
    return len(calls)


@pytest.mark.timeout(120)
def test_a_late_commit_at_any_point_of_the_plan_leaves_the_planned_checkpoint(tmp_path):
    n = _save_calls(tmp_path)
    points = [(p, r) for p, r in itertools.combinations_with_replacement(range(n + 1), 2)]
    # Every plan point with the record right after it, at the end, and a seeded sample between.
    chosen = {(p, p) for p in range(n + 1)} | {(p, n) for p in range(n + 1)}
    chosen |= set(random.Random(1).sample(points, min(40, len(points))))
    for i, (plan_at, record_at) in enumerate(sorted(chosen)):
        plan, newest = _late_commit_race(str(tmp_path / f"run{i}"), plan_at, record_at)
        assert plan.kind == RestoreKind.CHECKPOINT, (plan_at, record_at, plan)
        assert newest == plan.step, (f"plan at call {plan_at}, start step recorded at call {record_at} of "
                                     f"{n}: planned step {plan.step}, newest committed now {newest}")


def test_the_re_form_fences_before_it_lists_and_records_the_start_step_after():
    checkpoints = FakeCheckpoints(latest=40, fence=3)
    former = _former(checkpoints, generation=3)
    ok, plan = former.reform_plan([0, 1], {})
    assert ok and plan is not None and plan.kind == RestoreKind.CHECKPOINT and plan.step == 40
    assert checkpoints.calls == [("fence", 4, None), ("list",)]

"""Ray as the worker group sees it, faked: actors whose methods return set outcomes, and a
`ray` module whose get/wait/kill act on them (the `fake_ray` fixture of conftest.py installs it)."""
from __future__ import annotations

from ray.exceptions import RayTaskError

from elastic._controller.slot_table import READY, Slot
from elastic._controller.worker_group import RayWorkerGroup
from elastic._protocol import RunSpec
from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig


def task_error(method: str, message: str) -> RayTaskError:
    """What ray.get raises when the actor's method raised RuntimeError(message)."""
    return RayTaskError(method, f"Traceback (most recent call last):\n  ...\nRuntimeError: {message}",
                        RuntimeError(message)).as_instanceof_cause()


class Ref:
    def __init__(self, outcome):
        self.outcome = outcome


class Method:
    def __init__(self, outcome):
        self.outcome = outcome

    def remote(self, *args):
        return Ref(self.outcome)


class Actor:
    def __init__(self, **outcomes):
        for name, outcome in outcomes.items():
            setattr(self, name, Method(outcome))


class FakeRay:
    def __init__(self):
        self.killed = []

    def get(self, ref, timeout=None):
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome

    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs), []

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)


def spec_of(scaling: ScalingConfig, failure: FailureConfig) -> RunSpec:
    """A run's spec that carries `scaling` and `failure` (the group reads nothing else of it
    until it launches an actor, which these fakes never do)."""
    return RunSpec(user_code=b"", total_steps=1, seed=0, scaling=scaling,
                   checkpoint=CheckpointConfig(storage="memory://unused"), failure=failure)


def group_of(*actors) -> RayWorkerGroup:
    group = RayWorkerGroup(spec_of(ScalingConfig(min_workers=1, max_workers=len(actors)),
                                   FailureConfig(heartbeat_timeout_s=5.0)))
    for wid, actor in enumerate(actors):
        group._slots.add(Slot(wid=wid, pg=None, pg_ready=None, created_at=0.0, status=READY, actor=actor,
                              last_answer_at=0.0))
    return group

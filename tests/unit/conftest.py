"""Fixtures of the unit tests (no Ray): a one-rank gloo group in this process, and a real
TrainContext over it, which covers most of the worker side."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank_group():
    # Port 0: the store binds a port the OS picks. A port picked free beforehand can be taken by
    # another process before the store binds it; the likely cause of the one abort seen in CI
    # ("Fatal Python error: Aborted" in a native thread while the main one was on this line).
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Generations:
    """Builds one TrainContext per generation over the same WorkerState, as a worker does."""

    def __init__(self, storage: str, *, total_steps: int = 100, strategy: str = "ddp",
                 checkpoint_every: int | None = None, in_memory_every: int | None = None,
                 on_nonfinite_loss: str = "fail"):
        from elastic._protocol import RunSpec
        from elastic._worker.state import WorkerState
        from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
        self.spec = RunSpec(user_code=b"", total_steps=total_steps, seed=0, scaling=ScalingConfig(strategy=strategy),
                            checkpoint=CheckpointConfig(storage=storage, every_n_steps=checkpoint_every, keep=None,
                                                        async_save=False, in_memory_every_n_steps=in_memory_every),
                            failure=FailureConfig(on_nonfinite_loss=on_nonfinite_loss))
        self.worker = WorkerState()
        self.generation = 0

    def context(self, restore: str = "fresh", source_rank: int | None = None, step: int | None = None):
        from elastic._protocol import GenerationPlan, RestorePlan
        from elastic.context import TrainContext
        self.generation += 1
        plan = GenerationPlan(generation=self.generation, rank=0, world_size=1, master_addr="127.0.0.1",
                              master_port=0, restore=RestorePlan(restore, source_rank=source_rank, step=step),
                              timeout_s=60.0)
        return TrainContext(plan=plan, spec=self.spec, worker=self.worker, loop_config=None,
                            stop_requested=threading.Event(), preempted=threading.Event(),
                            device=torch.device("cpu"))

    def close(self) -> None:
        if self.worker.checkpoints.manager is not None:
            self.worker.checkpoints.manager.close()


@pytest.fixture
def generations(one_rank_group, tmp_path):
    """`generations.context(restore)`: the next generation's TrainContext on the one-rank group."""
    made: list[Generations] = []

    def make(**spec) -> Generations:
        made.append(Generations(str(tmp_path / f"run{len(made)}"), **spec))
        return made[-1]
    yield make
    for g in made:
        g.close()

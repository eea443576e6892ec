"""Fixtures of the worker's unit tests."""
import pytest
from ray import cloudpickle

from elastic._protocol import RunSpec
from elastic._worker.worker import TrainWorker
from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig


def _loop(ctx):
    pass


@pytest.fixture
def worker(tmp_path):
    """A TrainWorker in this process (no Ray, no group), for a one-step DDP run on `tmp_path`."""
    spec = RunSpec(user_code=cloudpickle.dumps((_loop, None)), total_steps=1, seed=0,
                   scaling=ScalingConfig(strategy="ddp", use_gpu=False),
                   checkpoint=CheckpointConfig(storage=str(tmp_path), keep=1,
                                               async_save=False, max_consecutive_failures=1),
                   failure=FailureConfig(collective_timeout_s=5.0))
    return TrainWorker(spec)

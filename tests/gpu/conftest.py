"""Fixtures of the GPU suite (`make test-gpu`): a one-rank NCCL process group in this process
and a local Ray instance with one GPU (the fault helpers are tests/support.py's).

Every module here is skipped where CUDA is missing; nothing in this file touches CUDA until a
fixture runs, so the suite collects (and skips) on a CPU machine.
"""
import datetime

import pytest

from chaos.services import free_port


@pytest.fixture
def nccl_group():
    """A real NCCL process group of one rank on cuda:0 (no Ray), formed as the worker forms its
    group (tcp:// rendezvous, device set first), destroyed afterwards."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="session")
def _ray_shutdown_at_end():
    yield
    import ray
    ray.shutdown()


@pytest.fixture
def ray_gpu(_ray_shutdown_at_end):
    """A local Ray instance with one GPU, shared by the tests that need one. A Ray started by
    another suite in this session without a GPU is replaced."""
    import ray
    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) < 1:
        ray.shutdown()
    if not ray.is_initialized():
        # address="local": always a new instance, never a cluster someone started on this machine.
        ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, configure_logging=True,
                 logging_level="WARNING")
    return ray


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")

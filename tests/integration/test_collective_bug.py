"""A bug in the loop's collectives, end to end on a local Ray (reliability review F8): gloo
reports it as a broken process group, which is retried once; when it breaks the group again at
the same step, the run fails with the original error, type and traceback, instead of retrying
until max_failures and ending on a count of failures."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from support import read_json

pytestmark = [pytest.mark.integration]


def wrong_gather_at_step_3(ctx):
    """Rank 0 gathers into buffers of the wrong size at step 3; rank 1 waits for it in vain."""
    model = ctx.prepare_model(torch.nn.Linear(4, 1))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = ctx.prepare_data([torch.randn(4) for _ in range(64)], batch_size=2)
    ctx.restore(model=model, optimizer=optimizer)
    for batch in loader:
        if ctx.step == 3:
            size = 3 if ctx.rank == 0 else 2
            dist.all_gather([torch.zeros(size) for _ in range(ctx.world_size)], torch.ones(2))
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.report(loss=0.0)


@pytest.mark.timeout(240)
def test_a_collective_bug_fails_the_run_with_its_own_error_after_one_retry(ray_session, run_dir):
    result = ElasticTrainer(
        wrong_gather_at_step_3, total_steps=50, seed=0,
        scaling=ScalingConfig(min_workers=2, max_workers=2, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir),
        failure=FailureConfig(heartbeat_timeout_s=3.0, max_failures=20, collective_timeout_s=30.0,
                              rendezvous_timeout_s=60.0)).fit()
    assert not result.ok and isinstance(result.error, RuntimeError), result.error
    assert "ProcessGroupGloo::allgather: invalid tensor size" in str(result.error)
    assert "wrong_gather_at_step_3" in result.error_traceback
    s = result.summary
    assert s["status"] == "failed" and s["final_step"] == 3
    # One retry (generation 1), not twenty; the retry's recovery never completed a step, so it is
    # not among the summary's recoveries.
    assert read_json(run_dir, "status.json")["generation"] == 1
    assert s["error"]["type"] == "RuntimeError" and "invalid tensor size" in s["error"]["message"]
    assert "wrong_gather_at_step_3" in s["error"]["traceback"]

"""A training thread stuck while its process answers polls (a hung kernel, a dead data service) is
found from where the training threads are, within the bound learned from the step times
(elastic/_controller/hang_watch.py), not after the collective timeout; the rank is replaced and
the run finishes."""
from __future__ import annotations

import os

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from elastic._worker.fault_gate import StuckAt

pytestmark = [pytest.mark.integration]

TINY = {"model_size": "tiny", "batch_size": 8}


@pytest.mark.timeout(180)
def test_a_rank_whose_training_thread_is_stuck_is_declared_hung_within_the_bound_and_replaced(ray_session,
                                                                                               run_dir):
    marker = run_dir.rstrip("/") + ".stuck"
    stuck = StuckAt(30, rank=1, marker_file=marker)
    # Timeouts that cannot be what finds it: the collective timeout is 60 s and the heartbeat sees a
    # process that answers. The default hang bound: tiny steps take well under 0.5 s, so 2 s.
    failure = FailureConfig(collective_timeout_s=60.0)
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config={**TINY, **stuck.as_config()}, total_steps=60, seed=0,
        scaling=ScalingConfig(min_workers=2, max_workers=2, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir), failure=failure).fit()
    assert os.path.exists(marker), "the rank never got stuck"
    assert result.ok and result.final_step == 60, result.error
    (recovery,) = result.summary["recoveries"]
    assert recovery["cause"] == "hang" and [f["ranks"] for f in recovery["failures"]] == [[1]], recovery
    # detect_s: since its thread last moved (the stuck compute began), at most the bound + 2 s.
    assert recovery["detect_s"] <= FailureConfig.HANG_FLOOR_S + 2.0, recovery
    assert recovery["rung"] == "warm" and recovery["lost_steps"] <= 1 and recovery["to_world"] == 2

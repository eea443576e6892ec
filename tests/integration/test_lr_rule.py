"""The linear LR rule through a real rescale: 4 -> 3 on a kill, then back to 4. The run waits for
all 4 workers at start (startup_wait_s): its expected numbers assume it begins at full size."""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest

import gpt
import support
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, LRScalingConfig, ScalingConfig
from support import ShrunkHold, SignalAtStep

pytestmark = [pytest.mark.integration]

BASE_LR = 1e-3


def held_while_shrunk(ctx) -> None:
    gpt.train_loop(ShrunkHold.wrap(ctx))


@pytest.mark.timeout(240)
def test_linear_rule_drops_at_once_ramps_back_and_never_restarts_warmup(ray_session, run_dir):
    from ray import cloudpickle
    for module in (gpt, support, sys.modules[__name__]):     # the workers import none of them
        cloudpickle.register_pickle_by_value(module)
    fault = SignalAtStep(run_dir, at_step=30, sig=signal.SIGKILL, rank=1)
    # The group of 3 waits after its 10th step until the replacement is ready: the regrowth and
    # the 21 steps of its ramp land inside 120 steps however slowly the replacement starts.
    hold = ShrunkHold(3, 10, run_dir.rstrip("/") + ".regrow")
    fault.start()
    hold.release_when(run_dir, lambda status: status.get("world_size") == 3 and status.get("spares"), 180,
                      "the replacement ready beside the group of 3")
    result = ElasticTrainer(
        held_while_shrunk, train_loop_config={"model_size": "tiny", "batch_size": 8, "lr": BASE_LR,
                                              **fault.hold_config(), **hold.as_config()},
        total_steps=120, seed=0, scaling=ScalingConfig(min_workers=3, max_workers=4, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=1000), failure=FailureConfig(max_failures=3),
        lr=LRScalingConfig(base_world_size=4, warmup_steps=10, rescale_warmup_steps=20, schedule="constant")).fit()
    fault.join(timeout=5)
    assert fault.fired() and result.ok, result.error_traceback
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    lr = {m["step"]: m["lr"] / BASE_LR for m in metrics}
    world = {m["step"]: m["world_size"] for m in metrics}
    # Warmup by global step: step s (1-based) ran with factor s/10.
    assert [round(lr[s], 6) for s in range(1, 11)] == [round(s / 10, 6) for s in range(1, 11)]
    at_three = [s for s in world if world[s] == 3]
    assert at_three and all(lr[s] == pytest.approx(0.75) for s in at_three)     # the drop applies at once
    regrown = [s for s in sorted(world) if world[s] == 4 and s > at_three[0]]
    assert len(regrown) > 20, "the run never grew back to 4 workers"
    ramp = [lr[s] for s in regrown[:21]]
    assert ramp[0] == pytest.approx(0.75 + 0.25 / 20) and ramp[9] == pytest.approx(0.75 + 0.25 * 10 / 20)
    assert ramp[19] == pytest.approx(1.0) and ramp[20] == pytest.approx(1.0)
    assert min(lr[s] for s in lr if s > 10) >= 0.75 - 1e-9                      # warmup never restarted
    assert result.summary["config"]["lr"]["base_world_size"] == 4


@pytest.mark.timeout(240)
def test_a_resume_at_another_world_size_ramps_from_the_checkpointed_scale(ray_session, run_dir):
    def fit(workers, steps):
        return ElasticTrainer(
            gpt.train_loop, train_loop_config={"model_size": "tiny", "batch_size": 8, "lr": BASE_LR},
            total_steps=steps, seed=0, scaling=ScalingConfig(min_workers=workers, max_workers=workers),
            checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=10),
            lr=LRScalingConfig(base_world_size=2, warmup_steps=5, rescale_warmup_steps=10,
                               schedule="constant")).fit()

    assert fit(2, 20).ok
    second = fit(3, 40)
    assert second.ok and second.summary["resumed_from"] == 20, second.error_traceback
    lr = {m["step"]: m["lr"] / BASE_LR for m in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))}
    assert lr[20] == pytest.approx(1.0)                      # world 2 at base_world_size 2
    assert lr[21] == pytest.approx(1.0 + 0.5 / 10)           # ramping to 3/2, not restarting the warmup
    assert lr[30] == pytest.approx(1.5) and lr[40] == pytest.approx(1.5)

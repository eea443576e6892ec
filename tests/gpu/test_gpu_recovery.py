"""The runtime on one GPU (local Ray, NCCL at world size 1): SIGKILL of the only worker, found by
its pid in status.json like an operator would; a new worker takes the GPU over, forms a new NCCL
group and resumes from the last committed checkpoint; the run finishes with the recovery recorded."""
import json
import math
import os
import signal

import pytest
import torch

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from support import SignalAtStep, pid_alive, read_json

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

TINY = {"model_size": "tiny", "batch_size": 8}


def on_device_loop(ctx):
    """The example's loop, also reporting where it runs: 1.0 when the rank's device is CUDA and
    its group NCCL (metrics.jsonl shows every step's)."""
    import torch.distributed as dist

    class Reporting:
        def __getattr__(self, name):
            return getattr(ctx, name)

        def report(self, **metrics):
            on_gpu = ctx.device.type == "cuda" and dist.get_backend() == "nccl"
            return ctx.report(on_gpu=1.0 if on_gpu else 0.0, **metrics)

    gpt.train_loop(Reporting())


def fit(run_dir, fault, *, steps, every, use_gpu=True):
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(gpt)     # the loop here calls the example's by name
    fault.start()
    result = ElasticTrainer(
        on_device_loop, train_loop_config={**TINY, **fault.hold_config()}, total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=1, max_workers=1, use_gpu=use_gpu, startup_wait_s=60),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=every),
        failure=FailureConfig(heartbeat_timeout_s=10, max_failures=3, collective_timeout_s=30,
                              rendezvous_timeout_s=60)).fit()
    fault.join(timeout=5)
    assert fault.fired(), f"the fault never fired (run ended at step {result.final_step})"
    return result


def test_sigkill_of_the_only_gpu_worker_is_replaced_and_the_run_finishes(ray_gpu, run_dir):
    # Held after step 15 until the kill, sent once the commit of step 10 shows: it lands 5 steps
    # after that commit.
    fault = SignalAtStep(run_dir, at_step=15, sig=signal.SIGKILL, rank=0,
                         when=lambda status: status.get("last_committed_step") == 10)
    result = fit(run_dir, fault, steps=40, every=10)
    s = result.summary
    assert result.ok, result.error_traceback
    assert s["status"] == "finished" and s["final_step"] == 40
    assert s["config"]["scaling"]["use_gpu"] is True
    (recovery,) = s["recoveries"]
    assert recovery["cause"] == "worker_died" and (recovery["from_world"], recovery["to_world"]) == (1, 1)
    # No survivor holds the state: the new worker loads the commit of step 10 and redoes 11..15.
    assert recovery["rung"] == "checkpoint" and recovery["step"] == 10 and recovery["lost_steps"] == 5, recovery
    assert s["checkpoints"][-1] == 40
    assert not pid_alive(fault.pid)
    assert all(w["pid"] != fault.pid for w in read_json(run_dir, "status.json")["workers"])
    assert math.isfinite(s["loss_last"]) and s["loss_last"] < s["loss_first"]
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == list(range(1, 41))               # the redone steps once each
    assert {m.get("on_gpu") for m in lines} == {1.0}                      # CUDA and NCCL before and after

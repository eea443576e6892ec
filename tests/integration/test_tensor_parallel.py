"""Tensor parallelism end to end on a local Ray: TP 2 x DP 3 of the example GPT (Megatron's plan,
examples/gpt.py), a SIGKILL of one rank, the replica leaving whole, and the group growing back,
each TP rank's shard restored from the same TP rank of a surviving replica."""
from __future__ import annotations

import json
import os
import signal

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from run_file_schemas import validate_run
from support import SignalAtStep, read_json
from test_runtime import _steps_at, expected_data_order, metrics_steps

pytestmark = [pytest.mark.integration]


def counting_loads(ctx) -> None:
    """The example's loop, each checkpoint load noted in a file beside the run (a storage read
    counter the workers write and the test reads)."""
    from checkpointing import CheckpointManager
    loads_file = ctx.config["loads_file"]
    original = CheckpointManager.load_latest
    if not getattr(original, "counted", False):
        def load_latest(self, *args, **kwargs):
            with open(loads_file, "a") as out:
                out.write(f"{os.getpid()}\n")
            return original(self, *args, **kwargs)
        load_latest.counted = True          # type: ignore[attr-defined]
        CheckpointManager.load_latest = load_latest    # type: ignore[method-assign]
    gpt.train_loop(ctx)


@pytest.mark.timeout(420)
def test_a_killed_tp_rank_takes_its_replica_out_then_the_replica_heals_from_peers_memory(ray_session, run_dir):
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(gpt)    # the loop below calls the example's, which workers cannot import
    loads_file = run_dir.rstrip("/") + ".loads"
    fault = SignalAtStep(run_dir, at_step=30, sig=signal.SIGKILL, rank=3)
    config = {"model_size": "tiny", "batch_size": 8, "loads_file": loads_file, **fault.hold_config()}
    fault.start()
    result = ElasticTrainer(
        counting_loads, train_loop_config=config, total_steps=150, seed=0,
        scaling=ScalingConfig(min_workers=4, max_workers=6, tensor_parallel_size=2, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=50),
        failure=FailureConfig(heartbeat_timeout_s=10.0, collective_timeout_s=30.0, rendezvous_timeout_s=60.0),
    ).fit()
    fault.join(timeout=5)
    assert fault.fired() and result.ok, result.error_traceback
    s = result.summary
    assert s["final_step"] == 150 and s["checkpoints"] == [50, 100, 150]
    # 6 ranks (DP 3) -> the killed rank's replica leaves: 4 (DP 2) -> a replacement completes it: 6.
    assert [w for _, w in s["world_size_history"]] == [6, 4, 6], s["world_size_history"]
    assert [layout for _, layout in s["layout_history"]] == [
        {"dp": 3, "tp": 2, "pp": 1}, {"dp": 2, "tp": 2, "pp": 1}, {"dp": 3, "tp": 2, "pp": 1}]
    died, grew = s["recoveries"]
    assert died["cause"] == "worker_died" and died["rung"] == "warm" and died["lost_steps"] == 0, died
    assert died["from_world"] == 6 and died["to_world"] == 4
    assert grew["cause"] == "scale_up" and grew["rung"] == "warm" and grew["to_world"] == 6, grew
    assert "TP shards" in died["reason"] and "TP shards" in grew["reason"]
    # No checkpoint was read: every restore came from the members' memory.
    assert not os.path.exists(loads_file), open(loads_file).read()
    # Each step once; the data exactly once, counted per replica (8 samples each, DP 3 then 2).
    assert metrics_steps(run_dir) == list(range(1, 151))
    assert s["samples_consumed"] == 8 * (3 * _steps_at(s, 6) + 2 * _steps_at(s, 4))
    assert s["data_order_sha256"] == expected_data_order(s["samples_consumed"])
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert {m["global_batch"] for m in lines} == {16, 24}
    status = read_json(run_dir, "status.json")
    assert status["layout"] == {"dp": 3, "tp": 2, "pp": 1}
    assert [(w["replica"], w["tp_rank"]) for w in status["workers"]] == [(d, t) for d in range(3) for t in range(2)]
    assert validate_run(run_dir) == {"status.json": 1, "summary.json": 1, "metrics.jsonl": 150}

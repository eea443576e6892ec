"""Tensor parallelism end to end on a local Ray: TP 2 x DP 3 of the example GPT (Megatron's plan,
examples/gpt.py), a SIGKILL of one rank, the replica leaving whole, and the group growing back,
each TP rank's shard restored from the same TP rank of a surviving replica."""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest

import gpt
import support
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, LRScalingConfig, ScalingConfig
from run_file_schemas import validate_run
from support import ShrunkHold, SignalAtStep, read_json
from test_runtime import _steps_at, expected_data_order, metrics_steps

pytestmark = [pytest.mark.integration]

STEPS = 100         # the kill/heal run: checkpoints at 50 and 100; the resumes go 5 and 10 steps on


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


def counting_loads_held_while_shrunk(ctx) -> None:
    counting_loads(ShrunkHold.wrap(ctx))


@pytest.mark.timeout(420)
def test_a_killed_tp_rank_takes_its_replica_out_then_the_replica_heals_from_peers_memory(ray_session, run_dir):
    from ray import cloudpickle
    # The loop below (and the hold it wraps the context in) calls the example's, which workers cannot import.
    for module in (gpt, support, sys.modules[__name__]):
        cloudpickle.register_pickle_by_value(module)
    loads_file = run_dir.rstrip("/") + ".loads"
    fault = SignalAtStep(run_dir, at_step=30, sig=signal.SIGKILL, rank=3)
    # The replica that is left (DP 2) waits after its 10th step until the killed rank's TP peer and
    # its replacement are ready (a whole replica): the regrowth lands before the checkpoint at 50
    # however slowly the replacement starts, and the run needs no steps of margin for it.
    hold = ShrunkHold(4, 10, run_dir.rstrip("/") + ".regrow")
    config = {"model_size": "tiny", "batch_size": 8, "loads_file": loads_file, **fault.hold_config(),
              **hold.as_config()}
    fault.start()
    hold.release_when(run_dir, lambda status: status.get("world_size") == 4 and len(status.get("spares") or []) >= 2,
                      180, "the lost replica's two workers ready beside the group of 4")
    result = ElasticTrainer(
        counting_loads_held_while_shrunk, train_loop_config=config, total_steps=STEPS, seed=0,
        scaling=ScalingConfig(min_workers=4, max_workers=6, tensor_parallel_size=2, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=50),
        failure=FailureConfig(heartbeat_timeout_s=10.0, collective_timeout_s=30.0, rendezvous_timeout_s=60.0),
    ).fit()
    fault.join(timeout=5)
    assert fault.fired() and result.ok, result.error_traceback
    s = result.summary
    assert s["final_step"] == STEPS and s["checkpoints"] == [50, 100]
    # 6 ranks (DP 3) -> the killed rank's replica leaves: 4 (DP 2) -> a replacement completes it: 6.
    assert [w for _, w in s["world_size_history"]] == [6, 4, 6], s["world_size_history"]
    assert [layout for _, layout in s["layout_history"]] == [
        {"dp": 3, "tp": 2, "pp": 1}, {"dp": 2, "tp": 2, "pp": 1}, {"dp": 3, "tp": 2, "pp": 1}]
    died, grew = s["recoveries"]
    assert died["cause"] == "worker_died" and died["rung"] == "warm" and died["lost_steps"] == 0, died
    assert died["from_world"] == 6 and died["to_world"] == 4
    assert grew["cause"] == "scale_up" and grew["rung"] == "warm" and grew["to_world"] == 6, grew
    assert "model shards (all 2 places" in died["reason"] and "model shards (all 2 places" in grew["reason"]
    # No checkpoint was read: every restore came from the members' memory.
    assert not os.path.exists(loads_file), open(loads_file).read()
    # Each step once; the data exactly once, counted per replica (8 samples each, DP 3 then 2).
    assert metrics_steps(run_dir) == list(range(1, STEPS + 1))
    assert s["samples_consumed"] == 8 * (3 * _steps_at(s, 6) + 2 * _steps_at(s, 4))
    assert s["data_order_sha256"] == expected_data_order(s["samples_consumed"])
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert {m["global_batch"] for m in lines} == {16, 24}
    status = read_json(run_dir, "status.json")
    assert status["layout"] == {"dp": 3, "tp": 2, "pp": 1}
    assert [(w["replica"], w["tp_rank"]) for w in status["workers"]] == [(d, t) for d in range(3) for t in range(2)]
    assert validate_run(run_dir) == {"status.json": 1, "summary.json": 1, "metrics.jsonl": STEPS}
    _resume_across_tensor_parallel_degrees(run_dir, loads_file)


def _resume(run_dir: str, tp: int, steps: int, loads_file: str) -> tuple[dict, list[dict]]:
    """The run on `run_dir` resumed to `steps` at TP `tp` x DP 2."""
    result = ElasticTrainer(
        counting_loads, train_loop_config={"model_size": "tiny", "batch_size": 8, "loads_file": loads_file},
        total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=2 * tp, tensor_parallel_size=tp, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=5),
        failure=FailureConfig(collective_timeout_s=30.0, rendezvous_timeout_s=60.0)).fit()
    assert result.ok, result.error_traceback
    return result.summary, [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _resume_across_tensor_parallel_degrees(run_dir: str, loads_file: str) -> None:
    """From the TP 2 run's last checkpoint (step STEPS): a copy resumes at TP 1 (2 -> 1) for 5
    steps, then at TP 2 again (1 -> 2) for 5; the run itself resumes at TP 2 for the same 10
    steps. The same data-parallel degree (2) throughout: the same samples, LR and, up to the
    sums' order, the same losses."""
    import shutil
    switched = run_dir.rstrip("/") + "-switched"
    shutil.copytree(run_dir, switched)
    first, _ = _resume(switched, 1, STEPS + 5, loads_file)                  # 2 -> 1
    assert first["resumed_from"] == STEPS and first["layout_history"][0] == [STEPS, {"dp": 2, "tp": 1, "pp": 1}]
    then, lines_switched = _resume(switched, 2, STEPS + 10, loads_file)     # 1 -> 2
    assert then["resumed_from"] == STEPS + 5 and then["layout_history"][0] == [STEPS + 5, {"dp": 2, "tp": 2, "pp": 1}]
    kept, lines_kept = _resume(run_dir, 2, STEPS + 10, loads_file)
    assert [m["step"] for m in lines_switched] == list(range(1, STEPS + 11)) == [m["step"] for m in lines_kept]
    assert then["data_order_sha256"] == kept["data_order_sha256"] == expected_data_order(kept["samples_consumed"])
    for a, b in zip(lines_switched[STEPS:], lines_kept[STEPS:], strict=True):
        assert a["lr"] == b["lr"] and a["global_batch"] == b["global_batch"] == 16
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), (a["step"], a["loss"], b["loss"])
    # Each resume read the checkpoint once per rank (2, 4 and 4 ranks), and nothing else did.
    assert len(open(loads_file).read().split()) == 10


def _tp_run(run_dir: str, fault: SignalAtStep | None = None, spare_workers: int = 0):
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(gpt)
    config = {"model_size": "tiny", "batch_size": 4, "optimizer": "sgd", "lr": 0.05}
    if fault is not None:
        config.update(fault.hold_config())
        fault.start()
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config=config, total_steps=40, seed=0,
        scaling=ScalingConfig(min_workers=4, max_workers=4, tensor_parallel_size=2, startup_wait_s=120,
                              spare_workers=spare_workers),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=1000),
        failure=FailureConfig(heartbeat_timeout_s=10.0, collective_timeout_s=30.0, rendezvous_timeout_s=60.0),
        lr=LRScalingConfig(base_world_size=2, warmup_steps=5, mode="constant_global_batch")).fit()
    if fault is not None:
        fault.join(timeout=5)
        assert fault.fired(), f"the fault never fired (run ended at step {result.final_step})"
    assert result.ok, result.error_traceback
    return result.summary


@pytest.mark.timeout(420)
def test_constant_batch_kill_and_regrow_of_a_tp_replica_ends_bitwise_on_the_fault_free_model(ray_session, tmp_path):
    """TP 2 x DP 2 with a spare replica's worth of workers: a killed rank's replica is rebuilt at
    once from the lost rank's peer and a spare, warm from the other replica, and the run ends on
    the fault-free run's model bit for bit, with the same samples in the same order."""
    clean = _tp_run(str(tmp_path / "clean"))
    faulty_dir = str(tmp_path / "faulty")
    fault = SignalAtStep(faulty_dir, at_step=20, sig=signal.SIGKILL, rank=2,
                         when=lambda status: len(status["spares"]) == 2)
    faulty = _tp_run(faulty_dir, fault, spare_workers=2)
    (recovery,) = faulty["recoveries"]
    assert recovery["cause"] == "worker_died" and recovery["rung"] == "warm" and recovery["lost_steps"] == 0
    assert [w for _, w in faulty["world_size_history"]] == [4, 4]
    assert faulty["model_sha256"] == clean["model_sha256"] and len(clean["model_sha256"]) == 64
    assert faulty["samples_consumed"] == clean["samples_consumed"] == 40 * 2 * 4
    assert faulty["data_order_sha256"] == clean["data_order_sha256"] == expected_data_order(40 * 2 * 4)


@pytest.mark.timeout(420)
def test_fsdp_x_tp_heals_a_killed_rank_from_the_copies_in_memory(ray_session, run_dir):
    """FSDP x TP (2-D), TP 2 x DP 2: the killed rank's replica leaves, the other goes on at DP 1
    from the copies in host memory (each rank's ring runs within its TP rank), then the group
    grows back to DP 2, again from memory: no checkpoint is read."""
    from ray import cloudpickle
    for module in (gpt, support, sys.modules[__name__]):
        cloudpickle.register_pickle_by_value(module)
    loads_file = run_dir.rstrip("/") + ".loads"
    fault = SignalAtStep(run_dir, at_step=20, sig=signal.SIGKILL, rank=1)
    # The replica left at DP 1 waits after its 5th step until the lost replica's two workers are
    # ready (support.ShrunkHold): the regrowth lands inside 50 steps however slowly they start.
    hold = ShrunkHold(2, 5, run_dir.rstrip("/") + ".regrow")
    config = {"model_size": "tiny", "batch_size": 8, "loads_file": loads_file, **fault.hold_config(),
              **hold.as_config()}
    fault.start()
    hold.release_when(run_dir, lambda status: status.get("world_size") == 2 and len(status.get("spares") or []) >= 2,
                      180, "the lost replica's two workers ready beside the group of 2")
    result = ElasticTrainer(
        counting_loads_held_while_shrunk, train_loop_config=config, total_steps=50, seed=0,
        scaling=ScalingConfig(min_workers=2, max_workers=4, tensor_parallel_size=2, strategy="fsdp",
                              startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=40, in_memory_every_n_steps=5),
        failure=FailureConfig(heartbeat_timeout_s=10.0, collective_timeout_s=30.0, rendezvous_timeout_s=60.0),
    ).fit()
    fault.join(timeout=5)
    assert fault.fired() and result.ok, result.error_traceback
    s = result.summary
    assert [w for _, w in s["world_size_history"]] == [4, 2, 4], s["world_size_history"]
    died, grew = s["recoveries"]
    assert died["cause"] == "worker_died" and died["rung"] == "memory" and died["lost_steps"] == 0, died
    assert grew["cause"] == "scale_up" and grew["rung"] == "memory", grew
    assert not os.path.exists(loads_file), open(loads_file).read()
    assert metrics_steps(run_dir) == list(range(1, 51))
    assert s["samples_consumed"] == 8 * (2 * _steps_at(s, 4) + _steps_at(s, 2))
    assert s["data_order_sha256"] == expected_data_order(s["samples_consumed"])

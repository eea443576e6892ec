"""constant_global_batch mode through a real 3 -> 2 rescale (SIGKILL at step 20), against the
fault-free run: same global batch, same LR, same samples, and the same model up to the order of
the floating-point sums.

Why not bitwise equal: global micro-batch k is the same B samples in both runs and its gradient
is computed bitwise the same, but the fault-free run (3 ranks x 2 micro-batches) sums them as
((g0+g1) + (g2+g3) + (g4+g5)) / 3 / 2 and the rescaled run (2 ranks x 3) as
((g0+g1+g2) + (g3+g4+g5)) / 2 / 3; float addition is not associative, so the averaged gradient
differs in its last bits, and AdamW carries that into the weights.
"""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, LRScalingConfig, ScalingConfig
from support import SignalAtStep
from test_runtime import expected_data_order

pytestmark = [pytest.mark.integration]

STEPS, BATCH, BASE = 40, 4, 6          # global batch 24 at every world size: accum 2 at W=3, 3 at W=2
# Max abs difference of any parameter between the two final models (SGD with momentum, so the
# update is proportional to the averaged gradient). Clean runs at 3 and at 2 workers differ by
# 6e-8 (summation order alone, see the module docstring); parameters are ~0.07 in size, and the
# same comparison without the division by accum_steps differs by 0.07.
PARAM_TOLERANCE = 1e-6


def fit(run_dir, workers, fault=None, optimizer="sgd", lr=0.05, strategy="ddp", steps=STEPS, spare_workers=0,
        in_memory_every=None, every=1000):
    if fault is not None:
        fault.start()
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config={"model_size": "tiny", "batch_size": BATCH, "lr": lr, "optimizer": optimizer,
                                            **(fault.hold_config() if fault is not None else {})},
        total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=workers[0], max_workers=workers[1], strategy=strategy,
                              startup_wait_s=120, spare_workers=spare_workers),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=every, in_memory_every_n_steps=in_memory_every),
        failure=FailureConfig(max_failures=3),
        lr=LRScalingConfig(base_world_size=BASE, warmup_steps=10, mode="constant_global_batch")).fit()
    if fault is not None:
        fault.join(timeout=5)
        assert fault.fired(), f"the fault never fired (run ended at step {result.final_step})"
    assert result.ok, result.error_traceback
    return result, [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def final_params(run_dir, tmp_path, steps=STEPS) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = str(tmp_path / (os.path.basename(os.path.dirname(run_dir)) + ".pt"))
    step_dir = os.path.join(run_dir, "checkpoints", f"step_{steps:08d}")
    (data_dir,) = {root for root, _, files in os.walk(step_dir) if ".metadata" in files}   # DCP's folder
    dcp_to_torch_save(data_dir, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


@pytest.mark.timeout(300)
def test_constant_batch_through_a_rescale_matches_the_fault_free_run(ray_session, tmp_path):
    clean_dir, faulted_dir = str(tmp_path / "clean" / "run"), str(tmp_path / "faulted" / "run")
    clean, clean_metrics = fit(clean_dir, (3, 3))
    fault = SignalAtStep(faulted_dir, at_step=STEPS // 2, sig=signal.SIGKILL, rank=1)
    faulted, metrics = fit(faulted_dir, (2, 3), fault)

    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["global_batch"] == BASE * BATCH for m in metrics + clean_metrics)
    assert all(m["accum_steps"] * m["world_size"] == BASE for m in metrics + clean_metrics)
    assert {m["accum_steps"] for m in metrics} >= {2, 3}, "the run never ran at world size 2"
    assert any(r["from_world"] == 3 and r["to_world"] == 2 for r in faulted.summary["recoveries"])
    # The LR follows only the schedule: the fault-free run's at every step, bit for bit.
    assert [m["lr"] for m in metrics] == [m["lr"] for m in clean_metrics]
    assert [m["samples_seen"] for m in metrics] == [BASE * BATCH * s for s in range(1, STEPS + 1)]

    # Exactly-once: the same samples in the same order as the fault-free run.
    for s in (clean.summary, faulted.summary):
        assert s["samples_consumed"] == STEPS * BASE * BATCH
        assert s["data_order_sha256"] == expected_data_order(STEPS * BASE * BATCH)

    # Same update every step, up to summation order.
    a, b = final_params(clean_dir, tmp_path), final_params(faulted_dir, tmp_path)
    assert a.keys() == b.keys() and a
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max abs parameter difference, fault-free vs 3 -> 2: {diff:.3g}")
    assert clean.summary["loss_last"] < clean.summary["loss_first"]
    assert diff <= PARAM_TOLERANCE
    for x, y in zip(clean_metrics, metrics, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-5)



@pytest.mark.timeout(420)
def test_fsdp_accumulates_like_ddp_and_a_resume_at_another_world_size_keeps_the_batch_lr_and_data(
        ray_session, tmp_path):
    """With FSDP2 (sync off on non-final micro-steps: tests/unit/worker/test_accumulation.py) the
    accumulated, averaged update ends where DDP's does, up to summation order. The DDP run is
    then resumed at another world size (2 -> 3): the global batch, the LR and the data carry on."""
    steps, models = 20, {}
    for strategy in ("ddp", "fsdp"):
        run_dir = str(tmp_path / strategy / "run")
        result, metrics = fit(run_dir, (2, 2), strategy=strategy, steps=steps)
        assert [m["accum_steps"] for m in metrics] == [3] * steps
        models[strategy] = final_params(run_dir, tmp_path, steps)
    diff = max(float((models["ddp"][k] - models["fsdp"][k]).abs().max()) for k in models["ddp"])
    print(f"max abs parameter difference, DDP vs FSDP2 with accumulation: {diff:.3g}")
    assert diff <= PARAM_TOLERANCE

    # The DDP run (2 workers, 20 steps) resumed at 3 workers to 40.
    run_dir = str(tmp_path / "ddp" / "run")
    second, metrics = fit(run_dir, (3, 3), steps=40)
    assert second.summary["resumed_from"] == 20
    assert [m["accum_steps"] for m in metrics] == [3] * 20 + [2] * 20
    assert all(m["global_batch"] == BASE * BATCH for m in metrics)
    # The schedule's horizon is each run's total_steps; from the resume on it is this run's 40.
    # No batch scale and no ramp: lr = base_lr x schedule(step), whatever the world size.
    from elastic._worker.lr import schedule_factor
    expected = [0.05 * schedule_factor(s - 1, total_steps=40, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
                for s in range(21, 41)]
    assert [m["lr"] for m in metrics[20:]] == pytest.approx(expected, rel=1e-12)
    assert second.summary["samples_consumed"] == 40 * BASE * BATCH
    assert second.summary["data_order_sha256"] == expected_data_order(40 * BASE * BATCH)

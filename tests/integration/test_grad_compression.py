"""Gradient compression (bf16, PowerSGD) and FSDP2 memory options through the real runtime:
convergence against the uncompressed run, a 3 -> 2 rescale on a kill, PowerSGD's per-rank state
across resumes, FSDP options saved at one world size and resumed at another."""
from __future__ import annotations

import json
import os
import signal

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from support import SignalAtStep

pytestmark = [pytest.mark.integration]

LOOP = {"model_size": "tiny", "batch_size": 8, "lr": 3e-2}


def _fit(run_dir, steps, *, workers=(2, 2), every=None, hold=None, **scaling):
    # startup_wait_s: the runs that rescale 3 -> 2 must begin with all 3 workers.
    return ElasticTrainer(
        gpt.train_loop, train_loop_config=LOOP | (hold or {}), total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=workers[0], max_workers=workers[1], startup_wait_s=120, **scaling),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=every),
        failure=FailureConfig(max_failures=3)).fit()


def _losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))}


def _tail(losses: dict[int, float], n: int = 5) -> float:
    last = sorted(losses)[-n:]
    return sum(losses[s] for s in last) / n


@pytest.mark.timeout(400)
def test_bf16_and_powersgd_converge_like_the_uncompressed_run(ray_session, tmp_path):
    tails = {}
    for name, extra in (("none", {}), ("bf16", {"grad_compression": "bf16"}),
                        ("powersgd", {"grad_compression": "powersgd", "powersgd_rank": 2,
                                      "powersgd_warmup_steps": 5})):
        run_dir = str(tmp_path / name)
        result = _fit(run_dir, 40, **extra)
        assert result.ok, result.error_traceback
        losses = _losses(run_dir)
        assert sorted(losses) == list(range(1, 41))
        tails[name] = _tail(losses)
        print(name, "tail", round(tails[name], 4), "first", round(losses[1], 4))
        assert tails[name] < losses[1] - 0.2, (name, losses)     # it learns
    # bf16 rounding of the averaged gradient changes little: within 2% of the uncompressed loss.
    assert abs(tails["bf16"] - tails["none"]) < 0.02 * tails["none"], tails
    # PowerSGD (rank 2, error feedback) approximates the average: within 5% after 35 compressed steps.
    assert abs(tails["powersgd"] - tails["none"]) < 0.05 * tails["none"], tails


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", ["bf16", "powersgd"])
def test_compressed_run_survives_a_kill_3_to_2(ray_session, run_dir, compression):
    # 60 steps: the kill held at step 12, then 48 compressed steps of the re-formed group (the
    # convergence test above finds the loss well down after 40).
    fault = SignalAtStep(run_dir, at_step=12, sig=signal.SIGKILL, rank=1)
    fault.start()
    result = _fit(run_dir, 60, workers=(2, 3), hold=fault.hold_config(), grad_compression=compression,
                  powersgd_warmup_steps=4)
    fault.join(timeout=5)
    assert fault.fired() and result.ok, result.error_traceback
    assert fault.step_seen == 12
    recoveries = result.summary["recoveries"]
    assert any(r["from_world"] == 3 and r["to_world"] == 2 for r in recoveries), recoveries
    assert result.summary["final_step"] == 60
    losses = _losses(run_dir)
    assert _tail(losses) < losses[1] - 0.2


def _observing_loop(ctx):
    """gpt.train_loop, with rank 0 noting PowerSGD's iteration count at every step."""
    class Observed:
        def __getattr__(self, name):
            return getattr(ctx, name)

        def report(self, **metrics):
            if ctx.rank == 0:
                with open(os.path.join(ctx.config["log_dir"], "powersgd.jsonl"), "a") as f:
                    f.write(json.dumps({"step": ctx.step + 1, "world": ctx.world_size,
                                        "iter": ctx._compression.state.iter}) + "\n")
            return ctx.report(**metrics)

    gpt.train_loop(Observed())


@pytest.mark.timeout(300)
def test_powersgd_state_resumes_at_the_same_world_size_and_resets_at_another(ray_session, run_dir, tmp_path):
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(gpt)   # the loop below lives here and calls gpt by name
    def fit(workers, steps):
        return ElasticTrainer(
            _observing_loop, train_loop_config={**LOOP, "log_dir": str(tmp_path)}, total_steps=steps, seed=0,
            scaling=ScalingConfig(min_workers=workers, max_workers=workers, grad_compression="powersgd",
                                  powersgd_warmup_steps=3),
            checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=8)).fit()

    for workers, steps in ((2, 8), (2, 12), (3, 16)):
        result = fit(workers, steps)
        assert result.ok, result.error_traceback
    seen = {r["step"]: r for r in map(json.loads, open(tmp_path / "powersgd.jsonl"))}
    # The iteration count is read at report(), after the step's hook ran: step k of a fresh
    # PowerSGD state has iter k. The first run: 1..8.
    assert [seen[s]["iter"] for s in range(1, 9)] == list(range(1, 9))
    # Resumed at world 2 from step 8: one plain all-reduce step while DDP rebuilds its buckets
    # (the restored state waits), then the restored state (iter 8) goes on.
    assert [seen[s]["iter"] for s in range(9, 13)] == [0, 9, 10, 11]
    # Resumed at world 3 from step 12: the residuals belong to world 2, so PowerSGD starts afresh.
    assert [seen[s]["iter"] for s in range(13, 17)] == [1, 2, 3, 4]
    assert seen[13]["world"] == 3


@pytest.mark.timeout(400)
def test_fsdp_memory_options_save_at_2_and_resume_at_3_like_the_default(ray_session, tmp_path):
    losses = {}
    for name, options in (("default", {}),
                          ("zero2_offload", {"fsdp_reshard_after_forward": False, "fsdp_cpu_offload": True})):
        run_dir = str(tmp_path / name)
        first = _fit(run_dir, 8, every=8, strategy="fsdp", **options)
        second = _fit(run_dir, 14, workers=(3, 3), every=8, strategy="fsdp", **options)
        assert first.ok and second.ok, (first.error_traceback, second.error_traceback)
        assert second.summary["resumed_from"] == 8
        losses[name] = _losses(run_dir)
        assert sorted(losses[name]) == list(range(1, 15))
    # Same math, other memory layout: the same losses before and after the resharded resume.
    for step in range(1, 15):
        assert losses["zero2_offload"][step] == pytest.approx(losses["default"][step], rel=1e-5), step

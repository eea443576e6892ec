"""Silent data corruption on a real DDP run of 3 workers, two faults against one fault-free run:

- Memory (elastic._worker.fingerprint): one bit of one parameter flipped in rank 1's memory after
  step 23 (the fault gate's BitFlipAt). Its replicas disagree at step 24; the checkpoint due at
  step 24 is never committed from that state; rank 1's worker is replaced and the group rolls back
  to the copy in memory of step 20 (the last agreeing one: the survivors' live state trained on
  the corrupt rank's gradient at step 24), redoes steps 21-24.
- Compute (elastic._worker.spot_check): from step 14 on, rank 2's backward computes a wrong
  gradient (BadGradientAt), which the all-reduce hands to every replica: the parameters agree, and
  the spot check at step 16 finds it (checks every 4 steps: the one at 12 passed). Rank 2 is
  replaced, the run goes back to the copy of step 10 (from before step 13), and the checkpoint due
  at 16 is committed by the re-formed generation only.

Both end on the fault-free run's model, bit for bit. The memory fault's run also feeds an
MLflowCallback (MLflow's local file store): each step once, the lost attempts of 21-24 never sent."""
from __future__ import annotations

import glob
import json
import os

import pytest
from mlflow.tracking import MlflowClient

import gpt
from elastic import Callback, CheckpointConfig, ElasticTrainer, FailureConfig, MLflowCallback, ScalingConfig
from elastic._worker.fault_gate import BadGradientAt, BitFlipAt

pytestmark = [pytest.mark.integration]

STEPS, FLIP_AFTER, BAD_AFTER, SPOT_EVERY = 30, 23, 13, 4


def fit(run_dir: str, extra: dict | None = None, callbacks: list | None = None):
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config={"model_size": "tiny", "batch_size": 4, **(extra or {})},
        total_steps=STEPS, seed=0,
        scaling=ScalingConfig(min_workers=3, max_workers=3, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=8, in_memory_every_n_steps=10),
        failure=FailureConfig(max_failures=3, spot_check_every_n_steps=SPOT_EVERY), callbacks=callbacks).fit()
    assert result.ok, result.error_traceback
    return result, [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


class LiveSteps(Callback):
    """Every step line as it comes, lost attempts included."""

    def __init__(self):
        self.steps: list[int] = []

    def on_step(self, step_info):
        self.steps.append(step_info["step"])


def only_the_new_generation_committed(run_dir: str, step: int, generation: int) -> None:
    """The checkpoint of `step` was written and committed by `generation` only: the corrupt one
    never began its save (no data folder of generation 0)."""
    step_dir = os.path.join(run_dir, "checkpoints", f"step_{step:08d}")
    assert json.load(open(os.path.join(step_dir, "COMMITTED")))["generation"] == generation
    assert sorted(glob.glob(os.path.join(step_dir, "g*"))) == [os.path.join(step_dir, f"g{generation:06d}")]


@pytest.mark.timeout(420)
def test_a_flipped_bit_and_a_wrong_gradient_are_found_their_rank_replaced_and_the_run_ends_on_the_clean_model(
        ray_session, tmp_path, monkeypatch):
    clean, _ = fit(str(tmp_path / "clean" / "run"))
    run_dir = str(tmp_path / "flipped" / "run")
    flip = BitFlipAt(step=FLIP_AFTER, rank=1, marker_file=str(tmp_path / "flipped.marker"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")     # MLflow 3's local file store, kept for clients
    tracker, live = MLflowCallback((tmp_path / "mlruns").as_uri()), LiveSteps()
    faulted, metrics = fit(run_dir, flip.as_config(), callbacks=[tracker, live])
    assert os.path.exists(flip.marker_file), "the bit was never flipped"

    (recovery,) = faulted.summary["recoveries"]
    (failure,) = recovery["failures"]
    assert recovery["cause"] == "sdc" and failure["ranks"] == [1] and failure["step"] == FLIP_AFTER + 1, recovery
    assert "silent data corruption at step 24" in failure["why"]
    # Back to the last agreeing copy (step 20), not the survivors' live state of step 24, and
    # not the checkpoint of step 16.
    assert recovery["rung"] == "memory" and recovery["step"] == 20, recovery
    assert recovery["lost_steps"] == 4 and recovery["to_world"] == 3, recovery
    only_the_new_generation_committed(run_dir, 24, recovery["generation"])
    # Each step once in metrics.jsonl, and the fault-free model, bit for bit.
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # MLflow too: steps 21-24 were held (the spot check's last pass was at 20) and their lost
    # attempts never sent; each step once, with the kept attempt's loss.
    assert sorted(set(live.steps)) == list(range(1, STEPS + 1)) and len(live.steps) > STEPS   # lost attempts came
    history = MlflowClient((tmp_path / "mlruns").as_uri()).get_metric_history(tracker.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert {m.step: m.value for m in history} == pytest.approx({m["step"]: m["loss"] for m in metrics})
    assert faulted.summary["model_sha256"] == clean.summary["model_sha256"]
    assert faulted.summary["data_order_sha256"] == clean.summary["data_order_sha256"]

    run_dir = str(tmp_path / "bad-gradient" / "run")
    bad = BadGradientAt(step=BAD_AFTER, rank=2, marker_file=str(tmp_path / "bad-gradient.marker"), param=4,
                        element=5, bit=21)
    faulted, metrics = fit(run_dir, bad.as_config())
    assert os.path.exists(bad.marker_file), "the gradient was never corrupted"
    (recovery,) = faulted.summary["recoveries"]
    (failure,) = recovery["failures"]
    assert recovery["cause"] == "sdc" and failure["ranks"] == [2] and failure["step"] == 16, recovery
    assert "in compute at step 16" in failure["why"] and "from before step 13" in failure["why"]
    # Back to the copy of step 10 (the one of step 20 does not exist yet; the checkpoint of 8 is older).
    assert recovery["rung"] == "memory" and recovery["step"] == 10 and recovery["lost_steps"] == 6, recovery
    only_the_new_generation_committed(run_dir, 16, recovery["generation"])
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert faulted.summary["model_sha256"] == clean.summary["model_sha256"]

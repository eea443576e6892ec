"""The main job with --gpu, as a user runs it (its own local Ray, one worker on one GPU): fp16
with its GradScaler under DDP and FSDP2, bf16 under FSDP2, each trained, checkpointed and
resumed. An fp16 checkpoint holds the scaler's state, which the resumed run loads back."""
import math
import os
import subprocess
import sys

import pytest
import torch

from elastic.local_ray import LocalRay
from support import read_json

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(420),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def pretrain(storage: str, steps: int, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}      # a local Ray of its own
    try:
        done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pretrain.py"), "--storage", storage,
                               "--workers", "1:1", "--steps", str(steps), "--checkpoint-every", "10",
                               "--model-size", "tiny", "--quiet", "--gpu", *flags],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    finally:
        LocalRay(storage).stop()        # the run's own Ray outlives a driver killed by the timeout
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    summary = read_json(storage, "summary.json")
    assert summary["status"] == "finished" and summary["final_step"] == steps, summary
    return summary


def scaler_state(storage: str, step: int) -> dict | None:
    """The GradScaler's state in checkpoint `step`: the framework's part of a checkpoint (progress,
    precision) is JSON in its manifest, not DCP tensors (elastic._worker.train_state)."""
    from checkpointing import CheckpointManager
    (info,) = [c for c in CheckpointManager(storage).committed() if c.step == step]
    return (info.meta or {}).get("extra", {}).get("grad_scaler")


@pytest.mark.parametrize("strategy, precision", [("ddp", "fp16"), ("fsdp", "bf16"), ("fsdp", "fp16")])
def test_pretrain_on_the_gpu_trains_checkpoints_and_resumes(tmp_path, strategy, precision):
    storage = str(tmp_path / "run")
    flags = ("--strategy", strategy, "--precision", precision)
    first = pretrain(storage, 20, *flags)
    assert first["config"]["scaling"]["use_gpu"] is True and first["config"]["scaling"]["precision"] == precision
    assert math.isfinite(first["loss_first"]) and math.isfinite(first["loss_last"])
    assert first["loss_last"] < first["loss_first"] and first["checkpoints"][-1] == 20
    if precision == "fp16":
        scaler = scaler_state(storage, 20)
        assert scaler, "the fp16 checkpoint holds no GradScaler state"
        assert math.isfinite(scaler["scale"]) and scaler["scale"] > 0, scaler

    again = pretrain(storage, 30, *flags)
    assert again["resumed_from"] == 20 and again["recoveries"] == []
    assert math.isfinite(again["loss_last"])

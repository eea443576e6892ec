"""examples/classifier.py, the Ray Train port, end to end: a SIGKILL mid-run, then the metrics,
the scheduler and EMA it restored, and the exported weights scored again with plain torch."""
from __future__ import annotations

import json
import os
import signal

import pytest

import classifier
from checkpointing import export_model_state
from elastic._determinism import state_sha256
from support import SignalAtStep

pytestmark = [pytest.mark.integration]

STEPS, VAL_EVERY, KILL_AT = 100, 25, 30


@pytest.mark.timeout(240)
def test_classifier_port_survives_a_kill_and_exports_the_model_it_validated(ray_session, run_dir):
    fault = SignalAtStep(run_dir, at_step=KILL_AT, sig=signal.SIGKILL, rank=1)
    args = classifier.parse_args([
        "--storage", run_dir, "--workers", "2:2", "--steps", str(STEPS), "--val-every", str(VAL_EVERY),
        "--checkpoint-every", "50", "--loader-workers", "2", "--quiet", "--hold-at", f"{KILL_AT}:{fault.gate}"])
    fault.start()
    result = classifier.build_trainer(args).fit()
    fault.join(timeout=5)
    assert fault.fired(), f"the fault never fired (run ended at step {result.final_step})"
    assert result.ok and result.final_step == STEPS, result.error_traceback
    (recovery,) = result.summary["recoveries"]
    assert recovery["cause"] == "worker_died" and recovery["step"] == KILL_AT, recovery

    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [line for line in lines if "kind" not in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    assert all(0.0 <= line["accuracy"] <= 1.0 for line in steps)
    # The LambdaLR went on across the kill: step k ran with the factor of k - 1 steps taken.
    assert [line["lr"] for line in steps] == pytest.approx(
        [classifier.BASE_LR * classifier.lr_factor(k - 1, STEPS) for k in range(1, STEPS + 1)])
    logs = [line for line in lines if line.get("kind") == "log"]
    assert [line["step"] for line in logs] == list(range(VAL_EVERY, STEPS + 1, VAL_EVERY))
    assert all({"val_loss", "val_accuracy", "ema_val_accuracy"} <= set(line) for line in logs)
    last = result.metrics.last
    assert last["val_accuracy"] > 0.9 and last["accuracy"] > 0.9, last

    # Weights out: the final checkpoint's modules are the run's final model bit for bit, and plain
    # torch scores them as the run did (within float rounding: the run summed over two shards).
    assert result.checkpoint == f"{run_dir}/checkpoints/step_{STEPS:08d}"
    state = export_model_state(result.storage, step=STEPS)
    assert state_sha256({f"{name}.{key}": v for name, sd in state.items() for key, v in sd.items()}) \
        == result.summary["model_sha256"]
    assert int(state["ema"]["n_averaged"]) == STEPS       # the EMA was restored, not restarted, at the kill
    model, ema = classifier.load_exported(state)
    val = classifier.validation_set()
    val_loss, val_accuracy = classifier.evaluate(model, val)
    _, ema_accuracy = classifier.evaluate(ema.module, val)
    one_point = 1.0 / classifier.N_VAL
    assert val_accuracy == pytest.approx(last["val_accuracy"], abs=one_point)
    assert ema_accuracy == pytest.approx(last["ema_val_accuracy"], abs=one_point)
    assert val_loss == pytest.approx(last["val_loss"], rel=1e-5)

"""FSDP recovers from memory (elastic._worker.replicas): a SIGKILLed rank's shards come back from
its neighbour's host memory, not from storage, at the same world size (with a spare) and resharded
to a smaller one, against the fault-free run.

In the run with a spare no checkpoint is committed before the fault (every_n_steps far beyond
the run): a checkpoint restore would go back to step 0, so a recovery that restores the fault's
step read nothing from storage. The run without one commits every 10 steps and is killed at 25:
the copies (step 25) are newer than the checkpoint (20), and the survivor that was rank 2 is rank
1 afterwards. The runs hold the global batch constant (constant_global_batch), so the 3 -> 2 run
trains on the same samples with the same update as the fault-free one, up to summation order
(see test_constant_batch.py)."""
from __future__ import annotations

import signal

import pytest

from support import SignalAtStep
from test_constant_batch import BASE, BATCH, PARAM_TOLERANCE, final_params, fit
from test_runtime import expected_data_order

pytestmark = [pytest.mark.integration]

STEPS, AT, SHRINK_AT = 40, 20, 25


@pytest.mark.timeout(420)
def test_fsdp_kill_restores_from_memory_bitwise_with_a_spare_and_resharded_without(ray_session, tmp_path):
    clean_dir = str(tmp_path / "clean" / "run")
    clean, clean_metrics = fit(clean_dir, (3, 3), strategy="fsdp", steps=STEPS)

    # 3 workers and a hot spare, copies every step: the replacement takes the lost rank's place
    # and the group goes on from the fault's step, bit for bit the fault-free run.
    spare_dir = str(tmp_path / "spare" / "run")
    fault = SignalAtStep(spare_dir, at_step=AT, sig=signal.SIGKILL, rank=1, when=lambda status: status["spares"])
    spared, _ = fit(spare_dir, (3, 3), fault, strategy="fsdp", steps=STEPS,
                    spare_workers=1, in_memory_every=1)
    (recovery,) = spared.summary["recoveries"]
    assert recovery["rung"] == "memory" and "no storage read" in recovery["reason"], recovery
    assert recovery["step"] == AT and recovery["lost_steps"] <= 1 and recovery["to_world"] == 3, recovery
    assert spared.summary["model_sha256"] == clean.summary["model_sha256"]
    assert spared.summary["data_order_sha256"] == clean.summary["data_order_sha256"] \
        == expected_data_order(STEPS * BASE * BATCH)

    # No spare: 3 -> 2, the shards resharded in memory to two ranks.
    shrink_dir = str(tmp_path / "shrink" / "run")
    fault = SignalAtStep(shrink_dir, at_step=SHRINK_AT, sig=signal.SIGKILL, rank=1)
    shrunk, metrics = fit(shrink_dir, (2, 3), fault, strategy="fsdp", steps=STEPS,
                          in_memory_every=1, every=10)
    (recovery,) = shrunk.summary["recoveries"]
    assert recovery["rung"] == "memory" and recovery["step"] == SHRINK_AT, recovery
    assert shrunk.summary["checkpoints"] == [20, 30, 40]     # the re-formed group's saves commit
    assert (recovery["from_world"], recovery["to_world"]) == (3, 2)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert {m["world_size"] for m in metrics[SHRINK_AT:]} == {2}
    assert shrunk.summary["data_order_sha256"] == clean.summary["data_order_sha256"]
    for x, y in zip(clean_metrics, metrics, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-5), (x, y)
    a, b = final_params(clean_dir, tmp_path, STEPS), final_params(shrink_dir, tmp_path, STEPS)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max abs parameter difference, fault-free vs FSDP 3 -> 2 from memory: {diff:.3g}")
    assert diff <= PARAM_TOLERANCE

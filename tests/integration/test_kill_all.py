"""Every worker SIGKILLed at once mid-run, DDP and FSDP with the default copies every 10 steps
(issue 35): the copies the ranks handed to their node's keeper (elastic._node_keeper) outlive
them, the replacements restore from those, with no storage read (no checkpoint is committed
before the fault), redo the steps since the copy, and the run ends on the data of a fault-free
run, each sample once; an MLflow tracker of the run holds each step once."""
from __future__ import annotations

import json
import os
import signal

import pytest
from mlflow.tracking import MlflowClient

from elastic import MLflowCallback
from elastic._node_keeper import kept_copies
from elastic._run_names import RunNames
from support import SignalAtStep
from test_runtime import expected_data_order, fit_with_fault

pytestmark = [pytest.mark.integration]

STEPS, KILL_AT, COPY_EVERY = 30, 25, 10


def kept(step: int):
    """status.json -> whether the run's keepers hold a copy of `step` (or newer)."""
    def holds(status: dict) -> bool:
        copies = kept_copies(RunNames(status["run_id"])) if status.get("run_id") else []
        return any(copy[4] >= step for copy in copies)
    return holds


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_worker_killed_at_once_restores_from_the_nodes_keepers(ray_session, tmp_path, strategy, monkeypatch):
    run_dir = str(tmp_path / "run")
    # MLflow (its local file store) through the kill: the steps 21-25 the recovery takes back were
    # held, never sent; each step once, with the kept attempt's loss.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracker = MLflowCallback((tmp_path / "mlruns").as_uri())
    # Held at step 25 until the copy of step 20 is in a keeper: a keeper starts in seconds (a
    # process, torch's import), in which this tiny model trains a hundred steps.
    fault = SignalAtStep(run_dir, at_step=KILL_AT, sig=signal.SIGKILL, rank=None, when=kept(20))
    result = fit_with_fault(run_dir, fault, workers=(2, 2), steps=STEPS, every=100, strategy=strategy,
                            in_memory_every=COPY_EVERY, callbacks=[tracker])
    s = result.summary
    assert result.ok and s["final_step"] == STEPS, result.error_traceback
    (recovery,) = s["recoveries"]
    assert recovery["cause"] == "worker_died" and recovery["rung"] == "memory", recovery
    assert "keeper" in recovery["reason"] and "no storage read" in recovery["reason"], recovery
    assert recovery["step"] == 20 and recovery["lost_steps"] == KILL_AT - 20, recovery
    assert s["checkpoints"] == [STEPS]          # nothing was committed before the fault: none was read
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in lines if "kind" not in m] == list(range(1, STEPS + 1))
    assert s["data_order_sha256"] == expected_data_order(STEPS * 16)
    history = MlflowClient((tmp_path / "mlruns").as_uri()).get_metric_history(tracker.run_id, "loss")
    steps = [m for m in lines if "kind" not in m]
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert {m.step: m.value for m in history} == pytest.approx({m["step"]: m["loss"] for m in steps})
    # The keepers ended with the run (they are detached: nothing else would end them).
    import ray
    keepers = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if ".keeper." in a["name"]]
    assert keepers == []

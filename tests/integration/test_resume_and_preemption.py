"""Checkpoints through the runtime: S3 credentials reaching the workers, preemption notices, and
a corrupt newest checkpoint. (The main job's resume on S3 at another world size:
test_parquet_exactly_once.py.)"""
from __future__ import annotations

import json
import os
import signal
import threading

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from support import SignalAtStep, pid_alive, wait_for

pytestmark = [pytest.mark.integration]

TINY = {"model_size": "tiny", "batch_size": 8}


@pytest.mark.timeout(120)
def test_aws_variables_reach_the_workers(ray_session, s3_url, s3_env):
    result = ElasticTrainer(gpt.train_loop, train_loop_config=TINY, total_steps=20, seed=0,
                            scaling=ScalingConfig(min_workers=2, max_workers=2),
                            checkpoint=CheckpointConfig(storage=s3_url, every_n_steps=10)).fit()
    assert result.ok and result.summary["checkpoints"] == [10, 20], result.error_traceback


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_preemption_notice_loses_no_step_and_commits_nothing_the_survivors_hold(ray_session, run_dir, strategy):
    # The group leaves at the notice's step. DDP: the survivors hold full replicas. FSDP: copies
    # are taken at the leaving step, and the preempted rank's neighbour holds its shards; the one
    # that was rank 2 then saves the final commit as rank 1. No commit at the notice either way
    # (elastic stop, which commits, is the next test; a notice to every rank commits, see
    # test_step_boundary_async). 80 steps: the notice held at step 40, then the group of the
    # survivors trains on to the final commit.
    fault = SignalAtStep(run_dir, at_step=40, sig=signal.SIGTERM, rank=1)
    fault.start()
    result = ElasticTrainer(gpt.train_loop, train_loop_config=TINY | fault.hold_config(), total_steps=80, seed=0,
                            scaling=ScalingConfig(min_workers=2, max_workers=3, startup_wait_s=120,
                                                  strategy=strategy),
                            checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=1000, keep=None),
                            failure=FailureConfig(max_failures=3)).fit()
    fault.join(timeout=5)
    assert fault.fired() and result.ok, result.error_traceback
    (recovery,) = [r for r in result.summary["recoveries"] if r["cause"] == "preempted"]
    assert recovery["lost_steps"] == 0 and recovery["from_world"] == 3 and recovery["to_world"] == 2
    assert recovery["rung"] == {"ddp": "warm", "fsdp": "memory"}[strategy]
    assert recovery["step"] >= 40 and result.summary["checkpoints"] == [80]    # no commit at the notice
    wait_for(lambda: not pid_alive(fault.pid), 10, "the preempted worker to leave")


@pytest.mark.timeout(180)
def test_corrupt_newest_checkpoint_falls_back_and_the_summary_says_so(ray_session, run_dir):
    def fit(steps):
        return ElasticTrainer(gpt.train_loop, train_loop_config=TINY, total_steps=steps, seed=0,
                              scaling=ScalingConfig(min_workers=2, max_workers=2),
                              checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=10)).fit()

    assert fit(20).ok
    newest = os.path.join(run_dir, "checkpoints", "step_00000020")
    manifest = json.load(open(os.path.join(newest, "COMMITTED")))
    shard = max(manifest["files"], key=lambda name: manifest["files"][name]["size"])
    with open(os.path.join(newest, shard), "r+b") as f:
        f.seek(manifest["files"][shard]["size"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = fit(30)
    assert result.ok and result.summary["resumed_from"] == 10
    assert [f["step"] for f in result.summary["checkpoint_fallbacks"]] == [20]
    assert result.summary["final_step"] == 30
    # The second run is a newer generation: its step-20 shards do not touch the first run's.
    assert json.load(open(os.path.join(run_dir, "checkpoints", "FENCE")))["generation"] == 1
    assert os.path.isdir(os.path.join(newest, "g000001"))


@pytest.mark.timeout(240)
def test_elastic_stop_commits_where_it_stopped_and_a_resume_goes_on_from_there(ray_session, run_dir):
    from elastic.stop_request import request_stop
    from support import read_json

    def stop_at_step_20():
        wait_for(lambda: (read_json(run_dir, "status.json") or {}).get("step", 0) >= 20, 120, "step 20")
        request_stop(run_dir, reason="maintenance")

    def fit(steps):
        return ElasticTrainer(gpt.train_loop, train_loop_config=TINY, total_steps=steps, seed=0,
                              scaling=ScalingConfig(min_workers=2, max_workers=2),
                              checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=1000, keep=None)).fit()

    stopper = threading.Thread(target=stop_at_step_20, daemon=True)
    stopper.start()
    stopped = fit(400)
    stopper.join(timeout=5)
    assert stopped.status == "stopped" and stopped.ok and stopped.error is None, stopped.error_traceback
    step = stopped.summary["final_step"]
    assert 20 <= step < 400 and stopped.summary["checkpoints"] == [step]     # committed where it stopped
    assert read_json(run_dir, "status.json")["state"] == "stopped"
    assert os.path.exists(os.path.join(run_dir, "STOP"))
    resumed = fit(step + 10)                     # the next start takes the old STOP away: it trains on
    assert resumed.ok and resumed.summary["resumed_from"] == step and resumed.summary["final_step"] == step + 10
    # The run's history keeps both invocations: the stopped one, then the resume (issue 34).
    assert [(i["status"], i["resumed_from"], i["final_step"]) for i in resumed.summary["invocations"]] == [
        ("stopped", None, step), ("finished", step, step + 10)]
    assert not os.path.exists(os.path.join(run_dir, "STOP"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if '"step"' in line]
    assert sorted(set(steps)) == list(range(1, step + 11))                   # no step lost, none twice

"""Checkpoints through the runtime: resume across runs on S3 at another world size, preemption
notices, and a corrupt newest checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from faults import SignalAtStep, pid_alive, wait_for

pytestmark = [pytest.mark.integration]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {"model_size": "tiny", "batch_size": 8}


def run_main_job(storage: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "examples/pretrain.py", "--storage", storage, "--model-size", "tiny", "--quiet", *args]
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | env
    return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=150)


def s3_json(s3_env, key: str):
    import boto3
    client = boto3.client("s3", endpoint_url=s3_env["env"]["AWS_ENDPOINT_URL"])
    body = client.get_object(Bucket=s3_env["bucket"], Key=key)["Body"].read().decode()
    return json.loads(body) if key.endswith(".json") else [json.loads(line) for line in body.splitlines()]


@pytest.mark.timeout(400)
def test_main_job_resumes_on_s3_at_another_world_size(s3_env):
    url = f"s3://{s3_env['bucket']}/pretrain"
    first = run_main_job(url, s3_env["env"], "--workers", "2:2", "--steps", "40", "--checkpoint-every", "10")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    second = run_main_job(url, s3_env["env"], "--workers", "3:3", "--steps", "60", "--checkpoint-every", "10")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    summary = s3_json(s3_env, "pretrain/summary.json")
    assert summary["status"] == "finished" and summary["resumed_from"] == 40 and summary["final_step"] == 60
    assert summary["checkpoints"] == [40, 50, 60]         # keep=3 retention
    assert summary["world_size_history"] == [[40, 3]]
    metrics = s3_json(s3_env, "pretrain/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 61))   # none repeated, none skipped
    assert {m["world_size"] for m in metrics if m["step"] <= 40} == {2}
    assert {m["world_size"] for m in metrics if m["step"] > 40} == {3}
    # Consumption is counted in global samples: 40 steps x 2 x 8, then 20 steps x 3 x 8.
    assert metrics[39]["samples_seen"] == 640 and metrics[-1]["samples_seen"] == 640 + 480


@pytest.mark.timeout(120)
def test_aws_variables_reach_the_workers(ray_session, s3_url, s3_env):
    result = ElasticTrainer(gpt.train_loop, train_loop_config=TINY, total_steps=20, seed=0,
                            scaling=ScalingConfig(min_workers=2, max_workers=2),
                            checkpoint=CheckpointConfig(storage=s3_url, every_n_steps=10)).fit()
    assert result.ok and result.summary["checkpoints"] == [10, 20], result.error_traceback


@pytest.mark.timeout(180)
def test_preemption_notice_commits_the_step_before_the_worker_leaves(ray_session, run_dir):
    fault = SignalAtStep(run_dir, at_step=40, sig=signal.SIGTERM, rank=1)
    fault.start()
    result = ElasticTrainer(gpt.train_loop, train_loop_config=TINY | fault.hold_config(), total_steps=300, seed=0,
                            scaling=ScalingConfig(min_workers=2, max_workers=3, startup_wait_s=120),
                            checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=1000, keep=None),
                            failure=FailureConfig(max_failures=3)).fit()
    fault.join(timeout=5)
    assert fault.fired() and result.ok, result.error_traceback
    (recovery,) = [r for r in result.summary["recoveries"] if r["cause"] == "preempted"]
    assert recovery["lost_steps"] == 0 and recovery["from_world"] == 3 and recovery["to_world"] == 2
    assert recovery["step"] in result.summary["checkpoints"]     # committed at the notice, not on schedule
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

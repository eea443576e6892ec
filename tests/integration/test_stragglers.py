"""Stragglers on a real group: a worker slowed from outside is flagged, and evicted only when
the group goes faster without it (N/(N-1) rule); a clean run raises no flag.

The slowdown is a SIGSTOP/SIGCONT duty cycle. Two workers on this 2-core machine each have a
core, so stopping one a third of the time makes its compute 1.5x slower. Four workers share
the two cores: the CPU a stopped worker leaves goes to its peers, so the same duty cycle slows it
less than it says (measured about 1.3x); the four-worker test stops it half the time, which
measures about 1.5x. The assertions are on the measured score the rule compares.
"""
from __future__ import annotations

import json
import os

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig, ScalingPolicy
from support import SlowDown

pytestmark = [pytest.mark.integration, pytest.mark.exclusive]

SMALL = {"model_size": "small", "batch_size": 8}


def fit(run_dir, workers, steps, fault=None, config=SMALL, scaling_policy=None):
    if fault is not None:
        fault.start()
    try:
        result = ElasticTrainer(
            gpt.train_loop, train_loop_config=config, total_steps=steps, seed=0,
            scaling=ScalingConfig(min_workers=workers[0], max_workers=workers[1]),
            checkpoint=CheckpointConfig(storage=run_dir),
            failure=FailureConfig(heartbeat_timeout_s=10.0, collective_timeout_s=30.0),
            scaling_policy=scaling_policy).fit()
    finally:
        if fault is not None:
            fault.stop()
    assert result.ok, result.error
    return result


def steps_since(run_dir, wall_time, step):
    """Completed steps between `wall_time` and the end of `step` (from metrics.jsonl)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    first = next(m["step"] for m in lines if m["time"] >= wall_time)
    return step - first + 1


@pytest.mark.timeout(240)
def test_clean_run_raises_no_straggler_flag(ray_session, run_dir):
    # The small model: with the tiny one a step's compute is ~15 ms, and scheduling noise on 2
    # shared cores alone reached window scores of 1.4.
    # Batch 4 halves the run's time and still leaves ~50 ms of compute per step.
    # 300 clean steps on 4 workers sharing 2 cores also carry issue 14's check of the hang bound
    # learned from step times (hang_timeout_s "auto"): no false hang, no recovery of any kind.
    # 300: every regime of both judges, with room: straggler windows full from step 20 (280
    # window scores per rank), the hang bound judged from step 20 and learned from its full 200
    # step times for the last 100 steps.
    result = fit(run_dir, (4, 4), 300, config={**SMALL, "batch_size": 4})
    assert result.summary["stragglers"] == [] and result.summary["recoveries"] == []


@pytest.mark.timeout(240)
def test_slowed_worker_of_four_is_flagged_and_evicted(ray_session, run_dir):
    # 55 steps: the flag comes within 20 steps of the slowdown (asserted below), the eviction at
    # the flag, and the run goes on at 3 workers for the rest.
    fault = SlowDown(run_dir, at_step=10, rank=2, slowdown=2.0)
    result = fit(run_dir, (2, 4), 55, fault)
    s = result.summary
    flag = s["stragglers"][0]
    assert flag["rank"] == 2 and flag["score"] > 4 / 3, s["stragglers"]
    assert steps_since(run_dir, fault.started_at, flag["step"]) <= 20
    evictions = [r for r in s["recoveries"] if r["cause"] == "straggler"]
    assert evictions and evictions[0]["from_world"] == 4 and evictions[0]["to_world"] == 3
    assert evictions[0]["rung"] == "warm" and evictions[0]["lost_steps"] == 0


@pytest.mark.timeout(240)
def test_slowed_worker_of_two_is_flagged_but_not_evicted(ray_session, run_dir):
    # 60 steps: the flag comes within 20 steps of the slowdown (asserted below), and the policy,
    # asked at the flag and again a window (20 steps) later while it stays flagged, keeps the rank.
    fault = SlowDown(run_dir, at_step=10, rank=1, slowdown=1.5)
    result = fit(run_dir, (1, 2), 60, fault)
    s = result.summary
    assert [f["rank"] for f in s["stragglers"]] == [1], s["stragglers"]
    assert steps_since(run_dir, fault.started_at, s["stragglers"][0]["step"]) <= 20
    assert s["recoveries"] == [] and s["world_size_history"] == [[0, 2]]


class NeverEvict(ScalingPolicy):
    """A user's policy: stragglers are kept whatever they cost. It leaves a mark on storage each
    time it is asked, which shows it ran inside the controller (another process)."""

    def __init__(self, run_dir: str):
        self.asked_path = os.path.join(run_dir, "never_evict.jsonl")

    def decide_eviction(self, *, rank, score, world_size, min_workers):
        with open(self.asked_path, "a") as f:
            f.write(json.dumps({"rank": rank, "score": score, "world_size": world_size}) + "\n")
        return None


@pytest.mark.timeout(240)
def test_a_user_policy_that_never_evicts_is_obeyed(ray_session, run_dir):
    # The same fault that the default policy answers with an eviction (test above).
    os.makedirs(run_dir)
    policy = NeverEvict(run_dir)
    fault = SlowDown(run_dir, at_step=10, rank=2, slowdown=2.0)
    result = fit(run_dir, (2, 4), 70, fault, scaling_policy=policy)
    s = result.summary
    assert s["stragglers"][0]["rank"] == 2, s["stragglers"]
    with open(policy.asked_path) as f:
        asked = [json.loads(line) for line in f]
    # Asked about rank 2 at a score the default policy evicts at (> 4/3), and kept it.
    assert {(a["rank"], a["world_size"]) for a in asked} == {(2, 4)}, asked
    assert max(a["score"] for a in asked) > 4 / 3, asked
    assert [r for r in s["recoveries"] if r["cause"] != "scale_up"] == [], s["recoveries"]
    assert s["world_size_history"][-1][1] == 4 and result.final_step == 70, s["world_size_history"]

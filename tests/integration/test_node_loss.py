"""Losing a whole node with `ray.cluster_utils.Cluster`: the run rescales onto the nodes it has
left, and grows back when a node joins again."""
from __future__ import annotations

import threading

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from support import read_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.exclusive]


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster(2, 2)


@pytest.mark.timeout(300)
def test_node_removal_rescales_down_and_a_new_node_grows_it_back(cluster, run_dir):
    cluster, nodes = cluster
    outcome: dict = {}

    def train():
        try:
            outcome["result"] = ElasticTrainer(
                gpt.train_loop, train_loop_config={"model_size": "tiny", "batch_size": 8}, total_steps=1200,
                seed=0, scaling=ScalingConfig(min_workers=2, max_workers=4, node_agents=True),
                checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=500),
                failure=FailureConfig(heartbeat_timeout_s=10.0)).fit()
        except BaseException as error:   # noqa: BLE001 - reported by the assertion below
            outcome["error"] = error

    def running_at(step):
        status = read_json(run_dir, "status.json") or {}
        return status.get("state") == "running" and status.get("step", 0) >= step

    # The trainer runs in a thread: Cluster.remove_node/add_node must be called from the main thread.
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    # On a loaded machine the run may start with 2 workers and grow: lose the node at world size 4,
    # once each node's agent carries its workers' polls (ScalingConfig.node_agents): the node's
    # loss is then seen through its agent's.
    wait_for(lambda: running_at(40) and read_json(run_dir, "status.json").get("world_size") == 4
             and all(w.get("polled_by") == "agent" for w in read_json(run_dir, "status.json")["workers"]), 120,
             "the run to reach step 40 with 4 workers, polled by their nodes' agents")
    status = read_json(run_dir, "status.json")
    node_id = next(w["node_id"] for w in status["workers"] if w["rank"] == 1)
    cluster.remove_node(next(n for n in nodes if n.node_id == node_id))
    removed_at = status["step"]
    wait_for(lambda: (read_json(run_dir, "status.json") or {}).get("world_size") == 2 and running_at(removed_at + 20),
             120, "the run to go on at world size 2")
    cluster.add_node(num_cpus=2)
    trainer.join(timeout=200)
    assert "error" not in outcome, outcome
    result = outcome["result"]
    s = result.summary
    assert result.ok and s["final_step"] == 1200, result.error_traceback
    lost = [r for r in s["recoveries"] if r["cause"] != "scale_up"]
    assert lost and lost[0]["cause"] == "node_lost" and lost[0]["from_world"] == 4 and lost[0]["to_world"] == 2
    assert lost[0]["rung"] == "warm" and lost[0]["lost_steps"] <= 1
    sizes = [w for _, w in s["world_size_history"]]
    assert 4 in sizes and 2 in sizes[sizes.index(4):] and sizes[-1] == 4, s["world_size_history"]

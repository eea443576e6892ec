"""Losing a whole node with `ray.cluster_utils.Cluster`: the run rescales onto the nodes it has
left, and grows back when a node joins again."""
from __future__ import annotations

import sys
import threading

import pytest

import gpt
import support
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from support import ShrunkHold, read_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.exclusive]

STEPS = 400
SHRUNK_STEPS = 25     # steps the group of 2 trains before it waits for the regrowth (the test waits for 20)


def held_while_shrunk(ctx) -> None:
    gpt.train_loop(ShrunkHold.wrap(ctx))


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster(2, 2)


@pytest.mark.timeout(300)
def test_node_removal_rescales_down_and_a_new_node_grows_it_back(cluster, run_dir):
    from ray import cloudpickle
    for module in (gpt, support, sys.modules[__name__]):     # the workers import none of them
        cloudpickle.register_pickle_by_value(module)
    cluster, nodes = cluster
    outcome: dict = {}
    # Once the node is gone, the group of 2 waits after SHRUNK_STEPS steps until both of the
    # new node's workers are ready: the regrowth lands inside the run however slowly they start.
    removed_file = run_dir.rstrip("/") + ".node-removed"
    hold = ShrunkHold(2, SHRUNK_STEPS, run_dir.rstrip("/") + ".regrow", armed_file=removed_file)

    def train():
        try:
            outcome["result"] = ElasticTrainer(
                held_while_shrunk, train_loop_config={"model_size": "tiny", "batch_size": 8, **hold.as_config()},
                total_steps=STEPS, seed=0,
                scaling=ScalingConfig(min_workers=2, max_workers=4, node_agents=True, startup_wait_s=120),
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
    try:
        # Lose the node at world size 4, once each node's agent carries its workers' polls
        # (ScalingConfig.node_agents): the node's loss is then seen through its agent's.
        wait_for(lambda: running_at(40) and read_json(run_dir, "status.json").get("world_size") == 4
                 and all(w.get("polled_by") == "agent" for w in read_json(run_dir, "status.json")["workers"]), 120,
                 "the run to reach step 40 with 4 workers, polled by their nodes' agents")
        status = read_json(run_dir, "status.json")
        node_id = next(w["node_id"] for w in status["workers"] if w["rank"] == 1)
        open(removed_file, "w").close()
        cluster.remove_node(next(n for n in nodes if n.node_id == node_id))
        removed_at = status["step"]
        wait_for(lambda: (read_json(run_dir, "status.json") or {}).get("world_size") == 2
                 and running_at(removed_at + 20), 120, "the run to go on at world size 2")
        cluster.add_node(num_cpus=2)
        hold.release_when(run_dir, lambda status: len(status.get("spares") or []) >= 2, 120,
                          "the new node's two workers ready beside the group of 2").join()
    finally:
        open(hold.release_file, "w").close()
    trainer.join(timeout=200)
    assert "error" not in outcome, outcome
    result = outcome["result"]
    s = result.summary
    assert result.ok and s["final_step"] == STEPS, result.error_traceback
    lost = [r for r in s["recoveries"] if r["cause"] != "scale_up"]
    assert lost and lost[0]["cause"] == "node_lost" and lost[0]["from_world"] == 4 and lost[0]["to_world"] == 2
    assert lost[0]["rung"] == "warm" and lost[0]["lost_steps"] <= 1
    sizes = [w for _, w in s["world_size_history"]]
    assert 4 in sizes and 2 in sizes[sizes.index(4):] and sizes[-1] == 4, s["world_size_history"]

"""Losing a whole node with `ray.cluster_utils.Cluster`, under FSDP: the run rescales onto the
node it has left, rebuilding the lost node's shards from the copies its ranks sent to the other
node (the memory rung: no storage read), and grows back when a node joins again.

The run starts on one node and grows onto a second, so ranks 0 and 1 are on the first node and
2 and 3 on the second: the placement where a ring of copies one rank on (0 -> 1) keeps a copy
on its own node, and the controller's step of 2 (GenerationPlan.copy_shift) does not."""
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
SHRUNK_STEPS = 25     # steps the group of 2 trains before it waits for the regrowth (the test waits for 13)
COPY_EVERY = 10


def held_while_shrunk(ctx) -> None:
    gpt.train_loop(ShrunkHold.wrap(ctx))


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster(2)


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
                scaling=ScalingConfig(min_workers=2, max_workers=4, node_agents=True, startup_wait_s=1,
                                      strategy="fsdp"),
                checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=500, in_memory_every_n_steps=COPY_EVERY),
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
        wait_for(lambda: running_at(1), 120, "the run to start on the first node")
        nodes.append(cluster.add_node(num_cpus=2))
        # Lose the node at world size 4, once each node's agent carries its workers' polls
        # (ScalingConfig.node_agents): the node's loss is then seen through its agent's.
        wait_for(lambda: running_at(40) and read_json(run_dir, "status.json").get("world_size") == 4
                 and all(w.get("polled_by") == "agent" for w in read_json(run_dir, "status.json")["workers"]), 120,
                 "the run to reach step 40 with 4 workers, polled by their nodes' agents")
        # ... and to have taken copies at world size 4: until then the copies are those of the
        # world of 3 it grew through, two ranks on the first node and one on the second, where no
        # step of the ring puts every copy on the other node.
        grown_at = read_json(run_dir, "status.json")["step"]
        wait_for(lambda: running_at(grown_at + COPY_EVERY + 1)
                 and read_json(run_dir, "status.json").get("world_size") == 4, 120,
                 "the run to take its copies at world size 4")
        status = read_json(run_dir, "status.json")
        node_id = next(w["node_id"] for w in status["workers"] if w["rank"] == 1)
        assert sorted(w["rank"] for w in status["workers"] if w["node_id"] == node_id) == [0, 1], status["workers"]
        open(removed_file, "w").close()
        cluster.remove_node(next(n for n in nodes if n.node_id == node_id))
        removed_at = status["step"]
        # The group of 2 restores the copies of a step at most COPY_EVERY back, and holds
        # SHRUNK_STEPS steps after it: it trains past removed_at + 13 before it holds.
        wait_for(lambda: (read_json(run_dir, "status.json") or {}).get("world_size") == 2
                 and running_at(removed_at + SHRUNK_STEPS - COPY_EVERY - 2), 120, "the run to go on at world size 2")
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
    # Each rank's copy went to the other node, so the node's loss took no shard with its only
    # copy. Nothing is committed before step 500: no checkpoint could have been read.
    assert lost[0]["rung"] == "memory" and "no storage read" in lost[0]["reason"], lost[0]
    assert lost[0]["lost_steps"] <= COPY_EVERY and s["checkpoints"] == [STEPS], lost[0]
    sizes = [w for _, w in s["world_size_history"]]
    assert 4 in sizes and 2 in sizes[sizes.index(4):] and sizes[-1] == 4, s["world_size_history"]

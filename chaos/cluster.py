"""A Ray cluster owned by the runner, for faults that remove whole nodes.

Without node faults the job starts its own embedded Ray and the runner owns none. With them,
the runner starts `ray.cluster_utils.Cluster` (as tests/integration/test_node_loss.py does): a
head with no CPUs (the job's driver and controller live there, and it is never removed) and
`nodes` one-CPU worker nodes, and hands its address to the job in RAY_ADDRESS. Removing a node
kills all its processes at once; adding one plays the autoscaler replacing a lost machine.

Call it from the main thread (Ray's node management installs signal handlers). The runner sets
RAY_TMPDIR to a private directory first, so this cluster's address file (which a bare
`ray.init()` would join) is invisible to everyone else on the machine, and theirs to the job.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("chaos.cluster")

NODE_OBJECT_STORE_BYTES = 128 * 1024 * 1024


class LocalCluster:
    supports_partition = False

    def __init__(self, nodes: int, cpus_per_node: float = 1.0):
        self.n_nodes, self.cpus_per_node = nodes, cpus_per_node
        self._cluster: Any = None                # ray.cluster_utils.Cluster, once started
        self._nodes: dict[str, object] = {}     # node_id (hex) -> ray._private.node.Node

    def start(self) -> LocalCluster:
        from ray.cluster_utils import Cluster
        self._cluster = Cluster(initialize_head=True, shutdown_at_exit=True,
                                head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                "object_store_memory": NODE_OBJECT_STORE_BYTES})
        for _ in range(self.n_nodes):
            self.add_node()
        return self

    @property
    def address(self) -> str:
        return self._cluster.address

    def env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self.address}

    def node_ids(self) -> list[str]:
        return list(self._nodes)

    def node_of(self, worker: dict) -> str | None:
        """The removable node hosting a worker of status.json (never the head)."""
        return worker.get("node_id") if worker.get("node_id") in self._nodes else None

    def exec_prefix(self) -> list[str]:
        return []

    def maintain(self) -> list[str]:
        return []     # nodes only leave when removed here, and the heal adds them back

    def add_node(self) -> str:
        node = self._cluster.add_node(num_cpus=self.cpus_per_node, object_store_memory=NODE_OBJECT_STORE_BYTES)
        self._nodes[node.node_id] = node
        log.info("added node %s", node.node_id)
        return node.node_id

    def remove_node(self, node_id: str) -> None:
        node = self._nodes.pop(node_id, None)
        if node is None:
            raise KeyError(f"node {node_id} is not one of this cluster's worker nodes")
        # Not graceful: a machine that dies does not drain.
        self._cluster.remove_node(node, allow_graceful=False)
        log.info("removed node %s", node_id)

    def shutdown(self) -> None:
        if self._cluster is None:
            return
        try:
            self._cluster.shutdown()
        finally:
            self._nodes.clear()
            self._cluster = None


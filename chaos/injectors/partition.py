"""Network partition: the link of the nodes hosting the target workers is cut, then restored.

Needs a cluster whose nodes live in their own network namespaces (chaos.netns), so that a
link can be cut for one node without touching the rest of the machine. Anywhere else the
injector reports itself unsupported and the nemesis skips partition faults, saying why.
"""
from __future__ import annotations

import random

from chaos.faults import Fault, Partition
from chaos.injectors import Active, Injector, Skip, Unsupported


class PartitionInjector(Injector):
    kind = "partition"

    def setup(self) -> None:
        cluster = self.env.cluster
        if cluster is None or not getattr(cluster, "supports_partition", False):
            reason = getattr(cluster, "partition_unsupported_reason", None) or (
                "partition needs Ray nodes in network namespaces (scenario `partition`/`mixed` with "
                "root, iproute2 and bridge support); this run has " +
                ("an embedded Ray" if cluster is None else "a cluster without namespaces"))
            raise Unsupported(reason)

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, Partition)
        workers = self.targets(fault.target, rng)
        hosts = {w["rank"]: self.env.cluster.node_of(w) for w in workers}
        nodes = sorted({n for n in hosts.values() if n is not None})
        if not nodes:
            raise Skip("the target workers run on no node that can be cut off")
        for node in nodes:
            self.env.cluster.cut(node)
        ranks = [rank for rank, node in hosts.items() if node is not None]
        return Active(fault, {"nodes": nodes, "ranks": ranks, "pids": [w["pid"] for w in workers]},
                      state=nodes)

    def heal(self, active: Active) -> dict:
        restored = []
        for node_id in active.state:
            restored.append(self.env.cluster.reconnect(node_id))
        return {"reconnected": restored}

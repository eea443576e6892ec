"""Node loss: every process of the Ray nodes hosting the target workers dies at once; the heal
adds as many fresh nodes, as an autoscaler replacing lost machines would."""
from __future__ import annotations

import random

from chaos.faults import Fault, KillNode
from chaos.injectors import Active, Injector, Skip, Unsupported


class KillNodeInjector(Injector):
    kind = "kill_node"

    def setup(self) -> None:
        if self.env.cluster is None:
            raise Unsupported("kill_node needs a runner-owned Ray cluster; the scenario must set `nodes`")

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, KillNode)
        workers = self.targets(fault.target, rng)
        hosts = {w["rank"]: self.env.cluster.node_of(w) for w in workers}
        removed = sorted({n for n in hosts.values() if n is not None})
        if not removed:
            raise Skip(f"the target workers run on no removable node (nodes {self.env.cluster.node_ids()})")
        for node in removed:
            self.env.cluster.remove_node(node)
        ranks = [rank for rank, node in hosts.items() if node is not None]
        return Active(fault, {"nodes": removed, "ranks": ranks, "pids": [w["pid"] for w in workers]},
                      state={"removed": removed, "added": []})

    def heal(self, active: Active) -> dict:
        state = active.state
        while len(state["added"]) < len(state["removed"]):
            state["added"].append(self.env.cluster.add_node())
        return {"added_nodes": list(state["added"])}

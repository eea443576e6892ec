"""Nodes the run stops placing workers on: those whose ranks silent data corruption named twice.

A silent corruption verdict (elastic._worker.fingerprint) names a rank, and the controller
replaces its worker; the replacement may land on the same node. Memory or a GPU that corrupts
once may be a cosmic ray; twice on one node, the node is suspect: it is marked bad, the
placements of new workers exclude it from then on (a label selector on Ray's node id, so Ray never
grants a bundle there), and status.json lists it (`bad_nodes`). For this run only: the mark is
not kept on storage, and a node Ray replaces comes back with a new id.
"""
from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("elastic.controller")

FLAGS_TO_MARK = 2      # corruption verdicts naming a rank on one node before it is marked bad


class BadNodes:
    """The run's count of corruption verdicts per node, and the nodes marked bad (in order)."""

    def __init__(self) -> None:
        self._flags: Counter[str] = Counter()
        self._bad: list[str] = []

    def flag(self, node_id: str, why: str) -> bool:
        """A rank on `node_id` was named by a verdict; True when this marks the node bad."""
        self._flags[node_id] += 1
        if self._flags[node_id] < FLAGS_TO_MARK or node_id in self._bad:
            return False
        self._bad.append(node_id)
        log.warning("node %s marked bad: %d silent corruption verdicts named its ranks (latest: %s); no worker "
                    "of this run is placed there again", node_id[:12], self._flags[node_id], why)
        return True

    @property
    def bad(self) -> tuple[str, ...]:
        return tuple(self._bad)

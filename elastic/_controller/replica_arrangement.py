"""Which workers form a group of whole replicas, and at which ranks.

Under tensor parallelism (ScalingConfig.tensor_parallel_size = T > 1) a group is D replicas of T
consecutive ranks (elastic.layout), and a survivor's memory holds the shard of one TP rank. So:
- a group has a multiple of T members: the run grows and shrinks one replica at a time, and a
  replica that lost a rank leaves the group whole, its healthy ranks waiting outside it as warm
  members until a replacement completes a replica again;
- a survivor is placed at the TP rank of the shard it holds wherever it can be, so that every
  TP rank of the new group has a warm source among the ranks of that TP rank (the warm rung moves
  each shard within its data-parallel group, elastic._worker.warm_slices), and every holder of
  FSDP copies at the TP rank of its copies (the memory rung rebuilds within that group too);
- members are grouped by node, so that a replica's ranks share a node where the workers allow it
  (a TP group's traffic is the heaviest of the step): a holder joins a replica begun on its node,
  and a replacement placed beside its lost rank's peers (placement: the replica's placement group)
  completes their replica.
With T = 1 every worker holds the whole state and the order is the candidates' own.

Under HSDP (strategy "hsdp") the unit that joins and leaves together is a shard group of
S x T ranks (ScalingConfig.unit_size), not a replica: FSDP2 shards the state over the group's
ranks and every shard group holds all of it. The functions here take that unit: a worker's
report names its shard as (position in its unit, unit), and "TP rank" below reads "position in
its unit" (they are the same where the unit is one replica).
"""
from __future__ import annotations

from collections.abc import Mapping

from elastic._protocol import WorkerReport


def whole_replicas(count: int, unit: int) -> int:
    """The most members of `count` candidates that form whole units of `unit` ranks (replicas, or
    under hsdp shard groups)."""
    return count - count % unit


def arrange(candidates: list[int], settled: Mapping[int, WorkerReport], unit: int, *, limit: int,
            node_of: Mapping[int, str] | None = None) -> list[int]:
    """The new group in rank order: at most `limit` of `candidates` (in the order they are
    preferred: survivors furthest ahead first, then spares), as whole replicas of `unit` ranks.

    The replicas that survived whole come first and stay together; then each other holder of a
    TP shard takes a place at its TP rank where one is free, in a replica begun on its node if
    there is one, else in an empty one; the rest fill the free places, first those of the
    replicas begun on their node, then the others in rank order, grouped by node. A lost rank's
    peers thus wait outside the group while whole replicas can fill it, and join it again to
    complete a replica with a replacement: one placed beside them (placement: into their
    replica's placement group) completes theirs, not another node's."""
    size = whole_replicas(min(limit, len(candidates)), unit)
    if unit == 1:
        return candidates[:size]
    nodes = node_of or {}
    grid: list[list[int | None]] = [[None] * unit for _ in range(size // unit)]
    placed: set[int] = set()
    whole, holders = _whole_replicas(candidates, settled, unit)
    for replica, row in zip(whole, grid, strict=False):    # as many whole replicas as there are places
        row[:] = replica          # one member of each TP rank, in TP rank order
        placed.update(replica)
    for wid in holders:
        shard = _shard(settled.get(wid), unit)
        if shard is None or wid in placed:
            continue
        joined = _row_for(grid, shard, nodes.get(wid, ""), nodes)
        if joined is not None:
            joined[shard] = wid
            placed.add(wid)
    rest = [w for w in candidates if w not in placed]
    if node_of is not None:
        first_seen = {node: i for i, node in enumerate(dict.fromkeys(node_of.get(w, "") for w in candidates))}
        rest.sort(key=lambda w: first_seen[node_of.get(w, "")])
    _fill(grid, rest, nodes)
    return [cell for row in grid for cell in row if cell is not None]


def _node_of_row(row: list[int | None], nodes: Mapping[int, str]) -> str | None:
    """The node of a replica's first placed member (None: nobody placed in it yet)."""
    return next((nodes.get(w, "") for w in row if w is not None), None)


def _row_for(grid: list[list[int | None]], col: int, node: str, nodes: Mapping[int, str]) -> list[int | None] | None:
    """The replica a holder of TP rank `col`'s shard on `node` joins: the first begun on its node
    with that place free, else the first empty one, else the first with that place free."""
    free = [row for row in grid if row[col] is None]
    return (next((row for row in free if _node_of_row(row, nodes) == node), None)
            or next((row for row in free if _node_of_row(row, nodes) is None), None)
            or next(iter(free), None))


def _fill(grid: list[list[int | None]], rest: list[int], nodes: Mapping[int, str]) -> None:
    """Fill the free places of `grid` from `rest` (in its order): the replicas begun first, each
    from its own node's workers (a replacement joins its waiting peers), then every free place in
    rank order, a node's workers where the replica's first member is on it."""
    pool = list(rest)

    def take(node: str | None) -> int | None:
        i = next((i for i, w in enumerate(pool) if nodes.get(w, "") == node), None)
        return pool.pop(i) if i is not None else None

    for row in grid:
        node = _node_of_row(row, nodes)
        for col in range(len(row)):
            if node is not None and row[col] is None:
                row[col] = take(node)
    for row in grid:
        for col in range(len(row)):
            if row[col] is None:
                node = _node_of_row(row, nodes)
                wid = take(node) if node is not None else None
                row[col] = wid if wid is not None else pool.pop(0)


def _shard(report: WorkerReport | None, unit: int) -> int | None:
    """The TP rank whose state a worker holds in memory (None: none, or of another TP degree):
    its warm state's (DDP), or its FSDP copies' (they ring within a TP rank: its own and its
    left neighbour's old ranks are of one TP rank)."""
    if report is None:
        return None
    if report.has_state and report.shard[1] == unit:
        return report.shard[0]
    held = report.replicas
    if not report.has_state and held is not None and held.world_size % unit == 0:
        return held.ranks[0] % unit
    return None


def _whole_replicas(candidates: list[int], settled: Mapping[int, WorkerReport], unit: int
                    ) -> tuple[list[list[int]], list[int]]:
    """The replicas that are whole among `candidates` (every TP rank of one replica of the same
    generation), in their replica's order, each in TP rank order; and the other candidates, in
    order."""
    replicas: dict[tuple[int, int], list[int]] = {}
    for wid in candidates:
        report = settled.get(wid)
        if report is not None and report.rank is not None and _shard(report, unit) is not None:
            replicas.setdefault((report.generation, report.rank // unit), []).append(wid)
    whole = [sorted(replicas[key], key=lambda w: _shard(settled[w], unit) or 0) for key in sorted(replicas)
             if {_shard(settled[w], unit) for w in replicas[key]} == set(range(unit))]
    taken = {w for replica in whole for w in replica}
    return whole, [w for w in candidates if w not in taken]


def warm_sources(members: list[int], settled: Mapping[int, WorkerReport], unit: int
                 ) -> tuple[int, tuple[int, ...]] | str:
    """(step, source ranks) of a warm restore: the members holding the newest step any member
    holds, each at the TP rank of its shard; or why there is none (a TP rank with no source)."""
    holders = [w for w in members if w in settled and settled[w].has_state]
    if not holders:
        return "no member holds the state in memory"
    newest = max(settled[w].step for w in holders)
    sources = tuple(rank for rank, w in enumerate(members)
                    if w in settled and settled[w].has_state and settled[w].step == newest
                    and settled[w].shard == (rank % unit, unit))
    missing = sorted(set(range(unit)) - {rank % unit for rank in sources})
    if missing:
        return (f"no member holds the shard at position(s) {missing} of a unit of {unit} ranks (its TP x PP places, "
                f"or an HSDP shard group's) at step {newest} (a unit lost every holder of it)")
    return newest, sources

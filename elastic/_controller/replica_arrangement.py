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
- within a TP rank, members are ordered by node, so that a replica's ranks share a node where
  the workers allow it (a TP group's traffic is the heaviest of the step).
With T = 1 every worker holds the whole state and the order is the candidates' own.
"""
from __future__ import annotations

from collections.abc import Mapping

from elastic._protocol import WorkerReport


def whole_replicas(count: int, tp: int) -> int:
    """The most members of `count` candidates that form whole replicas of `tp` ranks."""
    return count - count % tp


def arrange(candidates: list[int], settled: Mapping[int, WorkerReport], tp: int, *, limit: int,
            node_of: Mapping[int, str] | None = None) -> list[int]:
    """The new group in rank order: at most `limit` of `candidates` (in the order they are
    preferred: survivors furthest ahead first, then spares), as whole replicas of `tp` ranks.

    The replicas that survived whole come first and stay together; then each other holder of a
    TP shard takes a place at its TP rank where one is free; the rest fill the free places in
    rank order, grouped by node. A lost rank's peers thus wait outside the group while whole
    replicas can fill it, and join it again to complete a replica with a replacement."""
    size = whole_replicas(min(limit, len(candidates)), tp)
    if tp == 1:
        return candidates[:size]
    dp = size // tp
    grid: list[list[int | None]] = [[None] * tp for _ in range(dp)]
    placed: set[int] = set()
    for wid in _whole_replicas_first(candidates, settled, tp):
        shard = _shard(settled.get(wid), tp)
        if shard is None:
            continue
        row = next((r for r in grid if r[shard] is None), None)
        if row is not None:
            row[shard] = wid
            placed.add(wid)
    rest = [w for w in candidates if w not in placed]
    if node_of is not None:
        first_seen = {node: i for i, node in enumerate(dict.fromkeys(node_of.get(w, "") for w in candidates))}
        rest.sort(key=lambda w: first_seen[node_of.get(w, "")])
    fill = iter(rest)
    return [cell if cell is not None else next(fill) for row in grid for cell in row]


def _shard(report: WorkerReport | None, tp: int) -> int | None:
    """The TP rank whose state a worker holds in memory (None: none, or of another TP degree):
    its warm state's (DDP), or its FSDP copies' (they ring within a TP rank: its own and its
    left neighbour's old ranks are of one TP rank)."""
    if report is None:
        return None
    if report.has_state and report.shard[1] == tp:
        return report.shard[0]
    held = report.replicas
    if not report.has_state and held is not None and held.world_size % tp == 0:
        return held.ranks[0] % tp
    return None


def _whole_replicas_first(candidates: list[int], settled: Mapping[int, WorkerReport], tp: int) -> list[int]:
    """`candidates` with the members of replicas that are whole among them (every TP rank of one
    replica of the same generation) first, in their replica's order; the others after, in order."""
    replicas: dict[tuple[int, int], list[int]] = {}
    for wid in candidates:
        report = settled.get(wid)
        if report is not None and report.rank is not None and _shard(report, tp) is not None:
            replicas.setdefault((report.generation, report.rank // tp), []).append(wid)
    whole = [w for key in sorted(replicas) if len(replicas[key]) == tp
             for w in sorted(replicas[key], key=lambda w: settled[w].shard[0])]
    taken = set(whole)
    return whole + [w for w in candidates if w not in taken]


def warm_sources(members: list[int], settled: Mapping[int, WorkerReport], tp: int
                 ) -> tuple[int, tuple[int, ...]] | str:
    """(step, source ranks) of a warm restore: the members holding the newest step any member
    holds, each at the TP rank of its shard; or why there is none (a TP rank with no source)."""
    holders = [w for w in members if w in settled and settled[w].has_state]
    if not holders:
        return "no member holds the state in memory"
    newest = max(settled[w].step for w in holders)
    sources = tuple(rank for rank, w in enumerate(members)
                    if w in settled and settled[w].has_state and settled[w].step == newest
                    and settled[w].shard == (rank % tp, tp))
    missing = sorted(set(range(tp)) - {rank % tp for rank in sources})
    if missing:
        return (f"no member holds the shard of TP rank(s) {missing} at step {newest} (a replica lost every "
                f"holder of it)")
    return newest, sources

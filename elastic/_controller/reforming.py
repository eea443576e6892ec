"""Whom a recovery re-forms the group with, once its survivors have settled.

`judge_reform` takes the settled survivors (out of the broken group, with their reports) and the
ready spares and returns the new group (`Reform`: the survivors furthest ahead first, then the
spares, up to the cap and a resize's size) or `TooFew`: fewer than min_workers, to wait for
replacements, or to give up on once FailureConfig.rendezvous_timeout_s has passed since the
failure. It acts on nothing (the controller asks forming.GenerationFormer.reform_plan for the
new group's restore and starts it).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic._controller.ledgers import OpenRecovery
from elastic._controller.states import Recovering
from elastic._protocol import WorkerReport
from elastic.config import FailureConfig, ScalingConfig
from elastic.errors import InsufficientWorkersError
from elastic.policies import Cause


@dataclass(frozen=True)
class Reform:
    """Re-form with `members` (worker ids in rank order), of which `survivors` come from the old group."""

    members: list[int]
    survivors: list[int]

    @property
    def reason(self) -> str:
        return (f"re-forming with {len(self.survivors)} survivor(s) and "
                f"{len(self.members) - len(self.survivors)} new")


@dataclass(frozen=True)
class TooFew:
    """Fewer than min_workers: wait for replacements, or (`error`) the run fails."""

    error: InsufficientWorkersError | None = None


def judge_reform(st: Recovering, settled: dict[int, WorkerReport], ready: list[int],
                 cap: Callable[..., list[int]], recovery: OpenRecovery, *, now: float,
                 scaling: ScalingConfig, failure: FailureConfig) -> Reform | TooFew:
    """The new group of the recovery `st` (`recovery`: the one open) from the `settled`
    survivors (by worker id) and the `ready` workers, capped by `cap`."""
    members, survivors = plan_members(st, settled, ready, cap)
    if len(members) >= scaling.min_workers:
        return Reform(members, survivors)
    if now - recovery.detected_at > failure.rendezvous_timeout_s:
        return TooFew(too_few_to_reform(len(members), recovery.cause, scaling, failure))
    return TooFew()


def plan_members(st: Recovering, settled: dict[int, WorkerReport], ready: list[int],
                 cap: Callable[..., list[int]]) -> tuple[list[int], list[int]]:
    """The new group: the settled survivors, furthest ahead first (the order they had among
    equals), then the ready spares, up to the cap (Slots.cap: whole replicas, in rank order).
    Returns (members, survivors among them)."""
    order = {w: i for i, w in enumerate(st.survivors)}
    survivors = sorted(settled, key=lambda w: (-settled[w].step, order[w]))
    spares = [w for w in ready if w not in order]
    members = cap(survivors + spares, settled=settled, limit=st.target_world)
    kept = set(members)
    return members, [w for w in survivors if w in kept]


def too_few_to_reform(left: int, cause: Cause, scaling: ScalingConfig,
                      failure: FailureConfig) -> InsufficientWorkersError:
    return InsufficientWorkersError(
        f"{left} workers left after {cause}, fewer than min_workers={scaling.min_workers}, and no "
        f"replacement was placed within FailureConfig.rendezvous_timeout_s={failure.rendezvous_timeout_s:.0f}s")

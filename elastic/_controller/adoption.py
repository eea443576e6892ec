"""A controller that replaces a lost one: what it makes of the workers it finds.

The lost controller's journal (elastic._controller.journal) says which state it was in and with
which members; the workers found alive under the run's names (elastic._run_names) say where they are. The
judge here decides, and the controller acts on it (Controller.take_over):

- RUNNING: the journal's generation was running. Its members found alive are adopted and go on
  training as if nothing happened (they never stopped: collectives need no controller); a member
  not found, or found in another generation, is lost, and the first tick meets it as the fault it
  is (a recovery, from its peers' memory when they hold the state). Other workers found are spares.
- IDLE: no generation had started (scheduling): every worker found is adopted as ready.
- RESTART: the controller was lost in the middle of a change (forming a generation, recovering,
  stopping), where the members' positions depend on calls it was making. The workers found are
  replaced and the run goes on from its newest checkpoint, as a resume does. A controller spends
  well under 1 % of a run in those states; adopting them in place is left for later.
- FRESH: no journal entry (the controller was lost before its first change of state): any worker
  found is replaced and the run starts as if for the first time.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from elastic._controller.journal import JournalEntry
from elastic._controller.states import Running, Scheduling
from elastic._protocol import WorkerReport


class AdoptionKind(enum.StrEnum):
    RUNNING = "running"
    IDLE = "idle"
    RESTART = "restart"
    FRESH = "fresh"


@dataclass(frozen=True)
class Adoption:
    kind: AdoptionKind
    adopted: list[int]                                      # workers kept
    lost: list[int] = field(default_factory=list)           # members not found alive
    replaced: list[int] = field(default_factory=list)       # workers found, killed
    reason: str = ""


def judge(entry: JournalEntry | None, reports: dict[int, WorkerReport]) -> Adoption:
    """What a replacing controller does with the workers it found (`reports`: worker id -> its
    answer to the adoption), given the lost controller's newest journal `entry`."""
    found = sorted(reports)
    if entry is None:
        return Adoption(AdoptionKind.FRESH, [], replaced=found,
                        reason=f"no journal: {len(found)} workers found are replaced, the run starts over")
    state = entry.state
    if isinstance(state, Running):
        lost = [w for w in state.members if w not in reports]
        astray = [w for w in state.members if w in reports and reports[w].generation != state.generation]
        kept = [w for w in found if w not in astray]
        words = f"generation {state.generation} goes on: {len(state.members) - len(lost) - len(astray)} of its " \
                f"{len(state.members)} members adopted"
        if lost or astray:
            words += f", workers {sorted(lost + astray)} lost while no controller was there"
        return Adoption(AdoptionKind.RUNNING, kept, lost=lost, replaced=astray, reason=words)
    if isinstance(state, Scheduling):
        return Adoption(AdoptionKind.IDLE, found, reason=f"no generation had started: {len(found)} workers adopted")
    return Adoption(AdoptionKind.RESTART, [], replaced=found,
                    reason=f"lost while {state.state.value}: {len(found)} workers replaced, the run goes on from "
                           f"its newest checkpoint")


def restart_record(adoption: Adoption, *, lost_at: float, adopted_at: float, pid: int, node: str) -> dict[str, Any]:
    """summary.json's record of one controller restart: how long the run had no controller (from
    the lost one's last sign of life to the adoption's end) and what was adopted."""
    return {"kind": adoption.kind.value, "lost_at": round(lost_at, 3), "adopted_at": round(adopted_at, 3),
            "without_controller_s": round(max(0.0, adopted_at - lost_at), 3), "adopted": len(adoption.adopted),
            "lost": len(adoption.lost), "replaced": len(adoption.replaced), "pid": pid, "node": node,
            "reason": adoption.reason}

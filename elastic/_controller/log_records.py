"""The controller's choice among `ctx.log(...)` records: one per (generation, step, keys), the lowest rank's.

Every rank may log the same values (the usual `ctx.log(val_loss=...)` after an evaluation every
rank ran), so the same record arrives once per rank, in whichever order the polls come back. A
record is held until no lower rank of its generation can still send one of its own: a rank's
records reach the controller in the order they were made, and a rank's log at step N is made
before its step N + 1, so a lower rank has nothing more to send for step N once it has reported a
later step, left the generation's loop, or died. Usually the lowest rank's arrives first (rank 0
logs) and goes at once; a record only a higher rank sent waits about one step.
"""
from __future__ import annotations

from collections.abc import Callable

from elastic._protocol import StepRecord

GENERATIONS_KEPT = 4     # members of the newest generations (records of older ones go at once)

Key = tuple[int, int, tuple[str, ...]]


def key_of(record: StepRecord) -> Key:
    return record.generation, record.step, tuple(sorted(record.metrics))


class LogRecordPicker:
    def __init__(self) -> None:
        self._held: dict[Key, tuple[int, StepRecord]] = {}   # key -> (rank, record): the lowest rank's so far
        # Keys handed to the run record, kept while another rank's copy may still come.
        self._taken: dict[Key, StepRecord] = {}
        self._members: dict[int, list[int]] = {}              # generation -> worker ids in rank order
        self._ranks: dict[int, dict[int, int]] = {}           # generation -> worker id -> rank (offer's lookup)

    def note_members(self, generation: int, members: list[int]) -> None:
        if generation in self._members:       # a generation's members never change (asked every tick)
            return
        self._members[generation] = list(members)
        self._ranks[generation] = {wid: rank for rank, wid in enumerate(members)}
        for old in sorted(self._members)[:-GENERATIONS_KEPT]:
            del self._members[old], self._ranks[old]

    def offer(self, wid: int, record: StepRecord) -> None:
        key = key_of(record)
        if key in self._taken:
            return
        # A sender outside the known members (not expected) ranks after every member. (A dict, not
        # members.index(): every rank may log every step, and .index() made that O(N^2).)
        ranks = self._ranks.get(record.generation, {})
        rank = ranks.get(wid, len(ranks))
        held = self._held.get(key)
        if held is None or rank < held[0]:
            self._held[key] = (rank, record)

    def release(self, settled: Callable[[int, StepRecord], bool], everything: bool = False) -> list[StepRecord]:
        """The held records that no lower rank can better, in step order.

        `settled(wid, record)` is asked for each member ranked below a record's sender: True when
        that worker can send no more records of the record's generation and step. With
        `everything`, every held record goes (the run ended)."""
        out = []
        for key, (rank, record) in list(self._held.items()):
            members = self._members.get(record.generation)
            if everything or members is None or all(settled(wid, record) for wid in members[:rank]):
                out.append(record)
                self._taken[key] = record
                del self._held[key]
        # A key is forgotten once no member can send a copy any more: a run that logs every
        # step keeps a few steps' keys, not the whole run's.
        for key, record in list(self._taken.items()):
            members = self._members.get(record.generation)
            if members is None or all(settled(wid, record) for wid in members):
                del self._taken[key]
        return sorted(out, key=lambda r: r.step)

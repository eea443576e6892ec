"""Straggler scoring: which rank's own compute keeps the group waiting.

Synchronous training runs at the pace of its slowest rank, so what matters is each rank's own
compute time per step, not its step time (every rank's step time is the slowest one's). Workers
measure it (see elastic._worker.step_timer) and the step records carry every rank's value.

A rank's score for one step is its compute time over the median of the *other* ranks' (so with
two ranks the score of a 1.5x slower rank is 1.5, not diluted by itself). Its score over a window
is the median of those ratios: one hiccup (a GC pause, a page fault storm) does not flag it, a
rank that stays slow does. Flags have hysteresis: a flagged rank is cleared only once its score
falls back under 90 % of the threshold. A rank is flagged only if it also costs the group
`min_excess_s` per step (median over the window of its compute minus the others' median): a
high ratio on a few milliseconds of compute is scheduling noise, and evicting for it would cost
a recovery to save almost nothing.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StragglerFlag:
    rank: int
    step: int
    score: float

    def as_json(self) -> dict:
        return {"rank": self.rank, "step": self.step, "score": round(self.score, 3)}


class StragglerDetector:
    def __init__(self, *, window: int, threshold: float, min_excess_s: float = 0.0):
        self.window, self.threshold, self.min_excess_s = window, threshold, min_excess_s
        self._ratios: list[deque[float]] = []
        self._excess: list[deque[float]] = []
        self._flagged: dict[int, StragglerFlag] = {}

    def reset(self, world_size: int) -> None:
        """A new generation: ranks are renumbered and step times change, so start over."""
        self._ratios = [deque(maxlen=self.window) for _ in range(world_size)]
        self._excess = [deque(maxlen=self.window) for _ in range(world_size)]
        self._flagged = {}

    def observe(self, step: int, compute_s: tuple[float, ...] | list[float]) -> list[StragglerFlag]:
        """Add one step's compute times (one per rank); returns the ranks newly flagged."""
        if len(compute_s) != len(self._ratios) or len(compute_s) < 2:
            return []
        new = []
        for rank, own in enumerate(compute_s):
            others = statistics.median(c for r, c in enumerate(compute_s) if r != rank)
            if others <= 0:
                continue
            ratios = self._ratios[rank]
            ratios.append(own / others)
            self._excess[rank].append(own - others)
            if len(ratios) < self.window:
                continue
            score = statistics.median(ratios)
            if score >= self.threshold and statistics.median(self._excess[rank]) >= self.min_excess_s:
                if rank not in self._flagged:
                    new.append(StragglerFlag(rank, step, score))
                self._flagged[rank] = StragglerFlag(rank, step, score)
            elif score < 0.9 * self.threshold:
                self._flagged.pop(rank, None)
        return new

    def flagged(self) -> list[StragglerFlag]:
        """Ranks flagged now, slowest first, with their latest score."""
        return sorted(self._flagged.values(), key=lambda f: -f.score)

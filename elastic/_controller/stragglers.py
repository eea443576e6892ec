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
    """Scores every rank each step in O(N log N): one sort of the step's compute times gives every
    rank's median of the others, and a rank's window medians are computed only when its window
    can reach the clearing line (most steps, for most ranks, they cannot)."""

    def __init__(self, *, window: int, threshold: float, min_excess_s: float = 0.0):
        self.window, self.threshold, self.min_excess_s = window, threshold, min_excess_s
        self._ratios: list[deque[float]] = []
        self._excess: list[deque[float]] = []
        # Per rank: how many of its window's ratios reach the clearing line (0.9 x threshold).
        # With fewer than half, its median is under the line: no median is needed to know it.
        self._high: list[int] = []
        self._flagged: dict[int, StragglerFlag] = {}

    def reset(self, world_size: int) -> None:
        """A new generation: ranks are renumbered and step times change, so start over."""
        self._ratios = [deque(maxlen=self.window) for _ in range(world_size)]
        self._excess = [deque(maxlen=self.window) for _ in range(world_size)]
        self._high = [0] * world_size
        self._flagged = {}

    def observe(self, step: int, compute_s: tuple[float, ...] | list[float]) -> list[StragglerFlag]:
        """Add one step's compute times (one per rank); returns the ranks newly flagged."""
        if len(compute_s) != len(self._ratios) or len(compute_s) < 2:
            return []
        new = []
        clear_below = 0.9 * self.threshold
        shortcut = self.threshold > 0      # the count argument needs the line above zero ratios
        for rank, (own, others) in enumerate(zip(compute_s, others_medians(compute_s), strict=True)):
            if others <= 0:
                continue
            ratios, excess = self._ratios[rank], self._excess[rank]
            ratio = own / others
            if len(ratios) == self.window and ratios[0] >= clear_below:
                self._high[rank] -= 1          # leaves the window with this append
            ratios.append(ratio)
            excess.append(own - others)
            if ratio >= clear_below:
                self._high[rank] += 1
            if len(ratios) < self.window:
                continue
            if shortcut and 2 * self._high[rank] < len(ratios):
                # Fewer than half the ratios reach the line: both middle ones are under it.
                if self._flagged:
                    self._flagged.pop(rank, None)
                continue
            score = statistics.median(ratios)
            if score >= self.threshold and statistics.median(excess) >= self.min_excess_s:
                if rank not in self._flagged:
                    new.append(StragglerFlag(rank, step, score))
                self._flagged[rank] = StragglerFlag(rank, step, score)
            elif score < clear_below:
                self._flagged.pop(rank, None)
        return new

    def flagged(self) -> list[StragglerFlag]:
        """Ranks flagged now, slowest first, with their latest score."""
        return sorted(self._flagged.values(), key=lambda f: -f.score)


def others_medians(values: tuple[float, ...] | list[float]) -> list[float]:
    """For each index, the median of all the other values (as `statistics.median` gives it), in
    O(N log N): sorted once, removing one element shifts the middle by at most one place."""
    n = len(values)
    order = sorted(range(n), key=values.__getitem__)
    ordered = [values[i] for i in order]
    m = n - 1                                # how many values remain without the own one
    lower, upper = (m - 1) // 2, m // 2      # the middle places (equal when m is odd)
    out = [0.0] * n
    for place, index in enumerate(order):
        # The k-th smallest of the others: the k-th of all if it lies before the own place, else the next.
        a = ordered[lower] if lower < place else ordered[lower + 1]
        if lower == upper:
            out[index] = a
        else:
            b = ordered[upper] if upper < place else ordered[upper + 1]
            out[index] = (a + b) / 2
    return out

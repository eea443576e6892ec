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
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StragglerFlag:
    rank: int
    step: int
    score: float

    def as_json(self) -> dict:
        return {"rank": self.rank, "step": self.step, "score": round(self.score, 3)}


class StragglerDetector:
    """Scores every rank each step in O(N log N), the per-rank work in numpy: one sort of the
    step's compute times gives every rank's median of the others, each rank's window is a column
    of a ring of arrays, and a rank's window medians are computed only when its window can reach
    the clearing line (most steps, for most ranks, they cannot). At 10,000 ranks a Python loop
    over the ranks cost ~15 ms per step of the controller's tick (S1)."""

    def __init__(self, *, window: int, threshold: float, min_excess_s: float = 0.0):
        self.window, self.threshold, self.min_excess_s = window, threshold, min_excess_s
        # Column r holds rank r's window: row (_start[r] + k) % window is its k-th oldest value.
        self._ratios = np.zeros((window, 0))
        self._excess = np.zeros((window, 0))
        self._start = np.zeros(0, dtype=np.int64)
        self._len = np.zeros(0, dtype=np.int64)
        # Per rank: how many of its window's ratios reach the clearing line (0.9 x threshold).
        # With fewer than half, its median is under the line: no median is needed to know it.
        self._high = np.zeros(0, dtype=np.int64)
        self._flagged: dict[int, StragglerFlag] = {}

    def reset(self, world_size: int) -> None:
        """A new generation: ranks are renumbered and step times change, so start over."""
        self._ratios = np.zeros((self.window, world_size))
        self._excess = np.zeros((self.window, world_size))
        self._start = np.zeros(world_size, dtype=np.int64)
        self._len = np.zeros(world_size, dtype=np.int64)
        self._high = np.zeros(world_size, dtype=np.int64)
        self._flagged = {}

    def observe(self, step: int, compute_s: tuple[float, ...] | list[float]) -> list[StragglerFlag]:
        """Add one step's compute times (one per rank); returns the ranks newly flagged."""
        n = len(compute_s)
        if n != self._len.size or n < 2:
            return []
        clear_below = 0.9 * self.threshold
        own = np.asarray(compute_s, dtype=np.float64)
        others = np.asarray(others_medians(compute_s))
        scored = np.flatnonzero(others > 0)       # a rank whose others computed nothing is skipped
        ratio = own[scored] / others[scored]
        full = self._len[scored] == self.window
        rolling, filling = scored[full], scored[~full]   # windows that drop their oldest value, and the others
        # The oldest value leaves a full window with this append (its row is the start's).
        self._high[rolling] -= self._ratios[self._start[rolling], rolling] >= clear_below
        row = (self._start[scored] + self._len[scored]) % self.window
        self._ratios[row, scored] = ratio
        self._excess[row, scored] = own[scored] - others[scored]
        self._high[scored] += ratio >= clear_below
        self._start[rolling] = (self._start[rolling] + 1) % self.window
        self._len[filling] += 1
        ready = scored[self._len[scored] == self.window]
        if self.threshold > 0:                    # the count argument needs the line above zero ratios
            if self._flagged:                     # fewer than half reach the line: both middle ones are under it
                under = ready[2 * self._high[ready] < self.window]
                for rank in set(self._flagged).intersection(under.tolist()):
                    del self._flagged[rank]
            ready = ready[2 * self._high[ready] >= self.window]
        new = []
        for rank in ready.tolist():
            score = statistics.median(self._ratios[:, rank].tolist())
            if score >= self.threshold and statistics.median(self._excess[:, rank].tolist()) >= self.min_excess_s:
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
    array = np.asarray(values, dtype=np.float64)
    order = np.argsort(array, kind="stable")
    ordered = array[order]
    m = n - 1                                # how many values remain without the own one
    lower, upper = (m - 1) // 2, m // 2      # the middle places (equal when m is odd)
    place = np.empty(n, dtype=np.int64)
    place[order] = np.arange(n)
    # The k-th smallest of the others: the k-th of all if it lies before the own place, else the next.
    a = np.where(lower < place, ordered[lower], ordered[min(lower + 1, n - 1)])
    if lower == upper:
        return a.tolist()
    b = np.where(upper < place, ordered[upper], ordered[min(upper + 1, n - 1)])
    return ((a + b) / 2).tolist()

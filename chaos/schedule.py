"""Seeded fault schedules: when each fault happens, relative to the start of training.

A schedule is a value: the same seed and parameters give the same list of (time, fault) pairs,
so a failing campaign can be replayed. Choices that depend on the live run (which worker is
"one") are made at injection time with `target_rng(index)`, a generator seeded from the
schedule's seed and the fault's index, so they too repeat for the same run history.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chaos.faults import Fault, fault_from_dict

# A menu entry: (weight, factory). The factory draws the fault's parameters from the generator.
Menu = Sequence[tuple[float, Callable[[random.Random], Fault]]]


@dataclass(frozen=True)
class ScheduledFault:
    at_s: float           # seconds after the run first reached `running`
    fault: Fault

    def to_dict(self) -> dict:
        return {"at_s": round(self.at_s, 3), "fault": self.fault.to_dict()}


@dataclass(frozen=True)
class Schedule:
    entries: tuple[ScheduledFault, ...]
    seed: int = 0
    # Wait, before each fault, until the run is running again after the previous fault's
    # recovery. Off for storms, where faults are meant to land during recoveries.
    wait_for_recovery: bool = True
    launch_faults: tuple[Fault, ...] = field(default=())   # armed in the job's arguments (UserError)

    def target_rng(self, index: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + index)

    def kinds(self) -> list[str]:
        return sorted({e.fault.kind for e in self.entries} | {f.kind for f in self.launch_faults})

    def to_dict(self) -> dict:
        return {"seed": self.seed, "wait_for_recovery": self.wait_for_recovery,
                "entries": [e.to_dict() for e in self.entries],
                "launch_faults": [f.to_dict() for f in self.launch_faults]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        return cls(entries=tuple(ScheduledFault(e["at_s"], fault_from_dict(e["fault"])) for e in data["entries"]),
                   seed=data.get("seed", 0), wait_for_recovery=data.get("wait_for_recovery", True),
                   launch_faults=tuple(fault_from_dict(f) for f in data.get("launch_faults", ())))


def fixed(faults: Sequence[tuple[float, Fault]], *, seed: int = 0, wait_for_recovery: bool = True,
          launch_faults: Sequence[Fault] = ()) -> Schedule:
    """A schedule given as (seconds, fault) pairs; sorted by time."""
    entries = tuple(ScheduledFault(float(t), f) for t, f in sorted(faults, key=lambda p: p[0]))
    return Schedule(entries, seed=seed, wait_for_recovery=wait_for_recovery, launch_faults=tuple(launch_faults))


def randomized(seed: int, menu: Menu, *, count: int, mean_interval_s: float, jitter: float | None = None,
               min_interval_s: float = 1.0, start_s: float | None = None, wait_for_recovery: bool = True,
               launch_faults: Sequence[Fault] = (), cover_menu: bool = False) -> Schedule:
    """`count` faults drawn from `menu` by weight. Intervals are exponential with mean
    `mean_interval_s` (a Poisson process, as in Jepsen), or uniform in mean x (1 +- jitter)
    when `jitter` is given; never shorter than `min_interval_s`. With `cover_menu`, the first
    len(menu) faults are one of each entry in a seeded order, so every seed has every kind
    (and a run cut short with `--faults` too)."""
    if count < 0 or mean_interval_s <= 0 or not menu:
        raise ValueError("randomized schedule: count >= 0, mean_interval_s > 0 and a non-empty menu")
    rng = random.Random(seed)
    weights = [w for w, _ in menu]
    first = rng.sample(range(len(menu)), len(menu)) if cover_menu else []
    t = mean_interval_s if start_s is None else start_s
    entries = []
    for i in range(count):
        _, factory = menu[first[i]] if i < len(first) else rng.choices(menu, weights=weights)[0]
        entries.append(ScheduledFault(round(t, 3), factory(rng)))
        if jitter is None:
            gap = rng.expovariate(1.0 / mean_interval_s)
        else:
            gap = rng.uniform(mean_interval_s * (1 - jitter), mean_interval_s * (1 + jitter))
        t += max(min_interval_s, gap)
    return Schedule(tuple(entries), seed=seed, wait_for_recovery=wait_for_recovery,
                    launch_faults=tuple(launch_faults))

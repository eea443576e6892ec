"""Which recovery each injected fault caused: the pairing `faults_recovered`,
`committed_steps_kept` and `no_bad_checkpoint_loaded` rest on.

A recovery in summary.json names its cause, the generation that ended it, the ranks of each
failure it handled and when it was detected (`detected_at`, unix seconds). A fault's recovery
has a cause the fault can produce, a later generation than the one the fault hit, belongs to
the attempt that was running, names one of the fault's ranks (when both are known), and was
detected once the fault acted. With a gated schedule (each fault waits until the run trains
again in a new generation) it was also detected before the next fault. Matching on these,
rather than on generation order alone, keeps one unmatched fault from shifting every later
pairing by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chaos.faults import fault_from_dict

if TYPE_CHECKING:
    from chaos.invariants import Evidence

INFRA_FAILURE_TYPES = ("TooManyFailuresError", "FailureRateError", "NoProgressError", "InsufficientWorkersError")
# An invoke is recorded once the injector has acted (a crash_before_commit waits for the save it
# crashes), so the controller may have detected the failure a moment before the record.
EARLY_S = 5.0


@dataclass(frozen=True)
class _Window:
    """Where a fault's recovery may be: attempt, generation, ranks and detection time."""

    attempt: int | None
    after_generation: int
    ranks: frozenset[int]
    earliest: float | None
    latest: float | None

    def admits(self, recovery: dict, causes: tuple[str, ...]) -> bool:
        failures = [f for f in recovery.get("failures") or [] if f.get("cause") in causes]
        if recovery.get("cause") not in causes and not failures:
            return False
        if recovery.get("generation", 0) <= self.after_generation:
            return False
        if self.attempt is not None and recovery.get("attempt", self.attempt) != self.attempt:
            return False
        # A recovery absorbs the failures that come while it is open (summary.json `failures`,
        # each with its own detection time; the recovery's `detected_at` is its first one's): a
        # fault is this recovery's when one of them names its rank and was detected in its window.
        if not failures:
            return self._in_time(recovery.get("detected_at"))
        return any(self._in_time(f.get("detected_at")) and (not self.ranks or not f.get("ranks")
                                                             or bool(self.ranks & set(f["ranks"])))
                   for f in failures)

    def _in_time(self, detected: float | None) -> bool:
        if detected is None:
            return True
        return (self.earliest is None or detected >= self.earliest) and (self.latest is None or detected < self.latest)


def match_recoveries(ev: Evidence) -> list[dict]:
    """Pair each injected fault with the recovery it caused. Faults that require a recovery
    are matched first, in order, each to the earliest recovery in its window; optional ones (a
    short hang, an outage) then take what is left, so they never steal a required one's.

    With a gated schedule every fault needs its own recovery, unless it overlapped the previous
    fault (hit the run before it was training again, or in the same generation): then both share
    one. In a storm, the runtime folds a failure during a recovery into that recovery and records
    no recovery that was interrupted before it made progress, so there a fault only needs some
    recovery after it."""
    gated = next((e["schedule"].get("wait_for_recovery", True) for e in ev.events("schedule")), True)
    recoveries = ev.recoveries()
    spans = [(a.get("started_at") or 0, a.get("ended_at") or float("inf")) for a in ev.attempts]
    invokes = ev.events("invoke")
    windows = [_window(invokes, n, spans, gated) for n in range(len(invokes))]
    entries: list[dict[str, Any]] = [{"invoke": i, "outcome": "not required", "recovery": None, "why": ""}
                                     for i in invokes]
    used: list[dict] = []
    previous: tuple[int, dict] | None = None     # (generation, recovery) of the last required fault matched
    for n, (invoke, entry, window) in enumerate(zip(invokes, entries, windows, strict=True)):
        fault = fault_from_dict(invoke["fault"])
        expect = fault.expectation(ev.heartbeat_timeout_s)
        if expect.fails_run:
            entry.update(_match_user_error(ev, invoke, fault))
            continue
        if not expect.required:
            continue
        generation = _generation(invoke)
        candidates = [r for r in recoveries if window.admits(r, expect.causes)]
        fresh = [r for r in candidates if not any(r is u for u in used)]
        overlapped = previous is not None and previous[1].get("cause") in expect.causes and (
            (invoke.get("run") or {}).get("state") in ("recovering", "starting", "scheduling")
            or previous[0] == generation)
        if overlapped and previous is not None:
            entry.update(outcome="shared", recovery=previous[1])
        elif fresh:
            entry.update(outcome="recovered", recovery=fresh[0])
            used.append(fresh[0])
        elif candidates and not gated:
            entry.update(outcome="shared", recovery=candidates[0])
        else:
            attempt = _attempt_at(spans, acted_at(invoke))
            ended = attempt is not None and _ended_by_policy(ev.attempts[attempt]) and not any(
                _attempt_at(spans, later["t"]) == attempt for later in invokes[n + 1:])
            if ended:
                entry.update(outcome="ended attempt", why="the failure policy ended the attempt at this fault")
            else:
                entry.update(outcome="missing", why=_why_missing(expect.causes, window))
        if entry["recovery"] is not None:
            previous = (generation, entry["recovery"])
    for invoke, entry, window in zip(invokes, entries, windows, strict=True):
        expect = fault_from_dict(invoke["fault"]).expectation(ev.heartbeat_timeout_s)
        if expect.required or expect.fails_run:
            continue
        spare = [r for r in recoveries if window.admits(r, expect.causes) and not any(r is u for u in used)]
        if spare:
            entry.update(outcome="recovered (optional)", recovery=spare[0])
            used.append(spare[0])
    return entries


def _window(invokes: list[dict], n: int, spans: list[tuple[float, float]], gated: bool) -> _Window:
    invoke = invokes[n]
    t = acted_at(invoke)
    attempt = _attempt_at(spans, t) if t is not None else None
    latest = None
    if gated and t is not None:
        # The next fault waited until the run trained again in a new generation: by then this
        # fault's recovery had been detected. (Faults armed at a job's start are not scheduled.)
        later = [acted_at(i) for i in invokes[n + 1:] if acted_at(i) > t and not (i.get("detail") or {}).get("armed")
                 and _attempt_at(spans, acted_at(i)) == attempt]
        latest = min(later) + EARLY_S if later else None
    ranks = frozenset((invoke.get("detail") or {}).get("ranks") or ())
    return _Window(attempt=attempt, after_generation=_generation(invoke), ranks=ranks,
                   earliest=None if t is None else t - EARLY_S, latest=latest)


def acted_at(invoke: dict) -> float:
    """When the fault hit the run. An injector that waits for the fault's outcome before it
    returns (late_commit, second_run) records in its detail the moment it acted on the run; the
    invoke is recorded after, and a recovery detected in between is still this fault's."""
    return (invoke.get("detail") or {}).get("acted_at") or invoke["t"]


def _why_missing(causes: tuple[str, ...], window: _Window) -> str:
    where = [f"after generation {window.after_generation}"]
    if window.ranks:
        where.append(f"naming rank(s) {sorted(window.ranks)}")
    if window.attempt is not None:
        where.append(f"in attempt {window.attempt}")
    if window.latest is not None:
        where.append("detected before the next fault")
    return f"no recovery with cause in {list(causes)} " + ", ".join(where)


def _generation(invoke: dict) -> int:
    generation = (invoke.get("run") or {}).get("generation")
    return -1 if generation is None else generation


def _match_user_error(ev: Evidence, invoke: dict, fault) -> dict:
    for a in ev.attempts:
        if a.get("fail_at") and list(a["fail_at"]) == [fault.rank, fault.step]:
            s = a.get("summary") or {}
            error = s.get("error") or {}
            if s.get("status") == "failed" and error.get("type") and fault.rank in (error.get("ranks") or []):
                return {"outcome": "failed as expected", "why": f"{error['type']} on ranks {error.get('ranks')}"}
            return {"outcome": "missing", "why": f"the armed attempt ended {s.get('status')!r} with error {error!r}"}
    return {"outcome": "missing", "why": "no attempt was armed with this user error"}


def _attempt_at(spans: list[tuple[float, float]], t: float) -> int | None:
    for i, (start, end) in enumerate(spans):
        if start <= t <= end:
            return i
    return None


def _ended_by_policy(attempt: dict) -> bool:
    s = attempt.get("summary") or {}
    return s.get("status") == "failed" and (s.get("error") or {}).get("type") in INFRA_FAILURE_TYPES

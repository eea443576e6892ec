"""Which recovery each injected fault caused: the pairing `faults_recovered`,
`committed_steps_kept` and `no_bad_checkpoint_loaded` rest on.

Recoveries in summary.json carry no wall-clock time, only the generation that ended them, and
generations only grow (across restarts too): a fault that hit generation g is recovered by a
recovery of a later generation, of a cause the fault can produce.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from chaos.faults import fault_from_dict

if TYPE_CHECKING:
    from chaos.invariants import Evidence

INFRA_FAILURE_TYPES = ("TooManyFailuresError", "InsufficientWorkersError")


def match_recoveries(ev: "Evidence") -> list[dict]:
    """Pair each injected fault with the recovery it caused: a recovery of a cause the fault
    can produce, in a later generation than the one it hit (generations only grow, across
    restarts too). Faults that require a recovery are matched first, in order; optional ones
    (a short hang, an outage) then take what is left, so they never steal a required one's.

    With a gated schedule (each fault waits for the previous one's recovery) every fault needs
    its own recovery, unless it overlapped the previous fault (hit the run before it was
    training again, or in the same generation): then both share one. In a storm, the runtime
    folds a failure during a recovery into that recovery and records no recovery that was
    interrupted before it made progress, so there a fault only needs some recovery after it."""
    gated = next((e["schedule"].get("wait_for_recovery", True) for e in ev.events("schedule")), True)
    recoveries = ev.recoveries()
    attempt_ends = [(a.get("started_at") or 0, a.get("ended_at") or float("inf")) for a in ev.attempts]
    invokes = ev.events("invoke")
    entries = [{"invoke": i, "outcome": "not required", "recovery": None, "why": ""} for i in invokes]
    used: list[dict] = []
    previous = None               # (generation, recovery) of the last required fault matched
    for n, (invoke, entry) in enumerate(zip(invokes, entries)):
        fault = fault_from_dict(invoke["fault"])
        expect = fault.expectation(ev.heartbeat_timeout_s)
        if expect.fails_run:
            entry.update(_match_user_error(ev, invoke, fault))
            continue
        if not expect.required:
            continue
        generation = _generation(invoke)
        candidates = [r for r in recoveries if r.get("cause") in expect.causes and r.get("generation", 0) > generation]
        fresh = [r for r in candidates if not any(r is u for u in used)]
        overlapped = previous is not None and any(previous[1] is r for r in candidates) and (
            (invoke.get("run") or {}).get("state") in ("recovering", "starting", "scheduling")
            or previous[0] == generation)
        if overlapped:
            entry.update(outcome="shared", recovery=previous[1])
        elif fresh:
            entry.update(outcome="recovered", recovery=fresh[0])
            used.append(fresh[0])
        elif candidates and not gated:
            entry.update(outcome="shared", recovery=candidates[0])
        else:
            attempt = _attempt_at(attempt_ends, invoke["t"])
            ended = attempt is not None and _ended_by_policy(ev.attempts[attempt]) and not any(
                _attempt_at(attempt_ends, later["t"]) == attempt for later in invokes[n + 1:])
            if ended:
                entry.update(outcome="ended attempt", why="the failure policy ended the attempt at this fault")
            else:
                entry.update(outcome="missing", why=f"no recovery with cause in {list(expect.causes)} "
                                                    f"after generation {generation}")
        if entry["recovery"] is not None:
            previous = (generation, entry["recovery"])
    for invoke, entry in zip(invokes, entries):
        fault = fault_from_dict(invoke["fault"])
        expect = fault.expectation(ev.heartbeat_timeout_s)
        if expect.required or expect.fails_run:
            continue
        spare = [r for r in recoveries if r.get("cause") in expect.causes
                 and r.get("generation", 0) > _generation(invoke) and not any(r is u for u in used)]
        if spare:
            entry.update(outcome="recovered (optional)", recovery=spare[0])
            used.append(spare[0])
    return entries


def _generation(invoke: dict) -> int:
    generation = (invoke.get("run") or {}).get("generation")
    return -1 if generation is None else generation


def _match_user_error(ev: "Evidence", invoke: dict, fault) -> dict:
    for a in ev.attempts:
        if a.get("fail_at") and list(a["fail_at"]) == [fault.rank, fault.step]:
            s = a.get("summary") or {}
            error = s.get("error") or {}
            if s.get("status") == "failed" and error.get("type") and fault.rank in (error.get("ranks") or []):
                return {"outcome": "failed as expected", "why": f"{error['type']} on ranks {error.get('ranks')}"}
            return {"outcome": "missing", "why": f"the armed attempt ended {s.get('status')!r} with error {error!r}"}
    return {"outcome": "missing", "why": "no attempt was armed with this user error"}


def _attempt_at(ends: list[tuple[float, float]], t: float) -> int | None:
    for i, (start, end) in enumerate(ends):
        if start <= t <= end:
            return i
    return None


def _ended_by_policy(attempt: dict) -> bool:
    s = attempt.get("summary") or {}
    return s.get("status") == "failed" and (s.get("error") or {}).get("type") in INFRA_FAILURE_TYPES

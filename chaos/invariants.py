"""Invariants, checked after the fact on the recorded history and the run's own records.

Inputs are plain data (JSON-able), so a test can hand in a tampered history or summary and
see the violation reported. `check_all` returns one Verdict per invariant:

  terminates_typed          every attempt ends "finished" (exit 0, all steps) or "failed" with a
                            typed error in summary.json (non-zero exit); none hangs or vanishes
  committed_steps_kept      the newest committed step never goes back; no recovery restores an
                            older step than the newest intact commit made before its fault; a
                            restart resumes from the newest intact commit; the last step is committed
  no_bad_checkpoint_loaded  every checkpoint load (rung "checkpoint", resumes) is of a step seen
                            committed; a checkpoint rotted by a fault and then forced to load is
                            skipped (a fallback) and never restored; what remains on storage and
                            was not rotted on purpose verifies
  model_matches_reference   same model_sha256 as the fault-free reference, whenever the per-step
                            world sizes are the same (the runtime's determinism guarantee)
  data_order_matches_reference  same data_order_sha256 and samples_consumed as the reference
                            (exactly-once data, world-size independent), when summaries have them
  metrics_complete          metrics.jsonl has exactly one line per kept step (the contract)
  faults_recovered          every injected fault that requires one has its recovery (a cause it
                            can produce, in a later generation), or for a user error the typed failure
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from chaos.matching import match_recoveries

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Verdict:
    name: str
    status: str
    detail: str
    data: dict = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Evidence:
    """Everything the invariants look at. Attempts are dicts: `summary`, `exit_code`,
    `timed_out`, `fail_at` ([rank, step] or None), `started_at`, `ended_at`."""

    history: list[dict]
    attempts: list[dict]
    total_steps: int
    heartbeat_timeout_s: float
    metrics: list[dict] = field(default_factory=list)
    reference: dict | None = None            # {"summary": ..., "metrics": [...]}
    final_verification: list[dict] = field(default_factory=list)   # [{"step", "generation", "problems"}]
    _recoveries: list[dict] | None = field(default=None, repr=False)

    def events(self, *types: str) -> list[dict]:
        return [e for e in self.history if e["type"] in types]

    def recoveries(self) -> list[dict]:
        """Failure recoveries of every attempt (growth is not one), by generation; computed
        once, so that identity marks which ones a fault was matched to."""
        if self._recoveries is None:
            self._recoveries = self._collect_recoveries()
        return self._recoveries

    def _collect_recoveries(self) -> list[dict]:
        out = []
        for i, attempt in enumerate(self.attempts):
            for r in (attempt.get("summary") or {}).get("recoveries") or []:
                if r.get("cause") != "scale_up":
                    out.append({**r, "attempt": i})
        return sorted(out, key=lambda r: (r.get("generation", 0), r["attempt"]))

    def rotted(self) -> set[tuple[int, int]]:
        """(step, generation) of every checkpoint a fault corrupted."""
        return {(c["step"], c["generation"]) for e in self.events("invoke")
                for c in (e.get("detail") or {}).get("corrupted") or []}

    def newest_intact_before(self, t: float) -> int | None:
        """Newest committed step not rotted by a fault, as last seen before time `t`."""
        seen = [e for e in self.events("commits") if e["t"] <= t]
        if not seen:
            return None
        last, bad = seen[-1], self.rotted()
        good = [s for s, g in zip(last["steps"], last.get("generations") or [None] * len(last["steps"]))
                if (s, g) not in bad]
        return max(good) if good else None


def check_all(ev: Evidence) -> list[Verdict]:
    matches = match_recoveries(ev)
    return [terminates_typed(ev), committed_steps_kept(ev, matches), no_bad_checkpoint_loaded(ev, matches),
            model_matches_reference(ev), data_order_matches_reference(ev), metrics_complete(ev),
            faults_recovered(ev, matches)]


# ---- the invariants --------------------------------------------------------------------------
def terminates_typed(ev: Evidence) -> Verdict:
    problems = []
    for i, a in enumerate(ev.attempts):
        s = a.get("summary")
        if a.get("timed_out"):
            problems.append(f"attempt {i} did not end in time and was stopped")
        elif s is None:
            problems.append(f"attempt {i} exited with {a.get('exit_code')} and wrote no summary.json")
        elif s.get("status") == "finished":
            total = a.get("steps") or ev.total_steps     # an attempt may have been run longer
            if a.get("exit_code") != 0 or s.get("final_step") != total:
                problems.append(f"attempt {i} says finished at step {s.get('final_step')} of {total} "
                                f"with exit code {a.get('exit_code')}")
        elif s.get("status") == "failed":
            error = s.get("error") or {}
            if not error.get("type") or a.get("exit_code") == 0:
                problems.append(f"attempt {i} failed without a typed error (error={error!r}, "
                                f"exit code {a.get('exit_code')})")
        else:
            problems.append(f"attempt {i} ended with status {s.get('status')!r}")
    if not ev.attempts:
        problems.append("the job never ran")
    ends = [((a.get("summary") or {}).get("status"), ((a.get("summary") or {}).get("error") or {}).get("type"))
            for a in ev.attempts]
    return Verdict("terminates_typed", FAIL if problems else PASS,
                   "; ".join(problems) or f"attempts ended: {ends}", {"ends": ends})


def committed_steps_kept(ev: Evidence, matches: list[dict]) -> Verdict:
    problems = []
    newest = None
    for e in ev.events("commits"):
        if e.get("newest") is not None and newest is not None and e["newest"] < newest:
            problems.append(f"newest committed step went back from {newest} to {e['newest']}")
        newest = e["newest"] if e.get("newest") is not None else newest
    for m in matches:
        r, invoke = m.get("recovery"), m["invoke"]
        if r is None:
            continue
        floor = ev.newest_intact_before(invoke["t"])
        if floor is not None and r.get("step", 0) < floor:
            problems.append(f"fault {invoke['index']} ({invoke['fault']['kind']}): recovery restored step "
                            f"{r.get('step')} although step {floor} was committed before the fault")
    for i, a in enumerate(ev.attempts[1:], start=1):
        resumed = (a.get("summary") or {}).get("resumed_from")
        floor = ev.newest_intact_before(ev.attempts[i - 1].get("ended_at") or 0)
        if floor is not None and (resumed is None or resumed < floor):
            problems.append(f"attempt {i} resumed from {resumed} although step {floor} was committed")
    last = ev.attempts[-1].get("summary") if ev.attempts else None
    if last and last.get("status") == "finished" and last.get("final_step") not in (last.get("checkpoints") or []):
        problems.append(f"final step {last.get('final_step')} is not among the committed checkpoints "
                        f"{last.get('checkpoints')}")
    return Verdict("committed_steps_kept", FAIL if problems else PASS,
                   "; ".join(problems) or f"{len(matches)} recoveries checked against the commits before their faults")


def no_bad_checkpoint_loaded(ev: Evidence, matches: list[dict]) -> Verdict:
    problems = []
    ever_committed = {s for e in ev.events("commits") for s in e["steps"]}
    for a in ev.attempts:
        ever_committed.update((a.get("summary") or {}).get("checkpoints") or [])
    loads = [("recovery", r.get("step")) for r in ev.recoveries() if r.get("rung") == "checkpoint"]
    loads += [("resume", (a.get("summary") or {}).get("resumed_from")) for a in ev.attempts]
    for what, step in loads:
        if step and step not in ever_committed:
            problems.append(f"{what} loaded step {step}, which was never seen committed")
    fallbacks = {f.get("step") for a in ev.attempts for f in (a.get("summary") or {}).get("checkpoint_fallbacks") or []}
    for m in matches:
        invoke = m["invoke"]
        detail = invoke.get("detail") or {}
        if invoke["fault"]["kind"] != "corrupt_checkpoint" or not detail.get("killed_all"):
            continue
        bad_step = detail.get("step")
        r = m.get("recovery")
        if r is not None and r.get("step", 0) >= bad_step:
            problems.append(f"fault {invoke['index']}: rotted step {bad_step} was restored (recovery step {r.get('step')})")
        if bad_step not in fallbacks:
            problems.append(f"fault {invoke['index']}: no checkpoint_fallbacks entry for rotted step {bad_step}")
    rotted = ev.rotted()
    for v in ev.final_verification:
        if v.get("problems") and (v["step"], v.get("generation")) not in rotted:
            problems.append(f"committed step {v['step']} on storage does not verify: {v['problems'][:2]}")
    return Verdict("no_bad_checkpoint_loaded", FAIL if problems else PASS,
                   "; ".join(problems) or f"{len(loads)} loads of committed steps; "
                                          f"fallbacks {sorted(s for s in fallbacks if s is not None)}")


def model_matches_reference(ev: Evidence) -> Verdict:
    last = ev.attempts[-1].get("summary") if ev.attempts else None
    ref = (ev.reference or {}).get("summary")
    if ref is None:
        return Verdict("model_matches_reference", SKIP, "no fault-free reference run")
    if not last or last.get("status") != "finished" or ref.get("status") != "finished":
        return Verdict("model_matches_reference", SKIP, "the run or its reference did not finish")
    mine = world_size_per_step([a.get("summary") for a in ev.attempts])
    theirs = world_size_per_step([ref])
    if mine != theirs:
        differ = sorted(s for s in set(mine) | set(theirs) if mine.get(s) != theirs.get(s))
        return Verdict("model_matches_reference", SKIP,
                       f"world-size history differs from the reference at {len(differ)} steps "
                       f"(first {differ[:3]}): no determinism guarantee to check")
    if last.get("model_sha256") != ref.get("model_sha256"):
        return Verdict("model_matches_reference", FAIL, f"model_sha256 {str(last.get('model_sha256'))[:16]}.. != "
                                                        f"reference {str(ref.get('model_sha256'))[:16]}..")
    return Verdict("model_matches_reference", PASS, "model_sha256 equal to the reference's")


def data_order_matches_reference(ev: Evidence) -> Verdict:
    """Exactly-once data: the chained sample ids (data_order_sha256, world-size independent)
    and the count of samples consumed equal the fault-free run's, when the summaries have them."""
    last = ev.attempts[-1].get("summary") if ev.attempts else None
    ref = (ev.reference or {}).get("summary")
    keys = [k for k in ("data_order_sha256", "samples_consumed") if k in (last or {}) and k in (ref or {})]
    if not keys or last.get("status") != "finished" or ref.get("status") != "finished":
        return Verdict("data_order_matches_reference", SKIP,
                       "no finished run and reference with data_order_sha256 to compare")
    problems = [f"{k} {str(last[k])[:16]} != reference {str(ref[k])[:16]}" for k in keys if last[k] != ref[k]]
    return Verdict("data_order_matches_reference", FAIL if problems else PASS,
                   "; ".join(problems) or f"{' and '.join(keys)} equal to the reference's")


def world_size_per_step(summaries: list[dict | None]) -> dict[int, int]:
    """Step -> world size of its kept attempt, from `world_size_history` ([start step, world
    size] at each generation start). A later generation that starts at an older step (a
    rollback) redoes, and so owns, the steps after its start."""
    sizes: dict[int, int] = {}
    for s in summaries:
        if not s:
            continue
        history = [list(h) for h in s.get("world_size_history") or []]
        ends = [h[0] for h in history[1:]] + [s.get("final_step") or 0]
        for (start, world), end in zip(history, ends):
            for step in range(start + 1, end + 1):
                sizes[step] = world
    return sizes


def metrics_complete(ev: Evidence) -> Verdict:
    """metrics.jsonl has one line per kept step, 1..final_step, no more, no fewer."""
    last = ev.attempts[-1].get("summary") if ev.attempts else None
    if not last or last.get("status") != "finished":
        return Verdict("metrics_complete", SKIP, "the run did not finish")
    steps = [m["step"] for m in ev.metrics]
    want = set(range(1, (last.get("final_step") or 0) + 1))
    missing, extra = sorted(want - set(steps)), sorted(set(steps) - want)
    repeated = sorted({s for s in steps if steps.count(s) > 1}) if len(steps) != len(set(steps)) else []
    problems = [f"{name} steps {vals[:10]}" for name, vals in
                (("missing", missing), ("unexpected", extra), ("repeated", repeated)) if vals]
    return Verdict("metrics_complete", FAIL if problems else PASS,
                   "metrics.jsonl: " + ("; ".join(problems) if problems else f"one line for each of {len(want)} steps"))


def faults_recovered(ev: Evidence, matches: list[dict]) -> Verdict:
    missing, shared = [], 0
    for m in matches:
        if m["outcome"] == "missing":
            missing.append(f"fault {m['invoke']['index']} ({m['invoke']['fault']['kind']}): {m['why']}")
        shared += m["outcome"] == "shared"
    used = {id(m["recovery"]) for m in matches if m.get("recovery") is not None}
    unexplained = [r for r in ev.recoveries() if id(r) not in used]
    data = {"matches": [{"index": m["invoke"]["index"], "kind": m["invoke"]["fault"]["kind"],
                         "outcome": m["outcome"], "recovery": m.get("recovery"), "why": m.get("why")} for m in matches],
            "unexplained_recoveries": unexplained}
    matched = sum(m["outcome"] in ("recovered", "recovered (optional)") for m in matches)
    detail = "; ".join(missing) or (f"{matched} recoveries matched to faults ({shared} more faults shared "
                                    f"one with an overlapping fault), "
                                    f"{len(unexplained)} recoveries not caused by a fault")
    return Verdict("faults_recovered", FAIL if missing else PASS, detail, data)

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
                            layouts are the same: world size, TP and PP degrees (so the
                            data-parallel size too) at every step (the runtime's determinism
                            guarantee)
  data_order_matches_reference  same data_order_sha256 and samples_consumed as the reference
                            (exactly-once data, world-size independent), when summaries have them
  metrics_complete          metrics.jsonl has exactly one line per kept step (the contract)
  faults_recovered          every injected fault that requires one has its recovery (a cause it
                            can produce, in a later generation), or for a user error the typed failure
  no_committed_checkpoint_lost  every checkpoint (step, generation) the history saw committed is
                            still committed at the end, or was superseded by a newer generation's
                            commit of that step, or removed by retention (at least `keep` newer
                            committed steps listed when it went), or rotted by a fault, or left
                            outside the run's timeline by the FENCE history (a later generation
                            restarted from an earlier step: see committed_steps_kept for whether
                            that restart was right); it is never replaced by an older
                            generation's manifest
  no_checkpoint_from_wrong_generation  every checkpoint load (rung "checkpoint", resumes) read a
                            manifest of the generation that owns that step in the FENCE history:
                            no generation between the writer and the loader restarted from an
                            earlier step (the writer's commit was not a fenced writer's late
                            commit), and the writer had not started past the step
  no_false_hang             no rank was judged hung while object storage stalled or refused
                            writes (a storage_stall or storage_outage, plus a heartbeat timeout)
  intruders_refused         a late_commit zombie's commit was refused (FencedError), or, when its
                            PUT landed, the fence history rejects it; it never replaced a newer
                            generation's manifest nor deleted anything; a second_run exited
                            non-zero within its time with the RunConflictError message naming the
                            live run, and the first run kept its lease, its generations, its
                            status.json and summary.json, and trained on

A load's generation is the runtime's own account where a summary gives one (a recovery's or
the summary's `loaded_generation`), else the manifest of that step on storage (accepted or
not) as the history saw it when the loading generation was fenced.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from chaos.matching import acted_at, match_recoveries

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
    fence: dict | None = None               # FENCE at the end: {"generation", "run_id", "history"}
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

    def fence_history(self) -> list[tuple[int, int | None]]:
        """(generation, start step) of every generation FENCE recorded, oldest first."""
        return [(h[0], h[1]) for h in (self.fence or {}).get("history") or []]

    def abandoned(self, step: int, generation: int | None) -> bool:
        """Whether a later generation restarted from a step before `step`: a commit of `step`
        by `generation` is then outside the run's timeline (FENCE's history rejects it)."""
        return generation is not None and any(
            g > generation and start is not None and step > start for g, start in self.fence_history())

    def retention(self) -> tuple[bool, int | None]:
        """(known, keep): the run's CheckpointConfig.keep from its summary's config (None keeps all)."""
        for a in reversed(self.attempts):
            checkpoint = ((a.get("summary") or {}).get("config") or {}).get("checkpoint") or {}
            if "keep" in checkpoint:
                return True, checkpoint["keep"]
        return False, None

    def snapshots(self, *, rejected: bool = False) -> list[tuple[float, dict[int, int | None]]]:
        """(time, {step: generation}) of each commits event; with `rejected`, the manifests the
        fence history rejected are included (what a reader would find at each step)."""
        out = []
        for e in self.events("commits"):
            snap = dict(zip(e["steps"], e.get("generations") or [None] * len(e["steps"]), strict=True))
            if rejected:
                snap.update({s: g for s, g in e.get("rejected") or [] if s not in snap})
            out.append((e["t"], snap))
        return out

    def newest_intact_before(self, t: float) -> int | None:
        """Newest committed step not rotted by a fault, as last seen before time `t`."""
        seen = [e for e in self.events("commits") if e["t"] <= t]
        if not seen:
            return None
        last, bad = seen[-1], self.rotted()
        good = [s for s, g in zip(last["steps"], last.get("generations") or [None] * len(last["steps"]), strict=True)
                if (s, g) not in bad]
        return max(good) if good else None


def check_all(ev: Evidence) -> list[Verdict]:
    matches = match_recoveries(ev)
    return [terminates_typed(ev), committed_steps_kept(ev, matches), no_bad_checkpoint_loaded(ev, matches),
            model_matches_reference(ev), data_order_matches_reference(ev), metrics_complete(ev),
            faults_recovered(ev, matches), no_committed_checkpoint_lost(ev),
            no_checkpoint_from_wrong_generation(ev), intruders_refused(ev), no_false_hang(ev),
            workers_outlive_controller(ev), runs_outlive_drivers(ev)]


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
    newest, rotted = None, ev.rotted()
    for _, snap in ev.snapshots():
        top = max(snap) if snap else None
        if top is not None and newest is not None and top < newest[0] and newest not in rotted \
                and not ev.abandoned(*newest):
            problems.append(f"newest committed step went back from {newest[0]} to {top}")
        newest = (top, snap[top]) if top is not None else newest
    for m in matches:
        r, invoke = m.get("recovery"), m["invoke"]
        if r is None:
            continue
        floor = ev.newest_intact_before(acted_at(invoke))
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
        if r is not None and r.get("rung") not in (None, "checkpoint"):
            continue    # restored from memory (the nodes' keepers outlive the workers): no checkpoint was read
        if r is not None and r.get("step", 0) >= bad_step:
            problems.append(f"fault {invoke['index']}: rotted step {bad_step} was restored "
                            f"(recovery step {r.get('step')})")
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
    mine = layout_per_step([a.get("summary") for a in ev.attempts])
    theirs = layout_per_step([ref])
    if mine != theirs:
        differ = sorted(s for s in set(mine) | set(theirs) if mine.get(s) != theirs.get(s))
        return Verdict("model_matches_reference", SKIP,
                       f"layout history (world size, TP degree, PP degree) differs from the reference at "
                       f"{len(differ)} steps "
                       f"(first {[(s, mine.get(s), theirs.get(s)) for s in differ[:3]]}): no determinism "
                       f"guarantee to check")
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
    if not keys or last is None or ref is None or last.get("status") != "finished" or ref.get("status") != "finished":
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
        for (start, world), end in zip(history, ends, strict=False):   # no history: nothing
            for step in range(start + 1, end + 1):
                sizes[step] = world
    return sizes


def layout_per_step(summaries: list[dict | None]) -> dict[int, tuple[int, int, int]]:
    """Step -> (world size, TP degree, PP degree) of its kept attempt: the world sizes as
    `world_size_per_step` gives them, the degrees from `layout_history` ([start step, {"dp",
    "tp", "pp"}] at each generation start; 1 for a summary without one: no tensor or pipeline
    parallelism). Equal world sizes are not an equal run when T or P differs (DP 4, DP 2 x TP 2
    and DP 2 x PP 2 shard the data and the model differently, and a pipeline's micro-batches
    order its reductions): the determinism guarantee is per layout."""
    worlds = world_size_per_step(summaries)
    degrees: dict[int, tuple[int, int]] = {}
    for s in summaries:
        if not s:
            continue
        history = [list(h) for h in s.get("layout_history") or []]
        ends = [h[0] for h in history[1:]] + [s.get("final_step") or 0]
        for (start, layout), end in zip(history, ends, strict=False):
            tp, pp = (int((layout or {}).get(key) or 1) for key in ("tp", "pp"))
            for step in range(start + 1, end + 1):
                degrees[step] = (tp, pp)
    return {step: (world, *degrees.get(step, (1, 1))) for step, world in worlds.items()}


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


def no_committed_checkpoint_lost(ev: Evidence) -> Verdict:
    snapshots = ev.snapshots()
    if ev.final_verification:
        snapshots.append((float("inf"), {v["step"]: v.get("generation") for v in ev.final_verification}))
    if not snapshots:
        return Verdict("no_committed_checkpoint_lost", SKIP, "no commits recorded")
    known, keep = ev.retention()
    rotted = ev.rotted()
    last_seen: dict[tuple[int, int | None], int] = {}
    for i, (_, snap) in enumerate(snapshots):
        for step, generation in snap.items():
            last_seen[(step, generation)] = i
    problems, reasons = [], {"present": 0, "superseded": 0, "retention": 0, "rotted": 0, "abandoned": 0}
    for (_, before), (_, after) in zip(snapshots, snapshots[1:], strict=False):
        for step, generation in before.items():
            now = after.get(step)
            if generation is not None and now is not None and now < generation:
                problems.append(f"step {step}: generation {generation}'s committed manifest was replaced by an "
                                f"older generation's ({now})")
    for (step, generation), i in sorted(last_seen.items(), key=lambda kv: kv[0][0]):
        if i == len(snapshots) - 1:
            reasons["present"] += 1
            continue
        t, after = snapshots[i + 1]
        later = [g for _, snap in snapshots[i + 1:] if (g := snap.get(step)) is not None]
        now = after.get(step)
        if generation is not None and now is not None and now < generation:
            continue                   # reported above
        if generation is not None and any(g > generation for g in later):
            reasons["superseded"] += 1
        elif (step, generation) in rotted:
            reasons["rotted"] += 1
        elif ev.abandoned(step, generation):
            reasons["abandoned"] += 1
        else:
            newer = sum(s > step for s in after)
            if (known and keep is not None and newer >= keep) or (not known and newer >= 1):
                reasons["retention"] += 1
            else:
                when = "by the end" if t == float("inf") else f"at t={t}"
                problems.append(f"step {step} (generation {generation}) was committed and is gone {when} with "
                                f"{newer} newer committed step(s) listed (keep={keep if known else 'unknown'}), not "
                                f"superseded by a newer generation, not rotted, not abandoned")
    detail = "; ".join(problems[:5]) or (f"{len(last_seen)} commits accounted for: "
                                         + ", ".join(f"{n} {k}" for k, n in reasons.items() if n))
    return Verdict("no_committed_checkpoint_lost", FAIL if problems else PASS, detail, {"accounted": reasons})


def _fenced_at(ev: Evidence, generation: int) -> float | None:
    """When FENCE was first seen at `generation` or later."""
    return next((e["t"] for e in ev.events("fence") if (e.get("generation") or -1) >= generation), None)


def _attempt_generation(ev: Evidence, attempt: dict) -> int | None:
    """The first generation of an attempt: the first FENCE generation seen past those of the
    attempts before it. Those are FENCE as sampled before it started, and the generations the
    earlier attempts recovered into or committed from: the watcher samples FENCE every 0.5 s, so
    the last generation of a short attempt may be seen only after the next one started (a chaos
    unit test's one-second attempt was), and must not be taken for the next attempt's own."""
    start, end = attempt.get("started_at") or 0, attempt.get("ended_at") or float("inf")
    index = next((i for i, a in enumerate(ev.attempts) if a is attempt), len(ev.attempts))
    fences = ev.events("fence")
    known = [e.get("generation") for e in fences if e["t"] < start]
    known += [r.get("generation") for r in ev.recoveries() if r["attempt"] < index]
    known += [g for e in ev.events("commits") if e["t"] < start for g in e.get("generations") or []]
    before = max([g for g in known if g is not None] or [-1])
    return next((e["generation"] for e in fences if start <= e["t"] <= end and (e.get("generation") or -1) > before),
                None)


def _manifest_generation_at(ev: Evidence, step: int, t: float | None) -> int | None:
    """The generation of the manifest a reader would have found at `step` at time `t`: the last
    snapshot at or before it that has the step, else the first after."""
    snaps = [(st, snap[step]) for st, snap in ev.snapshots(rejected=True) if snap.get(step) is not None]
    if not snaps:
        return None
    if t is None:
        return snaps[-1][1]
    before = [g for st, g in snaps if st <= t]
    return before[-1] if before else snaps[0][1]


def no_checkpoint_from_wrong_generation(ev: Evidence) -> Verdict:
    if not ev.fence_history():
        return Verdict("no_checkpoint_from_wrong_generation", SKIP, "no FENCE history to judge loads by")
    history = ev.fence_history()
    starts = dict(history)
    loads = []   # (what, step, loading generation, loaded generation)
    for r in ev.recoveries():
        if r.get("rung") == "checkpoint" and r.get("step"):
            generation = r.get("generation")
            t = _fenced_at(ev, generation) if generation is not None else None
            loaded = r.get("loaded_generation")
            if loaded is None:
                loaded = _manifest_generation_at(ev, r["step"], t if t is not None else r.get("detected_at"))
            loads.append((f"recovery into generation {generation}", r["step"], generation, loaded))
    for i, a in enumerate(ev.attempts):
        s = a.get("summary") or {}
        if s.get("resumed_from"):
            generation = _attempt_generation(ev, a)
            loaded = s.get("loaded_generation")
            if loaded is None:
                t = _fenced_at(ev, generation) if generation is not None else a.get("started_at")
                loaded = _manifest_generation_at(ev, s["resumed_from"], t)
            loads.append((f"attempt {i}'s resume", s["resumed_from"], generation, loaded))
    problems, judged = [], 0
    for what, step, loader, loaded in loads:
        if loader is None or loaded is None:
            continue
        judged += 1
        owner = max((g for g, start in history if g < loader and start is not None and start < step), default=None)
        restarted = [(g, start) for g, start in history
                     if loaded < g < loader and start is not None and start < step]
        if loaded >= loader:
            problems.append(f"{what} loaded step {step} from generation {loaded}, not older than itself")
        elif restarted:
            g, start = restarted[-1]
            problems.append(f"{what} loaded step {step} from generation {loaded}, but generation {g} had restarted "
                            f"from step {start} before it: that manifest is a fenced writer's late commit; the owner "
                            f"of step {step} is generation {owner}")
        elif starts.get(loaded) is not None and starts[loaded] > step:
            problems.append(f"{what} loaded step {step} from generation {loaded}, which started from step "
                            f"{starts[loaded]}, past it: it cannot have committed that step")
    unjudged = len(loads) - judged
    if not loads:
        return Verdict("no_checkpoint_from_wrong_generation", SKIP, "no checkpoint was loaded (warm restores only)")
    detail = "; ".join(problems) or (f"{judged} loads read the owner's manifest"
                                     + (f" ({unjudged} without a known generation)" if unjudged else ""))
    return Verdict("no_checkpoint_from_wrong_generation", FAIL if problems else PASS if judged else SKIP, detail)


def _late_commit_problems(invoke: dict) -> tuple[list[str], str]:
    z = (invoke.get("detail") or {}).get("zombie") or {}
    name = f"fault {invoke['index']} (late_commit, {z.get('phase')})"
    outcome, generation, step = z.get("outcome"), z.get("generation"), z.get("step")
    problems = []
    newer_before = z.get("manifest_before_put") is not None and generation is not None \
        and z["manifest_before_put"] > generation
    if outcome == "landed":
        if newer_before:
            problems.append(f"{name}: generation {generation}'s late COMMITTED of step {step} replaced generation "
                            f"{z['manifest_before_put']}'s")
        elif not z.get("rejected_by_fence"):
            problems.append(f"{name}: generation {generation}'s late COMMITTED of step {step} landed after FENCE "
                            f"moved to {z.get('fence_moved_to')} and the fence history accepts it")
    elif outcome in ("error", "timeout") or outcome is None:
        problems.append(f"{name}: the zombie's commit came to no end: {z.get('error') or outcome}")
    if newer_before and z.get("manifest_after") is not None and z["manifest_after"] <= generation:
        problems.append(f"{name}: step {step}'s manifest went from generation {z['manifest_before_put']} to "
                        f"{z['manifest_after']}")
    own = f"step_{step:08d}/g{generation:06d}" if step is not None and generation is not None else None
    foreign = [p for p in z.get("deleted") or [] if own is None or own not in p]
    if foreign:
        problems.append(f"{name}: the fenced writer deleted {foreign[:3]}")
    return problems, f"late_commit {z.get('phase')}: {outcome}"


def _second_run_problems(invoke: dict) -> tuple[list[str], str]:
    d = invoke.get("detail") or {}
    name = f"fault {invoke['index']} (second_run)"
    if d.get("first_run_finished"):
        return [], "second_run: inconclusive (the first run finished before the second was judged)"
    problems = []
    if d.get("timed_out"):
        problems.append(f"{name}: still running after {d.get('within_s')}s: not refused")
    elif d.get("exit_code") == 0:
        problems.append(f"{name}: exited 0 on a storage in use")
    message, live = d.get("conflict_message"), d.get("live_run")
    if not d.get("timed_out"):
        if not message:
            problems.append(f"{name}: no RunConflictError message in its output (exit {d.get('exit_code')}): "
                            f"{(d.get('output_tail') or '')[-300:]!r}")
        elif live and live not in message:
            problems.append(f"{name}: its refusal does not name the live run {live}: {message[:300]!r}")
    before, after = d.get("fence_before") or {}, d.get("fence_after") or {}
    if before.get("run_id") != after.get("run_id"):
        problems.append(f"{name}: the storage's lease went from run {before.get('run_id')} to {after.get('run_id')}")
    known = {tuple(h[:2]) for h in before.get("history") or []}
    taken = [h for h in after.get("history") or [] if tuple(h[:2]) not in known and len(h) > 2
             and h[2] not in (None, before.get("run_id"))]
    if taken:
        problems.append(f"{name}: another run took generation(s) {[h[0] for h in taken]}")
    if d.get("summary_written"):
        problems.append(f"{name}: summary.json was written while the first run was live")
    s0, s1 = d.get("status_before") or {}, d.get("status_after") or {}
    if s0.get("run_id") and s1.get("run_id") and s0["run_id"] != s1["run_id"]:
        problems.append(f"{name}: status.json went from run {s0['run_id']} to {s1['run_id']}")
    went_on = d.get("first_run_went_on") or {}
    if not went_on.get("ok", False):
        problems.append(f"{name}: the first run did not go on: {went_on.get('why') or went_on}")
    outcome = f"second_run: exit {d.get('exit_code')} after {d.get('elapsed_s')}s"
    return problems, outcome


STORAGE_FAULTS = ("storage_stall", "storage_outage")


def no_false_hang(ev: Evidence) -> Verdict:
    """No rank is judged hung because object storage stalled or refused: storage calls stay off
    the paths that judge the workers. A hang failure detected while a storage fault lasted (or
    within a heartbeat timeout after it) is a false alarm; no fault of these kinds hangs a rank.
    Unless another fault explains it: one that hit those very ranks (a kill_node, a partition, a
    hang) within the heartbeat timeout before the detection and its own duration (G1 found a
    killed node's rank silent 3.8 s after the kill, inside a stall's window)."""
    windows = [(e["t"], e["t"] + float(e["fault"].get("duration_s") or 0.0) + ev.heartbeat_timeout_s,
                e["fault"]["kind"]) for e in ev.events("invoke") if e["fault"]["kind"] in STORAGE_FAULTS]
    if not windows:
        return Verdict("no_false_hang", SKIP, "no storage fault was injected")
    hits = [(e["t"], e["t"] + float(e["fault"].get("duration_s") or 0.0) + ev.heartbeat_timeout_s,
             set((e.get("detail") or {}).get("ranks") or ()))
            for e in ev.events("invoke") if e["fault"]["kind"] not in STORAGE_FAULTS]

    def explained(f: dict) -> bool:
        ranks = set(f.get("ranks") or ())
        return bool(ranks) and any(ranks <= hit and start <= f["detected_at"] <= end for start, end, hit in hits)

    false = [f"rank(s) {f.get('ranks')} judged hung at {f['detected_at']:.1f} during a {kind} "
             f"({start:.1f}-{end:.1f})"
             for r in ev.recoveries() for f in r.get("failures") or []
             if f.get("cause") == "hang" and f.get("detected_at") is not None and not explained(f)
             for start, end, kind in windows if start <= f["detected_at"] <= end]
    return Verdict("no_false_hang", FAIL if false else PASS,
                   "; ".join(false) or f"no hang judged during {len(windows)} storage fault(s)",
                   {"windows": windows, "false_hangs": false})


def workers_outlive_controller(ev: Evidence) -> Verdict:
    """Each controller killed was replaced by one that adopted the running generation's workers:
    a restart record of kind "running" (or "idle") per kill, none of them replaced. (Steps kept
    once, no double commit and the run's end are the other invariants'.)"""
    kills = [e for e in ev.events("invoke") if e["fault"]["kind"] == "kill_controller"
             and (e.get("detail") or {}).get("signalled")]
    if not kills:
        return Verdict("workers_outlive_controller", SKIP, "no controller was killed")
    restarts = sorted((r for a in ev.attempts for r in (a.get("summary") or {}).get("controller_restarts") or []),
                      key=lambda r: r.get("adopted_at", 0.0))
    problems = []
    for kill in kills:
        after = [r for r in restarts if r.get("adopted_at", 0.0) >= kill["t"] - 1.0]
        if not after:
            problems.append(f"fault {kill['index']}: no controller restart recorded after it")
            continue
        restart = after[0]
        restarts.remove(restart)
        if restart.get("kind") not in ("running", "idle") or restart.get("replaced"):
            problems.append(f"fault {kill['index']}: the replacement restarted workers ({restart.get('reason')})")
    seconds = [r.get("without_controller_s") for r in
               (x for a in ev.attempts for x in (a.get("summary") or {}).get("controller_restarts") or [])]
    return Verdict("workers_outlive_controller", FAIL if problems else PASS,
                   "; ".join(problems) or f"{len(kills)} controllers killed, each replaced with its workers adopted "
                                          f"(seconds without a controller: {seconds})")


def runs_outlive_drivers(ev: Evidence) -> Verdict:
    """Each driver killed left its run going: the job started again (a "driver_replaced"
    event) and the attempt ended with the run that was live at the kill (the same run id in
    status.json at the end: the second driver attached, it did not start a run of its own), and
    with a summary. (Steps kept once and the model are the other invariants'.)"""
    kills = [e for e in ev.events("invoke") if e["fault"]["kind"] == "kill_driver"
             and (e.get("detail") or {}).get("signalled")]
    if not kills:
        return Verdict("runs_outlive_drivers", SKIP, "no driver was killed")
    problems = []
    for kill in kills:
        detail = kill["detail"]
        if not any(e.get("killed") == detail["pid"] for e in ev.events("driver_replaced") if e["t"] >= kill["t"]):
            problems.append(f"fault {kill['index']}: the job was not started again after its driver's death")
        end = next((e for e in ev.events("job_exit") if e["t"] >= kill["t"]), None)
        if end is None or end.get("status") is None:
            problems.append(f"fault {kill['index']}: the run wrote no summary after its driver's death")
        elif end.get("run_id") != detail["run_id"]:
            problems.append(f"fault {kill['index']}: the run ended as {end.get('run_id')}, not as the run "
                            f"{detail['run_id']} that lost its driver")
    return Verdict("runs_outlive_drivers", FAIL if problems else PASS,
                   "; ".join(problems) or f"{len(kills)} driver(s) killed; each run went on and was attached to")


def intruders_refused(ev: Evidence) -> Verdict:
    judges = {"late_commit": _late_commit_problems, "second_run": _second_run_problems}
    invokes = [e for e in ev.events("invoke") if e["fault"]["kind"] in judges]
    if not invokes:
        return Verdict("intruders_refused", SKIP, "no late_commit or second_run fault was injected")
    problems, outcomes = [], []
    for invoke in invokes:
        found, outcome = judges[invoke["fault"]["kind"]](invoke)
        problems += found
        outcomes.append(outcome)
    return Verdict("intruders_refused", FAIL if problems else PASS, "; ".join(problems) or "; ".join(outcomes),
                   {"outcomes": outcomes})

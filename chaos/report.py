"""chaos_report.json and chaos_report.png: what was done, what the run did, and the verdicts.

The JSON lists every scheduled fault (injected or skipped, with its heal and the recovery it was
matched to), every recovery, the invariant verdicts, the goodput, the attempts' time ledgers summed
(summary.json `time_ledger`: seconds per part of the wall time) and the mean seconds lost per
fault kind, from the time ledgers of the recoveries the faults were matched to. The PNG shows loss and
world size over time, with each fault marked from injection to heal.
"""
from __future__ import annotations

import json
import os
from typing import Any

from chaos.invariants import Evidence, Verdict
from chaos.matching import match_recoveries


def write_report(out_dir: str, *, scenario, seed: int, spec, schedule, evidence: Evidence, verdicts: list[Verdict],
                 unsupported: dict, proxy_counts: dict | None, cluster: str) -> dict:
    report = build_report(scenario=scenario, seed=seed, spec=spec, schedule=schedule, evidence=evidence,
                          verdicts=verdicts, unsupported=unsupported, proxy_counts=proxy_counts, cluster=cluster)
    with open(os.path.join(out_dir, "chaos_report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    try:
        plot(os.path.join(out_dir, "chaos_report.png"), evidence, report)
    except Exception as e:   # noqa: BLE001 - a plotting problem must not hide the verdicts
        report["plot_error"] = f"{type(e).__name__}: {e}"
    return report


def build_report(*, scenario, seed, spec, schedule, evidence: Evidence, verdicts, unsupported, proxy_counts,
                 cluster) -> dict:
    t0 = _t0(evidence)
    heals = {e["index"]: e for e in evidence.events("heal")}
    matches = {m["invoke"]["index"]: m for m in match_recoveries(evidence)}
    faults = []
    for e in evidence.events("invoke", "skip"):
        entry = {"index": e["index"], "kind": e["fault"]["kind"], "fault": e["fault"], "t": _rel(e["t"], t0)}
        if e["type"] == "skip":
            entry.update(injected=False, skipped=e["reason"])
        else:
            heal = heals.get(e["index"])
            match = matches.get(e["index"], {})
            entry.update(injected=True, run=e.get("run"), detail=e.get("detail"),
                         committed_newest=e.get("committed_newest"),
                         healed_t=_rel(heal["t"], t0) if heal else None, heal=(heal or {}).get("detail"),
                         outcome=match.get("outcome"), recovery=match.get("recovery"))
        faults.append(entry)
    faults.sort(key=lambda f: f["index"])
    injected = [f for f in faults if f["injected"]]
    attempts = [_attempt(a) for a in evidence.attempts]
    last = evidence.attempts[-1].get("summary") if evidence.attempts else None
    ref = (evidence.reference or {}).get("summary")
    chaos_wall = sum(a.get("wall_s") or 0 for a in attempts)
    kept_s = sum((a.get("wall_s") or 0) * (a.get("goodput") or 0) for a in attempts)
    return {
        "scenario": scenario.name, "description": scenario.description, "seed": seed,
        "ok": not any(v.failed for v in verdicts),
        "job": spec.argv(), "cluster": cluster,
        "invariants": [v.to_dict() for v in verdicts],
        "faults_injected": len(injected), "faults_skipped": len(faults) - len(injected),
        "kinds_injected": sorted({f["kind"] for f in injected}),
        "unsupported": unsupported,
        "faults": faults,
        "recoveries": evidence.recoveries(),
        "checkpoint_fallbacks": [f for a in evidence.attempts
                                 for f in (a.get("summary") or {}).get("checkpoint_fallbacks") or []],
        "attempts": attempts,
        "goodput": {
            # Share of the job's wall time (all attempts) spent on steps that were kept.
            "campaign": round(kept_s / chaos_wall, 4) if chaos_wall else None,
            "per_attempt": [a["goodput"] for a in attempts],
            "chaos_wall_s": round(chaos_wall, 1),
            "reference_wall_s": (ref or {}).get("wall_s"),
            # Time the fault-free run needed over the time the chaos run needed: 1.0 is free.
            "vs_reference": round(ref["wall_s"] / chaos_wall, 3) if ref and ref.get("wall_s") and chaos_wall else None,
        },
        "time_ledger": _summed_ledger(evidence.attempts),
        "lost_per_kind": lost_per_kind(injected),
        "model_sha256": {"run": (last or {}).get("model_sha256"), "reference": (ref or {}).get("model_sha256")},
        "reference": {k: (evidence.reference or {}).get(k) for k in ("url", "reused")} if evidence.reference else None,
        "proxy_counts": proxy_counts,
        "schedule": schedule.to_dict(),
    }


def _summed_ledger(attempts: list[dict]) -> dict[str, float] | None:
    """The attempts' time ledgers (summary.json `time_ledger`), part by part; None: none had one."""
    total: dict[str, float] = {}
    for a in attempts:
        for part, seconds in ((a.get("summary") or {}).get("time_ledger") or {}).items():
            total[part] = round(total.get(part, 0.0) + (seconds or 0.0), 3)
    return total or None


def lost_per_kind(faults: list[dict]) -> dict[str, dict[str, Any]]:
    """Per fault kind: faults injected, and the mean seconds each cost, by part and in all, from
    the time ledger of the recovery it was matched to (summary.json `recoveries[].time_ledger`).
    A recovery counts once, for the first fault matched to it; a fault that shared another's
    recovery, or needed none, cost nothing of its own."""
    counted: set[int] = set()
    per_kind: dict[str, list[dict[str, float]]] = {}
    for fault in faults:
        recovery = fault.get("recovery") or {}
        own: dict[str, float] = {}
        if str(fault.get("outcome", "")).startswith("recovered") and id(recovery) not in counted:
            counted.add(id(recovery))
            own = {part: seconds or 0.0 for part, seconds in (recovery.get("time_ledger") or {}).items()}
        per_kind.setdefault(fault["kind"], []).append(own)
    out = {}
    for kind, costs in sorted(per_kind.items()):
        parts = sorted({part for cost in costs for part in cost})
        mean = {part: round(sum(c.get(part, 0.0) for c in costs) / len(costs), 3) for part in parts}
        out[kind] = {"faults": len(costs), "mean_lost_s": round(sum(mean.values()), 3), "mean_parts_s": mean}
    return out


def _attempt(a: dict) -> dict[str, Any]:
    s = a.get("summary") or {}
    return {"exit_code": a.get("exit_code"), "timed_out": a.get("timed_out"), "status": s.get("status"),
            "error": (s.get("error") or {}).get("type"), "error_ranks": (s.get("error") or {}).get("ranks"),
            "final_step": s.get("final_step"), "resumed_from": s.get("resumed_from"),
            "world_size_history": s.get("world_size_history"), "layout_history": s.get("layout_history"),
            "wall_s": s.get("wall_s"),
            "goodput": s.get("goodput"), "fail_at": a.get("fail_at"), "steps": a.get("steps")}


def _t0(ev: Evidence) -> float:
    starts = [e["t"] for e in ev.events("job_start")]
    return min(starts) if starts else (ev.history[0]["t"] if ev.history else 0.0)


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def summarize(report: dict) -> str:
    """A few lines for the terminal."""
    lines = [f"chaos {report['scenario']} seed {report['seed']}: "
             f"{'OK' if report['ok'] else 'INVARIANT VIOLATED'} - {report['faults_injected']} faults injected "
             f"({', '.join(report['kinds_injected']) or 'none'}), {report['faults_skipped']} skipped, "
             f"{len(report['recoveries'])} recoveries"]
    for kind, why in report["unsupported"].items():
        lines.append(f"  unsupported here: {kind}: {why}")
    for v in report["invariants"]:
        lines.append(f"  [{v['status'].upper():4}] {v['name']}: {v['detail']}")
    g = report["goodput"]
    lines.append(f"  goodput {g.get('campaign')} (per attempt {g['per_attempt']}); reference/chaos wall time "
                 f"{g['vs_reference']}")
    if report.get("time_ledger"):
        lines.append("  time ledger " + ", ".join(f"{p} {s:.1f}s" for p, s in report["time_ledger"].items()))
    for kind, lost in (report.get("lost_per_kind") or {}).items():
        parts = ", ".join(f"{p} {s:.2f}" for p, s in lost["mean_parts_s"].items())
        lines.append(f"  {kind}: {lost['faults']} faults, {lost['mean_lost_s']:.2f}s lost per fault ({parts})")
    return "\n".join(lines)


def _with_gaps(rows: list[dict], t0: float) -> tuple[list, list, list]:
    """Times, losses and world sizes, broken (NaN) where no step completed for a while, so a
    recovery shows as a gap rather than a straight line across it."""
    gaps = sorted(b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False))
    threshold = max(2.0, 10 * gaps[len(gaps) // 2]) if gaps else float("inf")
    ts, losses, worlds = [], [], []
    previous: list[dict | None] = [None, *rows[:-1]]
    for prev, m in zip(previous, rows, strict=True):
        if prev is not None and m["time"] - prev["time"] > threshold:
            ts.append(prev["time"] - t0 + 1e-3)
            losses.append(float("nan"))
            worlds.append(float("nan"))
        ts.append(m["time"] - t0)
        losses.append(m["loss"])
        worlds.append(m["world_size"])
    return ts, losses, worlds


def plot(path: str, ev: Evidence, report: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = _t0(ev)
    rows = sorted(ev.metrics, key=lambda m: m["time"])
    fig, (ax_loss, ax_world) = plt.subplots(2, 1, sharex=True, figsize=(12, 6.5),
                                            gridspec_kw={"height_ratios": [2, 1]})
    if rows:
        ts, losses, worlds = _with_gaps(rows, t0)
        ax_loss.plot(ts, losses, lw=0.8, color="tab:blue", label="loss")
        ax_world.step(ts, worlds, where="post", color="tab:green", label="world size")
        ax_world.set_ylim(0, max(m["world_size"] for m in rows) + 1)
    kinds = sorted({f["kind"] for f in report["faults"] if f["injected"]})
    colors = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
    for f in report["faults"]:
        if not f["injected"] or f["t"] is None:
            continue
        end = f["healed_t"] if f.get("healed_t") is not None else f["t"]
        for ax in (ax_loss, ax_world):
            if end - f["t"] > 0.5:
                ax.axvspan(f["t"], end, color=colors[f["kind"]], alpha=0.2)
            ax.axvline(f["t"], color=colors[f["kind"]], lw=1.2)
        ax_loss.annotate(str(f["index"]), (f["t"], 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                         ha="left", va="top", color=colors[f["kind"]])
    for e in ev.events("job_start")[1:]:
        for ax in (ax_loss, ax_world):
            ax.axvline(e["t"] - t0, color="black", ls="--", lw=1)
    handles = [plt.Line2D([], [], color=colors[k], lw=3, label=k) for k in kinds]
    ax_loss.legend(handles=handles + [plt.Line2D([], [], color="black", ls="--", label="job restart")],
                   fontsize=7, loc="upper right", ncol=2)
    ax_loss.set_ylabel("loss")
    ax_world.set_ylabel("world size")
    ax_world.set_xlabel("seconds since the job started")
    ax_world.yaxis.get_major_locator().set_params(integer=True)
    verdict = "OK" if report["ok"] else "INVARIANT VIOLATED"
    ax_loss.set_title(f"chaos {report['scenario']} (seed {report['seed']}): {report['faults_injected']} faults, "
                      f"{len(report['recoveries'])} recoveries - {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

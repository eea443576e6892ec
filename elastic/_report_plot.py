"""The picture behind `elastic report URL --plot`: loss, world size and learning rate over wall
time from `<storage>/metrics.jsonl`, with every recovery of summary.json marked, and below them
summary.json's time ledger as one stacked bar (seconds per part of the wall time).

Internal. matplotlib is imported only here and only when a plot is asked for (it is not a runtime
dependency of training); the Agg canvas is used directly, so no GUI backend or global pyplot
state is touched.
"""
from __future__ import annotations

import io
import json
from typing import Any


def parse_metrics(text: str) -> list[dict]:
    """metrics.jsonl lines, ordered by step; a torn last line (run still writing) is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        # A line with a `kind` ("log": ctx.log values) is no step of its own.
        if isinstance(row, dict) and "step" in row and "time" in row and "kind" not in row:
            rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def _time_of_step(rows: list[dict], step: int, t0: float) -> float:
    """Seconds since the first step at which `step` completed (or the nearest step before it)."""
    before = [r["time"] for r in rows if r["step"] <= step]
    return (before[-1] if before else rows[0]["time"]) - t0


# The ledger's parts in the bar's order (useful work first, then what recoveries and saves cost).
LEDGER_COLORS = {"productive": "#2ca02c", "checkpoint_stall": "#9467bd", "startup": "#7f7f7f",
                 "waiting": "#c7c7c7", "detection": "#d62728", "reform": "#ff7f0e", "restore": "#1f77b4",
                 "redone": "#8c564b"}


def render(rows: list[dict], summary: dict | None, *, title: str = "") -> tuple[bytes, dict[str, Any]]:
    """PNG bytes of the three panels (and the time ledger's bar when summary.json has one), and
    what was drawn (points, recoveries marked, the ledger's seconds per part)."""
    if not rows:
        raise ValueError("metrics.jsonl has no step lines to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise RuntimeError("elastic report --plot needs matplotlib, which the base install leaves out: "
                           "pip install 'elastic-train[plot]'") from error

    t0 = rows[0]["time"]
    t = [r["time"] - t0 for r in rows]
    ledger = {part: seconds for part, seconds in ((summary or {}).get("time_ledger") or {}).items()
              if isinstance(seconds, (int, float))}
    fig = Figure(figsize=(10, 8.5 if ledger else 7.5))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(4 if ledger else 3, 1, height_ratios=[3, 1.2, 1.5, 0.9][:4 if ledger else 3])
    ax_loss: Any = fig.add_subplot(grid[0])
    ax_world: Any = fig.add_subplot(grid[1], sharex=ax_loss)
    ax_lr: Any = fig.add_subplot(grid[2], sharex=ax_loss)
    losses = [(x, r["loss"]) for x, r in zip(t, rows, strict=True) if r.get("loss") is not None]
    ax_loss.plot([x for x, _ in losses], [y for _, y in losses], lw=0.9, color="C0")
    ax_loss.set_ylabel("loss")
    # A step that completed at t ran over the interval before t: "pre".
    ax_world.step(t, [r.get("world_size") for r in rows], where="pre", color="C2")
    ax_world.set_ylabel("world size")
    ax_world.yaxis.get_major_locator().set_params(integer=True)
    lrs = [(x, r["lr"]) for x, r in zip(t, rows, strict=True) if r.get("lr") is not None]
    ax_lr.plot([x for x, _ in lrs], [y for _, y in lrs], lw=0.9, color="C1")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("seconds since the first step")

    marked = []
    for rec in (summary or {}).get("recoveries", []):
        if rec.get("step") is None:
            continue
        x = _time_of_step(rows, rec["step"], t0)
        failure = rec.get("cause") != "scale_up"
        for ax in (ax_loss, ax_world, ax_lr):
            ax.axvline(x, color="red" if failure else "grey", ls="--" if failure else ":", lw=1)
        label = f"{rec.get('cause')} ({rec.get('rung')}), {rec.get('from_world')}\u2192{rec.get('to_world')}"
        ax_loss.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                         fontsize=7, color="red" if failure else "grey")
        marked.append({"step": rec["step"], "x": round(x, 3), "cause": rec.get("cause")})
    if ledger:
        _ledger_bar(fig.add_subplot(grid[3]), ledger)
    status = ""
    if summary:
        status = f"  [{summary['status']}, step {summary.get('final_step')}/{summary.get('total_steps')}]"
    ax_loss.set_title((title or "run") + status, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue(), {"points": len(rows), "recoveries_marked": marked, "time_ledger": ledger}


def _ledger_bar(ax: Any, ledger: dict[str, float]) -> None:
    """One horizontal bar of the wall time, stacked by part, each labelled with its seconds."""
    total = sum(ledger.values())
    left = 0.0
    order = [p for p in LEDGER_COLORS if p in ledger] + [p for p in ledger if p not in LEDGER_COLORS]
    for part in order:
        seconds = ledger[part]
        if seconds <= 0:
            continue
        ax.barh([0], [seconds], left=left, color=LEDGER_COLORS.get(part, "black"), edgecolor="white",
                label=f"{part} {seconds:.1f}s ({seconds / total:.0%})" if total else part)
        left += seconds
    ax.set_yticks([])
    ax.set_xlim(0, max(total, 1e-9))
    ax.set_xlabel("seconds of wall time, by part (summary.json time_ledger)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=4, fontsize=7, frameon=False)

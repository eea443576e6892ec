"""The picture behind `elastic report URL --plot`: loss, world size and learning rate over wall
time from `<storage>/metrics.jsonl`, with every recovery of summary.json marked.

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


def render(rows: list[dict], summary: dict | None, *, title: str = "") -> tuple[bytes, dict[str, Any]]:
    """PNG bytes of the three panels, and what was drawn (points, recoveries marked)."""
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
    fig = Figure(figsize=(10, 7.5))
    FigureCanvasAgg(fig)
    ax_loss, ax_world, ax_lr = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.2, 1.5]})
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
    status = ""
    if summary:
        status = f"  [{summary['status']}, step {summary.get('final_step')}/{summary.get('total_steps')}]"
    ax_loss.set_title((title or "run") + status, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue(), {"points": len(rows), "recoveries_marked": marked}

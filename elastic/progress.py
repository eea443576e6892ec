"""The driver's progress display: `ElasticTrainer(progress=ProgressDisplay())`.

One role: show the run's snapshots (about one a second, from the controller) as a progress bar
with steps/s and an ETA, plus loss, world size, generation, newest checkpoint and state. On a
terminal with `rich` installed (the `progress` extra) it is a rich progress bar; while it is shown,
log records of the driver go through a `rich.logging.RichHandler` on the bar's console, and what
is written to stdout/stderr (the lines Ray streams from the controller and the workers) is printed
above the bar, so neither tears it. Without rich, or when stdout is no terminal (a `ray job`'s log,
a file), it prints one plain line every `plain_every_s` seconds, with the same numbers.

`fit()` calls `close()` when the run ends (before it returns), which removes the bar and puts the
log handlers back.
"""
from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

RATE_WINDOW_S = 30.0     # steps/s: over the snapshots of about this long (an ETA that follows rescales)


def _info(snap: dict[str, Any]) -> str:
    loss = f"{snap['loss']:.3f}" if isinstance(snap.get("loss"), (int, float)) else "-"
    info = (f"loss {loss}  world {snap.get('world_size')}  gen {snap.get('generation')}  "
            f"ckpt {snap.get('last_committed_step')}  {snap.get('state')}")
    if snap.get("failures"):
        info += f"  (recovered from {snap['failures']} failure(s))"
    return info


class StepRate:
    """Steps per second over the last `window_s` of (time, step) samples, and the ETA it gives.
    A step count that goes back (steps lost in a recovery) restarts the window, and the window
    starts where the count last started to move (the scheduling before the first step, or a
    stall that the window has passed, is no part of the pace)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self._window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, t: float, step: int) -> None:
        if self._samples and step < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((t, step))
        while len(self._samples) > 2 and t - self._samples[1][0] >= self._window_s:
            self._samples.popleft()
        while len(self._samples) > 1 and self._samples[0][1] == self._samples[1][1]:
            self._samples.popleft()

    def per_s(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def eta_s(self, remaining: int) -> float | None:
        rate = self.per_s()
        return remaining / rate if rate else None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressDisplay:
    """`progress=` for ElasticTrainer: a rich bar on a terminal, else a plain line now and then.

    Args:
        quiet: show nothing.
        plain_every_s: the plain line's period.
        stream: where the plain line goes (default stdout; a rich bar is shown only when it is a
            terminal).
        use_rich: None: rich when importable and `stream` is a terminal; False: always the plain line.
        clock: the rate's and the plain line's clock (tests).
    """

    def __init__(self, *, quiet: bool = False, plain_every_s: float = 5.0, stream: IO[str] | None = None,
                 use_rich: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self._quiet = quiet
        self._plain_every_s = plain_every_s
        self._stream = stream
        self._clock = clock
        self._rate = StepRate()
        self._last_plain = -float("inf")
        self._rich: Any = None          # the rich Progress, once the first snapshot came
        self._task: Any = None
        self._swapped: list[logging.Handler] = []    # the root's terminal handlers, put back by close()
        self._rich_handler: logging.Handler | None = None
        out = stream if stream is not None else sys.stdout
        self._want_rich = (not quiet and use_rich is not False and _rich_available()
                           and getattr(out, "isatty", lambda: False)())

    @property
    def rich(self) -> bool:
        """Whether the display is (or will be) a rich bar."""
        return self._want_rich

    def __call__(self, snap: dict[str, Any]) -> None:
        if self._quiet:
            return
        now = self._clock()
        self._rate.add(now, int(snap.get("step") or 0))
        if self._want_rich:
            self._show_rich(snap)
        elif now - self._last_plain >= self._plain_every_s:
            self._last_plain = now
            print(self.plain_line(snap), file=self._stream or sys.stdout, flush=True)

    def plain_line(self, snap: dict[str, Any]) -> str:
        step, total = int(snap.get("step") or 0), int(snap.get("total_steps") or 0)
        shown = self._speed_eta(step, total)
        return (f"step {step}/{total}  {shown['speed']}  eta {shown['eta']}  {_info(snap)}  "
                f"{snap.get('elapsed_s', 0):.0f}s")

    def _show_rich(self, snap: dict[str, Any]) -> None:
        step, total = int(snap.get("step") or 0), int(snap.get("total_steps") or 0)
        if self._rich is None:
            self._start_rich(step, total)
        self._rich.update(self._task, completed=step, total=total, info=_info(snap), **self._speed_eta(step, total))

    def _speed_eta(self, step: int, total: int) -> dict[str, str]:
        rate = self._rate.per_s()
        return {"speed": f"{rate:.2f} steps/s" if rate is not None else "- steps/s",
                "eta": _duration(self._rate.eta_s(max(0, total - step)))}

    def _start_rich(self, step: int, total: int) -> None:
        from rich.console import Console
        from rich.logging import RichHandler
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        console = Console(file=self._stream) if self._stream is not None else Console()
        # steps/s and the ETA are StepRate's, as on the plain line: rich's own estimate would count
        # a resumed run's first step number as steps made, and steps lost in a recovery as negative.
        self._rich = Progress(TextColumn("step"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[speed]}"),
                              TextColumn("eta {task.fields[eta]}"), TextColumn("{task.fields[info]}"),
                              console=console, redirect_stdout=True, redirect_stderr=True)
        self._task = self._rich.add_task("train", total=total, completed=step, info="", speed="", eta="")
        terminals = {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}    # before the bar redirects them
        self._rich.start()
        # Handlers made before the bar hold the terminal's stream itself, past the bar's redirect:
        # their lines would tear it. They step aside for a RichHandler on the bar's console.
        root = logging.getLogger()
        self._swapped = [h for h in root.handlers
                         if type(h) is logging.StreamHandler and getattr(h, "stream", None) in terminals]
        for handler in self._swapped:
            root.removeHandler(handler)
        self._rich_handler = RichHandler(console=console, show_path=False)
        if self._swapped:
            self._rich_handler.setLevel(min(h.level for h in self._swapped))
        root.addHandler(self._rich_handler)

    def close(self) -> None:
        """Remove the bar (its last state stays on screen) and put the log handlers back."""
        if self._rich is None:
            return
        self._rich.stop()
        root = logging.getLogger()
        if self._rich_handler is not None:
            root.removeHandler(self._rich_handler)
        for handler in self._swapped:
            root.addHandler(handler)
        self._rich, self._swapped, self._rich_handler = None, [], None


def _rich_available() -> bool:
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    return True

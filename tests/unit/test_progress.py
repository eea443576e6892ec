"""The driver's progress display: steps/s and an ETA from the snapshots, a plain line when rich or a
terminal is missing, and a rich bar that log lines do not tear (its handlers are put back after)."""
import io
import logging
import re

import pytest

from elastic.progress import ProgressDisplay, StepRate
from support import FakeClock

pytestmark = pytest.mark.timeout(30)



def snap(step, total=100, **extra):
    return {"step": step, "total_steps": total, "loss": 2.5, "world_size": 2, "generation": 1,
            "last_committed_step": 40, "state": "running", "failures": 0, "elapsed_s": 12.0} | extra


def test_step_rate_and_eta_follow_the_window_and_restart_after_lost_steps():
    rate = StepRate(window_s=10)
    assert rate.per_s() is None and rate.eta_s(50) is None
    for t in range(0, 21):
        rate.add(float(t), 2 * t)                 # 2 steps/s
    assert rate.per_s() == pytest.approx(2.0) and rate.eta_s(100) == pytest.approx(50.0)
    rate.add(21.0, 30)                            # steps lost in a recovery: the count went back
    assert rate.per_s() is None
    rate.add(22.0, 31)
    assert rate.per_s() == pytest.approx(1.0)
    waited = StepRate(window_s=30)
    for t in range(10):
        waited.add(float(t), 0)                   # scheduling: no step yet
    waited.add(10.0, 2)
    assert waited.per_s() == pytest.approx(2.0)   # the pace since the count moved, not since the start


def test_plain_line_shows_rate_eta_and_the_runs_state_every_period():
    out, clock = io.StringIO(), FakeClock(0.0)
    display = ProgressDisplay(stream=out, clock=clock, plain_every_s=5.0)
    assert not display.rich                       # no terminal: the plain line
    for t in range(0, 11):
        clock.now = float(t)
        display(snap(500 + 4 * t, total=1000))    # a resumed run at 4 steps/s
    lines = out.getvalue().splitlines()
    assert len(lines) == 3                        # at 0, 5 and 10 s
    assert lines[0].startswith("step 500/1000  - steps/s  eta -:--:--")
    assert lines[-1].startswith("step 540/1000  4.00 steps/s  eta 0:01:55  loss 2.500  world 2  gen 1  ckpt 40")
    display.close()                               # nothing to close: no error


def test_quiet_shows_nothing():
    out = io.StringIO()
    display = ProgressDisplay(quiet=True, stream=out)
    display(snap(1))
    assert out.getvalue() == "" and not display.rich


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_rich_bar_routes_log_records_through_its_console_and_puts_the_handlers_back(monkeypatch):
    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "240")                        # the whole line on one row
    out, clock = Terminal(), FakeClock(0.0)
    root = logging.getLogger()
    plain = logging.StreamHandler(__import__("sys").stderr)      # one made before the bar: it would tear it
    root.addHandler(plain)
    try:
        display = ProgressDisplay(stream=out, clock=clock)
        assert display.rich
        for t in range(3):
            clock.now = float(t)
            display(snap(10 + t, failures=1))
        assert plain not in root.handlers and any(type(h).__name__ == "RichHandler" for h in root.handlers)
        logging.getLogger("elastic.test").warning("a recovery happened")
        display.close()
        assert plain in root.handlers and not any(type(h).__name__ == "RichHandler" for h in root.handlers)
    finally:
        root.removeHandler(plain)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())     # without the terminal's escapes
    assert "a recovery happened" in text                        # above the bar, through its console
    assert "12/100" in text and "1.00 steps/s" in text and "recovered from 1 failure(s)" in text

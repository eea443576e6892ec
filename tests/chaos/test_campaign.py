"""The campaign's final heal and teardown: every step runs, even when the run under test has
crashed, a step fails, or the operator's Ctrl-C lands in the middle."""
from __future__ import annotations

import pytest

from chaos.campaign import Campaign
from chaos.history import History
from chaos.job import JobSpec
from chaos.scenarios import SCENARIOS
from chaos.schedule import fixed

pytestmark = pytest.mark.timeout(30)


class Part:
    """A stand-in for the job, watcher, proxy, cluster or nemesis: records what was called and
    raises from the method named in `fails`."""

    def __init__(self, name, calls, fails=(), error=RuntimeError):
        self.name, self.calls, self.fails, self.error = name, calls, fails, error

    def __getattr__(self, method):
        def call(*args, **kwargs):
            self.calls.append(f"{self.name}.{method}")
            if method in self.fails:
                raise self.error(f"{self.name}.{method} failed")
            return {} if method == "snapshot" else None
        return call


def campaign(tmp_path, calls, **fails) -> Campaign:
    c = Campaign(SCENARIOS["smoke"], JobSpec(storage=str(tmp_path / "run")), fixed([]), view=None,
                 history=History(str(tmp_path / "history.jsonl")), out_dir=str(tmp_path), upstream=None,
                 timeout_s=10)
    for name in ("nemesis", "job", "watcher", "proxy", "cluster"):
        part = fails.get(name, ((), RuntimeError))
        setattr(c, name, Part(name, calls, *part))
    return c


ALL_STEPS = ["nemesis.heal_all", "job.stop", "watcher.stop", "nemesis.teardown", "proxy.snapshot", "proxy.close",
             "cluster.shutdown"]


def test_teardown_heals_first_and_stops_everything(tmp_path):
    calls = []
    campaign(tmp_path, calls)._teardown()
    assert calls == ALL_STEPS


@pytest.mark.parametrize("name,method,error", [("nemesis", "heal_all", RuntimeError),
                                               ("job", "stop", KeyboardInterrupt),
                                               ("watcher", "stop", OSError)])
def test_a_failing_step_does_not_stop_the_rest_and_is_raised_after_them(tmp_path, name, method, error):
    calls = []
    c = campaign(tmp_path, calls, **{name: ((method,), error)})
    with pytest.raises(error):
        c._teardown()
    assert calls == ALL_STEPS


def test_a_late_schedule_still_gets_a_commit_interval_per_pending_fault(tmp_path):
    from chaos.faults import KillWorker
    c = campaign(tmp_path, [])
    c.schedule = fixed([(t, KillWorker()) for t in (1.0, 2.0, 3.0, 4.0)])
    c.nemesis = type("N", (), {"next_index": 1})()
    c.t0 = 0.0                       # the schedule's times are long past
    spec = JobSpec(storage=str(tmp_path / "run"), steps=400, checkpoint_every=50)
    summary = {"resumed_from": 300, "final_step": 400, "wall_s": 100.0}      # 1 step/s
    assert c._extended_steps(spec, summary) >= 400 + (3 + 1) * 50

"""The runner end to end on a fake job (no Ray, seconds): a correct run passes, a deliberately
broken one is caught, and `python -m chaos run` exits non-zero for it."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from chaos.__main__ import main
from chaos.faults import KillWorker, Preempt, UserError
from chaos.procs import alive
from chaos.runner import RunOptions, run
from chaos.scenarios import SCENARIOS, Scenario
from chaos.schedule import fixed

pytestmark = pytest.mark.timeout(120)

FAKE_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_job.py")


def fake_scenario(restarts: int = 0, user_error: bool = False) -> Scenario:
    def build(sc, seed):
        launch = (UserError(rank=0, step=60),) if user_error else ()
        return fixed([(0.3, KillWorker(target="one")), (0.6, Preempt(target="rank:0"))], seed=seed,
                      launch_faults=launch)
    return Scenario(name="fake", description="fake job", build=build, steps=100, workers="1:1", checkpoint_every=10,
                    heartbeat_timeout_s=5.0, restarts=restarts, job_timeout_s=60)


def options(tmp_path, *extra: str, **kw) -> RunOptions:
    return RunOptions(scenario=kw.pop("scenario", fake_scenario()), seed=3, storage=str(tmp_path / "run"),
                      out_dir=str(tmp_path / "out"), script=FAKE_JOB, extra_args=extra, **kw)


def verdicts(outcome) -> dict:
    return {v.name: v.status for v in outcome.verdicts}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """One fault-free run of the fake job, the reference of the tests that compare models."""
    tmp = tmp_path_factory.mktemp("reference")
    sc = fake_scenario()
    outcome = run(RunOptions(scenario=dataclasses.replace(sc, build=lambda sc, seed: fixed([], seed=seed)), seed=3,
                             storage=str(tmp / "run"), out_dir=str(tmp / "out"), script=FAKE_JOB, reference="none"))
    assert outcome.ok and outcome.report["attempts"][-1]["status"] == "finished", outcome.report
    return str(tmp / "run")


def test_a_reference_started_once_the_job_trains_is_the_one_compared(tmp_path):
    # RunOptions.reference_once_running: the reference starts with the job's first step, not
    # before the job, still at the lowest priority, and it is the one the model is compared with.
    outcome = run(options(tmp_path, reference_once_running=True))
    assert outcome.ok, outcome.report["invariants"]
    assert verdicts(outcome)["model_matches_reference"] == "pass"
    history = [json.loads(line) for line in open(tmp_path / "out" / "history.jsonl")]
    types = [e["type"] for e in history]
    started, = [e for e in history if e["type"] == "reference"]
    assert started["nice"] == 19 and not started["reused"]
    assert types.index("job_start") < types.index("running") < types.index("reference") < types.index("job_exit")
    assert types.count("reference_done") == 1 and "reference_discarded" not in types
    assert (tmp_path / "run-reference" / "chaos_reference.json").exists()


def test_a_correct_run_passes_and_is_reported(tmp_path):
    outcome = run(options(tmp_path))
    assert outcome.ok, outcome.report["invariants"]
    assert verdicts(outcome)["model_matches_reference"] == "pass"
    # The reference trained alongside the campaign, at the lowest priority, and is kept for reuse.
    history = [json.loads(line) for line in open(tmp_path / "out" / "history.jsonl")]
    started, = [e for e in history if e["type"] == "reference"]
    assert started["nice"] == 19 and not started["reused"]
    assert [e["type"] for e in history].index("reference") < [e["type"] for e in history].index("job_start")
    assert (tmp_path / "run-reference" / "chaos_reference.json").exists()
    report = json.load(open(tmp_path / "out" / "chaos_report.json"))
    assert report["faults_injected"] == 2 and report["kinds_injected"] == ["kill_worker", "preempt"]
    assert [f["outcome"] for f in report["faults"]] == ["recovered", "recovered"]
    assert [r["cause"] for r in report["recoveries"]] == ["worker_died", "preempted"]
    assert report["goodput"]["campaign"] == 0.5 == report["goodput"]["per_attempt"][0]   # the fake job's
    assert os.path.getsize(tmp_path / "out" / "chaos_report.png") > 0
    pids = [pid for f in report["faults"] for pid in f["detail"]["pids"]]
    assert pids and not any(alive(p) for p in pids)


def test_a_run_that_loses_committed_steps_is_caught(tmp_path):
    outcome = run(options(tmp_path, "--break=rollback", reference="none"))
    assert not outcome.ok
    assert verdicts(outcome)["committed_steps_kept"] == "fail"


def test_a_run_whose_model_differs_from_the_reference_is_caught(tmp_path, reference):
    outcome = run(options(tmp_path, "--break=sha", reference=reference))
    assert not outcome.ok
    assert verdicts(outcome)["model_matches_reference"] == "fail"


def test_the_cli_exits_non_zero_on_a_violated_invariant(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SCENARIOS, "fake", fake_scenario())
    code = main(["run", "fake", "--seed", "1", "--storage", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                 "--job", FAKE_JOB, "--job-arg=--break=untyped", "--reference", "none"])
    assert code == 1
    assert "terminates_typed" in capsys.readouterr().out


def test_an_armed_user_error_fails_the_attempt_and_the_restart_finishes_the_run(tmp_path):
    outcome = run(options(tmp_path, scenario=fake_scenario(restarts=1, user_error=True), reference="none"))
    assert outcome.ok, outcome.report["invariants"]
    attempts = outcome.report["attempts"]
    # The restart may itself be run again for longer when its faults' gates (a commit of each
    # new generation, seen by a watcher polling every 0.5 s) outlast the fake job's few seconds.
    assert [a["status"] for a in attempts[:2]] == ["failed", "finished"]
    assert all(a["status"] == "finished" for a in attempts[1:])
    assert attempts[0]["error"] == "InjectedUserError" and attempts[1]["resumed_from"] >= 50
    assert outcome.report["faults_injected"] == 3        # the user error and both kills
    user = next(f for f in outcome.report["faults"] if f["kind"] == "user_error")
    assert user["outcome"] == "failed as expected"


def test_a_non_empty_storage_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "status.json").write_text("{}")
    code = main(["run", "smoke", "--storage", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    assert code == 2


def test_a_job_that_ends_before_its_schedule_is_run_again_for_longer(tmp_path):
    # The first attempt (100 fake steps of 20 ms) ends seconds before the second fault; the first
    # fault must land inside it. With 40 steps (0.8 s) a loaded CI machine once injected it after
    # the job's last look at its worker: the job finished with no recovery to match.
    def build(sc, seed):
        return fixed([(0.2, KillWorker(target="one")), (6.0, KillWorker(target="one"))], seed=seed)
    sc = Scenario(name="short", description="fake job shorter than its schedule", build=build, steps=100,
                  workers="1:1", checkpoint_every=10, heartbeat_timeout_s=5.0, job_timeout_s=60)
    outcome = run(options(tmp_path, scenario=sc, reference="none"))
    assert outcome.ok, outcome.report["invariants"]
    attempts = outcome.report["attempts"]
    assert len(attempts) >= 2 and all(a["status"] == "finished" for a in attempts)
    assert attempts[-1]["steps"] > 100 and attempts[-1]["resumed_from"] is not None
    assert outcome.report["faults_injected"] == 2


def test_a_reference_started_for_fewer_steps_than_the_job_ran_is_discarded(tmp_path):
    from chaos.history import History
    from chaos.job import JobSpec
    from chaos.reference import MARKER, _identity, reference_run, reference_url

    class Started:
        def __init__(self, spec):
            self.spec, self.url, self.stopped = spec, "unused", False

        def stop(self):
            self.stopped = True

        def result(self, timeout_s):
            raise AssertionError("a reference of another job must not be used")

    planned = JobSpec(storage=str(tmp_path / "run"), steps=40, script=FAKE_JOB)
    ran = planned.replace(steps=500)
    cached = tmp_path / "run-reference"          # a finished reference of the job as it ran
    cached.mkdir()
    (cached / "summary.json").write_text(json.dumps({"status": "finished", "model_sha256": "x"}))
    (cached / MARKER).write_text(json.dumps(_identity(ran)))
    assert reference_url(ran.storage) == str(cached)
    history = History()
    started = Started(planned)
    reference = reference_run(ran, "auto", None, str(tmp_path), history, timeout_s=5, started=started)
    assert started.stopped and reference["reused"] and reference["summary"]["model_sha256"] == "x"
    assert [e["type"] for e in history.events] == ["reference_discarded", "reference"]


def test_an_interrupted_run_exits_130_and_leaves_sigterm_as_it_was(tmp_path, monkeypatch, capsys):
    import signal

    import chaos.runner

    def interrupted(opts):
        raise KeyboardInterrupt("signal 15")     # as chaos's SIGTERM handler raises it mid-run

    monkeypatch.setattr(chaos.runner, "run", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["run", "smoke", "--storage", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before

"""The invariants on hand-made histories: a good run passes, and each tampering is reported
by the invariant it violates (the chaos suite must not be blind)."""
from __future__ import annotations

import copy

import pytest

from chaos.invariants import FAIL, PASS, SKIP, Evidence, check_all

pytestmark = pytest.mark.timeout(30)


def good() -> dict:
    kill = {"kind": "kill_worker", "duration_s": 0.0, "target": "one"}
    rot = {"kind": "corrupt_checkpoint", "duration_s": 0.0, "force_load": True, "within_s": 60.0}
    history = [
        {"t": 1.0, "type": "job_start", "attempt": 0},
        {"t": 10.0, "type": "commits", "steps": [20], "generations": [0], "newest": 20},
        {"t": 12.0, "type": "invoke", "index": 0, "fault": kill, "detail": {"ranks": [1]},
         "run": {"generation": 0, "step": 25}, "committed_newest": 20},
        {"t": 20.0, "type": "commits", "steps": [20, 40], "generations": [0, 1], "newest": 40},
        {"t": 30.0, "type": "invoke", "index": 1, "fault": rot, "run": {"generation": 1, "step": 45},
         "detail": {"step": 40, "corrupted": [{"step": 40, "generation": 1}], "killed_all": True, "intact_older": 20}},
        {"t": 40.0, "type": "commits", "steps": [40, 60], "generations": [2, 2], "newest": 60},
        {"t": 60.0, "type": "commits", "steps": [60, 80, 100], "generations": [2, 2, 2], "newest": 100},
    ]
    summary = {"status": "finished", "final_step": 100, "total_steps": 100, "error": None, "resumed_from": None,
               "recoveries": [{"cause": "worker_died", "rung": "warm", "step": 25, "generation": 1},
                              {"cause": "scale_up", "rung": "warm", "step": 30, "generation": 2},
                              {"cause": "worker_died", "rung": "checkpoint", "step": 20, "generation": 2}],
               "checkpoints": [60, 80, 100], "checkpoint_fallbacks": [{"step": 40, "reason": "sha256"}],
               "model_sha256": "abc", "world_size_history": [[0, 3], [25, 3], [30, 3], [20, 3]]}
    metrics = [{"step": s, "world_size": 3, "loss": 1.0, "time": 1.0 + s} for s in range(1, 101)]
    return {"history": history, "attempts": [{"summary": summary, "exit_code": 0, "timed_out": False, "fail_at": None,
                                              "started_at": 1.0, "ended_at": 70.0}],
            "total_steps": 100, "heartbeat_timeout_s": 10.0, "metrics": metrics,
            "reference": {"summary": {"status": "finished", "model_sha256": "abc", "final_step": 100,
                                      "world_size_history": [[0, 3]]}, "metrics": copy.deepcopy(metrics)},
            "final_verification": [{"step": 100, "generation": 2, "problems": []}]}


def verdicts(ev: dict) -> dict[str, str]:
    return {v.name: v.status for v in check_all(Evidence(**ev))}


def summary(ev: dict) -> dict:
    return ev["attempts"][0]["summary"]


def test_a_good_history_passes_every_invariant():
    assert set(verdicts(good()).values()) == {PASS, SKIP}
    assert [name for name, status in verdicts(good()).items() if status == SKIP] == ["data_order_matches_reference"]


def test_a_recovery_older_than_a_commit_made_before_the_fault_loses_a_committed_step():
    ev = good()
    summary(ev)["recoveries"][0]["step"] = 10
    assert verdicts(ev)["committed_steps_kept"] == FAIL


def test_the_newest_commit_going_back_is_a_lost_step():
    ev = good()
    ev["history"].append({"t": 65.0, "type": "commits", "steps": [60], "generations": [2], "newest": 60})
    assert verdicts(ev)["committed_steps_kept"] == FAIL


def test_a_final_step_that_is_not_committed_is_reported():
    ev = good()
    summary(ev)["checkpoints"] = [60, 80]
    assert verdicts(ev)["committed_steps_kept"] == FAIL


def test_a_fault_without_its_recovery_is_reported():
    ev = good()
    del summary(ev)["recoveries"][2]
    result = check_all(Evidence(**ev))
    recovered = next(v for v in result if v.name == "faults_recovered")
    assert recovered.status == FAIL
    assert "fault 1 (corrupt_checkpoint)" in recovered.detail
    ev = good()
    summary(ev)["recoveries"][0]["cause"] = "preempted"      # not a cause a SIGKILL can produce
    assert verdicts(ev)["faults_recovered"] == FAIL


def test_restoring_a_rotted_checkpoint_or_skipping_no_fallback_is_a_bad_load():
    ev = good()
    summary(ev)["recoveries"][2]["step"] = 40
    assert verdicts(ev)["no_bad_checkpoint_loaded"] == FAIL
    ev = good()
    summary(ev)["checkpoint_fallbacks"] = []
    assert verdicts(ev)["no_bad_checkpoint_loaded"] == FAIL


def test_loading_a_step_never_committed_is_a_bad_load():
    ev = good()
    summary(ev)["recoveries"][2]["step"] = 30
    assert verdicts(ev)["no_bad_checkpoint_loaded"] == FAIL


def test_a_corrupt_checkpoint_left_on_storage_fails_unless_a_fault_rotted_it():
    ev = good()
    ev["final_verification"] = [{"step": 100, "generation": 2, "problems": [{"file": "x", "reason": "size"}]}]
    assert verdicts(ev)["no_bad_checkpoint_loaded"] == FAIL
    ev["final_verification"] = [{"step": 40, "generation": 1, "problems": [{"file": "x", "reason": "size"}]}]
    assert verdicts(ev)["no_bad_checkpoint_loaded"] == PASS


def test_model_hash_is_compared_only_for_the_same_world_size_history():
    ev = good()
    summary(ev)["model_sha256"] = "other"
    assert verdicts(ev)["model_matches_reference"] == FAIL
    summary(ev)["world_size_history"] = [[0, 3], [20, 3], [25, 2], [30, 3]]    # steps 26..30 at 2
    assert verdicts(ev)["model_matches_reference"] == SKIP
    summary(ev)["world_size_history"] = [[0, 3], [25, 2], [20, 3]]             # redone at 3 after a rollback
    assert verdicts(ev)["model_matches_reference"] == FAIL


def test_data_order_is_compared_whatever_the_world_sizes():
    ev = good()
    assert verdicts(ev)["data_order_matches_reference"] == SKIP        # summaries without it
    summary(ev).update(data_order_sha256="a", samples_consumed=800)
    ev["reference"]["summary"].update(data_order_sha256="a", samples_consumed=800)
    summary(ev)["world_size_history"] = [[0, 3], [20, 3], [25, 2], [30, 3]]
    assert verdicts(ev)["data_order_matches_reference"] == PASS
    ev["reference"]["summary"]["data_order_sha256"] = "b"
    assert verdicts(ev)["data_order_matches_reference"] == FAIL
    ev["reference"]["summary"].update(data_order_sha256="a", samples_consumed=808)
    assert verdicts(ev)["data_order_matches_reference"] == FAIL


def test_a_failure_must_be_typed_and_finished_must_mean_finished():
    ev = good()
    summary(ev).update(status="failed", error=None)
    ev["attempts"][0]["exit_code"] = 1
    assert verdicts(ev)["terminates_typed"] == FAIL
    summary(ev)["error"] = {"type": "TooManyFailuresError", "message": "...", "ranks": []}
    assert verdicts(ev)["terminates_typed"] == PASS
    ev = good()
    ev["attempts"][0]["exit_code"] = 1
    assert verdicts(ev)["terminates_typed"] == FAIL
    ev = good()
    ev["attempts"][0].update(timed_out=True)
    assert verdicts(ev)["terminates_typed"] == FAIL


def test_a_user_error_must_fail_its_attempt_on_its_rank_and_the_restart_must_resume():
    ev = good()
    armed = {"kind": "user_error", "duration_s": 0.0, "rank": 1, "step": 50}
    ev["history"].insert(1, {"t": 1.0, "type": "invoke", "index": 2, "fault": armed, "run": {"generation": -1}})
    first = {"summary": {"status": "failed", "final_step": 49, "recoveries": [], "checkpoints": [20],
                         "error": {"type": "InjectedUserError", "message": "x", "ranks": [1]}},
             "exit_code": 1, "timed_out": False, "fail_at": [1, 50], "started_at": 0.5, "ended_at": 0.9}
    ev["attempts"].insert(0, first)
    summary(ev)  # the finished attempt is now the second one
    ev["attempts"][1]["summary"]["resumed_from"] = None
    assert verdicts(ev)["faults_recovered"] == PASS
    first["summary"]["error"]["ranks"] = [0]
    assert verdicts(ev)["faults_recovered"] == FAIL


def test_a_restart_that_resumes_from_an_older_step_than_committed_loses_it():
    ev = good()
    ev["history"].insert(3, {"t": 11.0, "type": "job_exit", "attempt": 0})
    first = {"summary": {"status": "failed", "final_step": 22, "recoveries": [], "checkpoints": [20],
                         "error": {"type": "TooManyFailuresError", "message": "x", "ranks": []}},
             "exit_code": 1, "timed_out": False, "fail_at": None, "started_at": 0.5, "ended_at": 11.0}
    ev["attempts"].insert(0, first)
    ev["attempts"][1]["summary"]["resumed_from"] = 20
    assert verdicts(ev)["committed_steps_kept"] == PASS
    ev["attempts"][1]["summary"]["resumed_from"] = 0
    assert verdicts(ev)["committed_steps_kept"] == FAIL


def test_a_fault_that_ends_an_attempt_through_the_failure_policy_is_not_missing():
    ev = good()
    s = summary(ev)
    s.update(status="failed", error={"type": "TooManyFailuresError", "message": "x", "ranks": []})
    s["recoveries"] = []
    ev["history"] = [e for e in ev["history"] if e.get("index") != 1]
    ev["attempts"][0]["exit_code"] = 1
    result = {v.name: v for v in check_all(Evidence(**ev))}
    assert result["faults_recovered"].status == PASS
    assert result["faults_recovered"].data["matches"][0]["outcome"] == "ended attempt"


def test_metrics_must_have_one_line_per_kept_step():
    ev = good()
    del ev["metrics"][9]      # step 10
    result = {v.name: v for v in check_all(Evidence(**ev))}
    assert result["metrics_complete"].status == FAIL and "missing steps [10]" in result["metrics_complete"].detail
    ev = good()
    ev["metrics"].append(dict(ev["metrics"][-1]))
    assert verdicts(ev)["metrics_complete"] == FAIL


def storm(gated: bool) -> dict:
    """Three kills: the second lands while the first's recovery is under way (same generation),
    the third after it; the runtime records two recoveries."""
    kill = {"kind": "kill_worker", "duration_s": 0.0, "target": "one"}
    ev = good()
    ev["history"] = [
        {"t": 0.5, "type": "schedule", "schedule": {"wait_for_recovery": gated}},
        {"t": 1.0, "type": "job_start", "attempt": 0},
        {"t": 10.0, "type": "commits", "steps": [20], "generations": [0], "newest": 20},
        {"t": 12.0, "type": "invoke", "index": 0, "fault": kill, "run": {"state": "running", "generation": 0}},
        {"t": 12.5, "type": "invoke", "index": 1, "fault": kill, "run": {"state": "recovering", "generation": 0}},
        {"t": 30.0, "type": "invoke", "index": 2, "fault": kill, "run": {"state": "running", "generation": 1}},
        {"t": 60.0, "type": "commits", "steps": [60, 80, 100], "generations": [2, 2, 2], "newest": 100}]
    summary(ev)["recoveries"] = [{"cause": "worker_died", "rung": "warm", "step": 25, "generation": 1},
                                 {"cause": "worker_died", "rung": "warm", "step": 40, "generation": 2}]
    summary(ev)["checkpoint_fallbacks"] = []
    return ev


def test_overlapping_faults_share_a_recovery_and_a_storm_only_needs_one_after_each_fault():
    for gated in (True, False):
        result = {v.name: v for v in check_all(Evidence(**storm(gated)))}["faults_recovered"]
        assert result.status == PASS, (gated, result.detail)
        assert [m["outcome"] for m in result.data["matches"]] == ["recovered", "shared", "recovered"]
    ev = storm(True)
    del summary(ev)["recoveries"][1]
    assert verdicts(ev)["faults_recovered"] == FAIL        # gated: the third fault has none
    ev = storm(False)
    summary(ev)["recoveries"][1]["generation"] = 3
    ev["history"][5]["run"]["generation"] = 2
    del summary(ev)["recoveries"][0]
    assert verdicts(ev)["faults_recovered"] == PASS        # storm: one recovery after all three


def test_an_optional_fault_never_takes_the_recovery_a_required_one_needs():
    ev = good()
    short_hang = {"kind": "hang", "duration_s": 1.0, "target": "one"}
    ev["history"].insert(2, {"t": 11.0, "type": "invoke", "index": 5, "fault": short_hang,
                             "run": {"state": "running", "generation": 0}})
    result = {v.name: v for v in check_all(Evidence(**ev))}["faults_recovered"]
    assert result.status == PASS
    assert [m["outcome"] for m in result.data["matches"]] == ["not required", "recovered", "recovered"]

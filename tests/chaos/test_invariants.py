"""The invariants on hand-made histories: a good run passes, and each tampering is reported
by the invariant it violates (the chaos suite must not be blind)."""
from __future__ import annotations

import copy

import pytest

from chaos.invariants import FAIL, PASS, SKIP, Evidence, Verdict, check_all

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
            "final_verification": [{"step": 100, "generation": 2, "problems": []}],
            # Generation 1 re-formed warm at step 25; generation 2 restored step 20 after the rot.
            "fence": {"generation": 2, "run_id": "r1", "history": [[0, 0, "r1"], [1, 25, "r1"], [2, 20, "r1"]]}}


def verdicts(ev: dict) -> dict[str, str]:
    return {v.name: v.status for v in check_all(Evidence(**ev))}


def summary(ev: dict) -> dict:
    return ev["attempts"][0]["summary"]


def test_a_good_history_passes_every_invariant():
    assert set(verdicts(good()).values()) == {PASS, SKIP}
    assert [name for name, status in verdicts(good()).items() if status == SKIP] == [
        "data_order_matches_reference", "intruders_refused", "no_false_hang",    # summaries without it; no
        "workers_outlive_controller", "runs_outlive_drivers"]                    # intruder; no storage fault;
                                                                                 # no controller or driver killed


def with_controller_killed(restart: dict | None) -> dict:
    ev = good()
    ev["history"].insert(3, {"t": 15.0, "type": "invoke", "index": 2, "fault": {"kind": "kill_controller",
                                                                                  "duration_s": 0.0},
                             "detail": {"pid": 99, "signalled": 1}, "run": {"generation": 1, "step": 30}})
    summary(ev)["controller_restarts"] = [restart] if restart else []
    return ev


def test_a_killed_controller_must_be_replaced_by_one_that_adopted_the_workers():
    adopted = {"kind": "running", "adopted_at": 15.9, "without_controller_s": 0.9, "replaced": 0, "reason": "ok"}
    assert verdicts(with_controller_killed(adopted))["workers_outlive_controller"] == PASS
    assert verdicts(with_controller_killed(None))["workers_outlive_controller"] == FAIL
    restarted = {**adopted, "kind": "restart", "replaced": 3, "reason": "lost while recovering"}
    assert verdicts(with_controller_killed(restarted))["workers_outlive_controller"] == FAIL


def with_driver_killed(replaced: bool, ended_as: str | None) -> dict:
    ev = good()
    fault = {"kind": "kill_driver", "duration_s": 0.0}
    ev["history"].insert(3, {"t": 15.0, "type": "invoke", "index": 2, "fault": fault,
                             "detail": {"pid": 99, "signalled": 1, "run_id": "r1", "step": 30},
                             "run": {"generation": 1, "step": 30}})
    if replaced:
        ev["history"].insert(4, {"t": 15.5, "type": "driver_replaced", "attempt": 0, "killed": 99, "pid": 100})
    ev["history"].append({"t": 70.0, "type": "job_exit", "attempt": 0, "exit_code": 0, "status": "finished",
                          "run_id": ended_as})
    return ev


def test_a_killed_driver_must_leave_its_run_going_for_the_job_started_again_to_attach_to():
    assert verdicts(with_driver_killed(True, "r1"))["runs_outlive_drivers"] == PASS
    assert verdicts(with_driver_killed(False, "r1"))["runs_outlive_drivers"] == FAIL      # never started again
    assert verdicts(with_driver_killed(True, "r2"))["runs_outlive_drivers"] == FAIL       # a run of its own
    no_summary = with_driver_killed(True, "r1")
    no_summary["history"][-1]["status"] = None
    assert verdicts(no_summary)["runs_outlive_drivers"] == FAIL


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


# ---- the commit protocol: lost commits, loads of the wrong generation, intruders ----------------
def commits(t: float, steps: list[int], generations: list[int], rejected: list | None = None) -> dict:
    event = {"t": t, "type": "commits", "steps": steps, "generations": generations,
             "newest": max(steps) if steps else None}
    return {**event, "rejected": rejected} if rejected else event


def test_a_commit_gone_with_fewer_newer_ones_than_keep_is_lost():
    ev = good()
    summary(ev)["config"] = {"checkpoint": {"keep": 3}}
    ev["final_verification"] = [{"step": s, "generation": 2, "problems": []} for s in (60, 80, 100)]
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_committed_checkpoint_lost"]
    assert result.status == FAIL and "step 20 (generation 0)" in result.detail     # gone with 2 newer
    ev["history"][5] = commits(40.0, [20, 40, 60], [0, 2, 2])
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_committed_checkpoint_lost"]
    assert result.status == PASS, result.detail
    assert result.data["accounted"]["superseded"] == 1 and result.data["accounted"]["retention"] == 2
    ev["final_verification"] = ev["final_verification"][1:]       # 60 gone at the end, 2 newer only
    assert verdicts(ev)["no_committed_checkpoint_lost"] == FAIL


def test_a_manifest_replaced_by_an_older_generations_loses_the_commit():
    ev = good()
    ev["history"].append(commits(65.0, [60, 80, 100], [2, 2, 1]))
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_committed_checkpoint_lost"]
    assert result.status == FAIL and "replaced by an older generation's (1)" in result.detail


def test_a_late_commit_outside_the_timeline_may_vanish_but_not_without_the_fence_history():
    ev = good()
    # Generation 1's late commit of step 120 (it had been fenced by generation 2, which restarted
    # from step 20) is listed for a moment, then the history rejects it.
    ev["history"].insert(6, commits(50.0, [40, 60, 120], [2, 2, 1]))
    assert verdicts(ev)["no_committed_checkpoint_lost"] == PASS
    assert verdicts(ev)["committed_steps_kept"] == PASS                # the newest going back is fine
    ev["fence"]["history"] = ev["fence"]["history"][:2]                # no restart before step 120
    assert verdicts(ev)["no_committed_checkpoint_lost"] == FAIL
    assert verdicts(ev)["committed_steps_kept"] == FAIL


def test_a_load_must_read_the_manifest_of_the_steps_owner():
    ev = good()
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_checkpoint_from_wrong_generation"]
    assert result.status == PASS and "1 loads" in result.detail
    summary(ev)["recoveries"][2]["loaded_generation"] = 1      # generation 1 started at step 25
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_checkpoint_from_wrong_generation"]
    assert result.status == FAIL and "started from step 25" in result.detail
    summary(ev)["recoveries"][2]["loaded_generation"] = 2
    assert verdicts(ev)["no_checkpoint_from_wrong_generation"] == FAIL   # its own generation
    summary(ev)["recoveries"][2]["loaded_generation"] = 0
    assert verdicts(ev)["no_checkpoint_from_wrong_generation"] == PASS


def resumed_as_generation_3(ev: dict, *, generation_2_seen_at: float, rejected: list | None = None) -> dict:
    """`good()`'s run with a second attempt (80-90 s) that starts as generation 3 and resumes from
    step 100; FENCE's generation 2 (the first attempt's last) is first sampled at
    `generation_2_seen_at`. Returns the second attempt."""
    ev["history"] += [commits(65.0, [60, 80, 100], [2, 2, 2], rejected=rejected),
                      {"t": generation_2_seen_at, "type": "fence", "generation": 2, "run_id": "r1", "history": []},
                      {"t": 81.0, "type": "fence", "generation": 3, "run_id": "r2", "history": []}]
    second = copy.deepcopy(ev["attempts"][0])
    second.update(started_at=80.0, ended_at=90.0)
    second["summary"].update(resumed_from=100, recoveries=[], checkpoint_fallbacks=[])
    ev["attempts"].append(second)
    ev["fence"]["history"].append([3, 100, "r2"])
    return second


def test_a_resume_from_a_fenced_writers_late_commit_is_caught():
    ev = good()
    # The late commit of step 120 by generation 1 is on storage (rejected) when attempt 1
    # starts as generation 3 and resumes from it.
    second = resumed_as_generation_3(ev, generation_2_seen_at=3.0, rejected=[[120, 1]])
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_checkpoint_from_wrong_generation"]
    assert result.status == PASS and "2 loads" in result.detail, result.detail
    second["summary"]["resumed_from"] = 120
    ev["fence"]["history"][-1] = [3, 120, "r2"]
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_checkpoint_from_wrong_generation"]
    assert result.status == FAIL and "fenced writer's late commit" in result.detail
    assert "owner of step 120 is generation 2" in result.detail


def test_an_attempts_generation_is_not_the_last_one_of_the_attempt_before_seen_late():
    # The watcher samples FENCE every 0.5 s: the previous attempt's last generation (2, which it
    # recovered into) is first seen just after attempt 1 started; attempt 1's own is 3.
    ev = good()
    second = resumed_as_generation_3(ev, generation_2_seen_at=80.2)
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_checkpoint_from_wrong_generation"]
    assert result.status == PASS and "2 loads" in result.detail, result.detail
    # A resume that really loads its own generation's manifest is still caught.
    second["summary"]["loaded_generation"] = 3
    result = {v.name: v for v in check_all(Evidence(**ev))}["no_checkpoint_from_wrong_generation"]
    assert result.status == FAIL and "not older than itself" in result.detail, result.detail


def zombie(**changes) -> dict:
    report = {"phase": "put", "generation": 1, "step": 60, "outcome": "fenced", "fence_moved_to": 2,
              "new_start_step": 30, "manifest_before_put": 2, "manifest_after": 2, "deleted": []}
    return {**report, **changes}


def second_run(**changes) -> dict:
    fence = {"generation": 1, "run_id": "live", "history": [[0, 0, "live"], [1, 20, "live"]]}
    status = {"state": "running", "generation": 1, "step": 30, "run_id": "live", "pids": [7]}
    detail = {"acted_at": 12.0, "exit_code": 4, "timed_out": False, "elapsed_s": 3.2, "within_s": 120.0,
              "live_run": "live", "conflict_message": "storage in use: storage /x is in use by run live (...)",
              "output_tail": "", "fence_before": fence, "fence_after": copy.deepcopy(fence),
              "status_before": status, "status_after": {**status, "step": 31}, "summary_written": False,
              "first_run_went_on": {"ok": True}}
    return {**detail, **changes}


def intruded(*details: tuple[str, dict]) -> Verdict:
    ev = good()
    for n, (kind, detail) in enumerate(details):
        fault = {"kind": kind, "duration_s": 0.0}
        ev["history"].append({"t": 70.0 + n, "type": "invoke", "index": 10 + n, "fault": fault, "detail": detail,
                              "run": {"state": "running", "generation": 2}})
    return {v.name: v for v in check_all(Evidence(**ev))}["intruders_refused"]


def test_a_zombies_commit_must_be_refused_and_touch_nothing_newer():
    ok = intruded(("late_commit", {"zombie": zombie()}), ("late_commit", {"zombie": zombie(phase="check")}))
    assert ok.status == PASS, ok.detail
    assert intruded(("late_commit", {"zombie": zombie(outcome="no_fence_change")})).status == PASS  # inconclusive
    landed = zombie(outcome="landed", manifest_before_put=None, manifest_after=1)
    assert intruded(("late_commit", {"zombie": landed})).status == FAIL           # accepted by the history
    assert intruded(("late_commit", {"zombie": {**landed, "rejected_by_fence": "generation 1 ..."}})).status == PASS
    replaced = zombie(outcome="landed", manifest_after=1, rejected_by_fence="generation 1 ...")
    assert "replaced generation 2's" in intruded(("late_commit", {"zombie": replaced})).detail
    deleted = zombie(deleted=["/run/checkpoints/step_00000040/COMMITTED"])
    assert "deleted" in intruded(("late_commit", {"zombie": deleted})).detail
    own = zombie(deleted=["/run/checkpoints/step_00000060/g000001/__0_0.distcp"])
    assert intruded(("late_commit", {"zombie": own})).status == PASS
    assert intruded(("late_commit", {"zombie": zombie(outcome="error", error="boom")})).status == FAIL


def test_a_second_run_must_be_refused_naming_the_live_run_and_leave_the_first_alone():
    assert intruded(("second_run", second_run())).status == PASS
    for changes, words in [({"exit_code": 0}, "exited 0"),
                           ({"timed_out": True, "exit_code": -15}, "not refused"),
                           ({"conflict_message": None}, "no RunConflictError message"),
                           ({"conflict_message": "storage in use: by someone"}, "does not name the live run live"),
                           ({"fence_after": {"generation": 2, "run_id": "other", "history": []}}, "lease went from"),
                           ({"fence_after": {"generation": 2, "run_id": "live", "history": [
                               [0, 0, "live"], [1, 20, "live"], [2, 30, "other"]]}}, "took generation(s) [2]"),
                           ({"summary_written": True}, "summary.json was written"),
                           ({"status_after": {"run_id": "other"}}, "status.json went from run live to other"),
                           ({"first_run_went_on": {"ok": False, "why": "no new step"}}, "did not go on")]:
        result = intruded(("second_run", second_run(**changes)))
        assert result.status == FAIL and words in result.detail, (changes, result.detail)
    # The first run completed meanwhile, and the second rightly took the storage: nothing proven.
    taken_over = second_run(exit_code=0, conflict_message=None, first_run_finished=True,
                            fence_after={"generation": 2, "run_id": "other", "history": []})
    result = intruded(("second_run", taken_over))
    assert result.status == PASS and "inconclusive" in result.detail


def test_a_fault_that_reports_when_it_acted_is_matched_from_then():
    ev = good()
    late = {"kind": "late_commit", "duration_s": 0.0, "target": "one", "phase": "check", "within_s": 90.0}
    # Recorded at t=40, 25 s after its kill: the recovery detected at t=15.5 is still its own.
    ev["history"][2] = {"t": 40.0, "type": "invoke", "index": 0, "fault": late, "run": {"generation": 0, "step": 25},
                        "detail": {"ranks": [1], "acted_at": 15.0, "zombie": zombie(phase="check")}}
    ev["history"].sort(key=lambda e: e["t"])
    summary(ev)["recoveries"][0]["detected_at"] = 15.5
    result = {v.name: v for v in check_all(Evidence(**ev))}
    assert result["faults_recovered"].status == PASS, result["faults_recovered"].detail
    assert result["committed_steps_kept"].status == PASS
    del ev["history"][[e["t"] for e in ev["history"]].index(40.0)]["detail"]["acted_at"]
    assert verdicts(ev)["faults_recovered"] == FAIL


def _storage_stall_at(ev: dict, t: float, duration_s: float) -> None:
    ev["history"].append({"t": t, "type": "invoke", "index": 9,
                          "fault": {"kind": "storage_stall", "duration_s": duration_s, "kill": False},
                          "detail": {"stalling": "every request"}})


def test_a_hang_judged_while_storage_stalled_is_a_false_hang():
    ev = good()
    hang = {"cause": "hang", "rung": "warm", "detect_s": 10.0, "recover_s": 1.0, "lost_steps": 0,
            "from_world": 2, "to_world": 2, "step": 90, "generation": 3, "detected_at": 80.0,
            "recovered_at": 81.0, "failures": [{"cause": "hang", "ranks": [1], "detected_at": 80.0}]}
    summary(ev)["recoveries"].append(hang)
    _storage_stall_at(ev, 75.0, 20.0)
    assert verdicts(ev)["no_false_hang"] == FAIL
    ev = good()
    summary(ev)["recoveries"].append(hang)
    _storage_stall_at(ev, 10.0, 20.0)         # over (and a heartbeat timeout past it) before the hang
    assert verdicts(ev)["no_false_hang"] == PASS


def test_a_hang_within_a_storage_stall_of_a_rank_another_fault_hit_is_not_false():
    """G1: a node killed 3.8 s before its rank was judged hung (silent), inside a stall's window."""
    hang = {"cause": "hang", "rung": "warm", "detect_s": 3.8, "recover_s": 1.0, "lost_steps": 0,
            "from_world": 2, "to_world": 2, "step": 90, "generation": 3, "detected_at": 80.0,
            "recovered_at": 81.0, "failures": [{"cause": "hang", "ranks": [1], "detected_at": 80.0}]}

    def with_kill_node(ranks: list[int], at: float) -> dict:
        ev = good()
        summary(ev)["recoveries"].append(hang)
        _storage_stall_at(ev, 60.0, 15.0)
        ev["history"].append({"t": at, "type": "invoke", "index": 10,
                              "fault": {"kind": "kill_node", "duration_s": 0.0, "target": "one"},
                              "detail": {"nodes": ["n3"], "ranks": ranks}})
        ev["history"].sort(key=lambda e: e["t"])
        return ev

    assert verdicts(with_kill_node([1], 76.2))["no_false_hang"] == PASS
    assert verdicts(with_kill_node([0], 76.2))["no_false_hang"] == FAIL      # another rank was hit
    assert verdicts(with_kill_node([1], 40.0))["no_false_hang"] == FAIL      # long before: not its cause

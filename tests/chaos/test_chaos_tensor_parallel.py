"""The mixed-tp scenario and the TP degree's way to the job's command line (no Ray, no job started):
its job and its reference run carry `--tp 2` and whole replicas of workers, a layout that is not
whole replicas is refused, and model_matches_reference compares layouts, not world sizes alone."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from chaos import reference as reference_module
from chaos.__main__ import main
from chaos.faults import FAULT_TYPES
from chaos.history import History
from chaos.invariants import FAIL, PASS, SKIP, Evidence, layout_per_step, model_matches_reference
from chaos.job import JobSpec
from chaos.runner import RunOptions, job_spec
from chaos.scenarios import MIXED_MENU, NOT_IN_MIXED, SCENARIOS, Scenario, parse_workers
from chaos.schedule import fixed

pytestmark = pytest.mark.timeout(30)

TP = SCENARIOS["mixed-tp"]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def tp_options(tmp_path, **kw) -> RunOptions:
    return RunOptions(scenario=TP, seed=1, storage=str(tmp_path / "run"), out_dir=str(tmp_path / "out"), **kw)


def test_mixed_tp_is_two_replicas_of_two_ranks_and_a_spare_replica_on_mixeds_nodes():
    assert TP.tensor_parallel == 2
    low, high = parse_workers(TP.workers)
    assert low == high == 4                               # min == max: the layout stays DP 2 x TP 2
    assert low % 2 == high % 2 == TP.spare_workers % 2 == 0 and TP.spare_workers == 2
    mixed = SCENARIOS["mixed"]
    assert (TP.nodes, TP.namespaced, TP.model_size, TP.checkpoint_every, TP.heartbeat_timeout_s) == \
        (mixed.nodes, mixed.namespaced, mixed.model_size, mixed.checkpoint_every, mixed.heartbeat_timeout_s)
    # The six workers fit the nodes' CPUs, with one node's room left for a replacement.
    assert TP.cpus_per_worker is not None
    assert (high + TP.spare_workers) * TP.cpus_per_worker <= TP.nodes - 1


@pytest.mark.parametrize("seed", range(10))
def test_mixed_tp_has_mixeds_faults_and_a_user_error_on_any_of_its_ranks(seed):
    s, m = TP.schedule(seed), SCENARIOS["mixed"].schedule(seed)
    assert [e.to_dict() for e in s.entries] == [e.to_dict() for e in m.entries]
    assert set(s.kinds()) == set(FAULT_TYPES) - set(NOT_IN_MIXED)
    assert {e.fault.kind for e in s.entries[:len(MIXED_MENU)]} == set(FAULT_TYPES) - {"user_error", *NOT_IN_MIXED}
    user_error, = s.launch_faults
    assert user_error.rank == seed % 4 and user_error.step == 3 * TP.checkpoint_every


def test_mixed_and_mixed_fsdp_keep_their_user_error_ranks():
    for name in ("mixed", "mixed-fsdp"):
        assert [SCENARIOS[name].schedule(seed).launch_faults[0].rank for seed in range(6)] == [0, 1, 2, 0, 1, 2]


def test_the_job_command_carries_the_tp_layout(tmp_path):
    argv = job_spec(tp_options(tmp_path)).argv()
    assert flag(argv, "--tp") == "2"
    assert flag(argv, "--workers") == "4:4"
    assert flag(argv, "--spare-workers") == "2"
    assert flag(argv, "--cpus-per-worker") == "0.5"
    assert flag(argv, "--model-size") == "small" and "--strategy" not in argv     # ddp: the default


def test_a_job_without_tp_gets_none_of_the_tp_flags(tmp_path):
    argv = job_spec(dataclasses.replace(tp_options(tmp_path), scenario=SCENARIOS["mixed"])).argv()
    assert not {"--tp", "--spare-workers", "--cpus-per-worker"} & set(argv)
    assert flag(argv, "--workers") == "3:3"


def test_a_workers_override_must_be_whole_replicas(tmp_path):
    assert flag(job_spec(tp_options(tmp_path, workers="2:6")).argv(), "--workers") == "2:6"
    with pytest.raises(SystemExit, match="multiple of 2"):
        job_spec(tp_options(tmp_path, workers="3:3"))
    with pytest.raises(SystemExit, match="max 5"):
        job_spec(tp_options(tmp_path, workers="4:5"))


def test_the_cli_refuses_a_workers_override_that_splits_a_replica(tmp_path, capsys):
    code = main(["run", "mixed-tp", "--seed", "1", "--storage", str(tmp_path / "run"), "--workers", "3:3",
                 "--out", str(tmp_path / "out"), "--reference", "none"])
    assert code == 2
    assert "multiple of 2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()            # refused before anything ran


def test_a_scenario_must_be_whole_replicas():
    def build(sc, seed):
        return fixed([], seed=seed)
    with pytest.raises(ValueError, match="min 3, max 3"):
        Scenario(name="bad", description="", build=build, steps=10, workers="3:3", tensor_parallel=2)
    with pytest.raises(ValueError, match="spare 1"):
        Scenario(name="bad", description="", build=build, steps=10, workers="4:4", tensor_parallel=2, spare_workers=1)


def test_the_reference_run_gets_the_same_layout(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(reference_module.JobProcess, "start", lambda self: started.append(self) or self)
    spec = job_spec(tp_options(tmp_path)).replace(fail_at=(1, 60))
    history = History()
    (tmp_path / "out").mkdir()
    ref = reference_module.start_reference(spec, "auto", None, str(tmp_path / "out"), history)
    assert ref is not None and started
    try:
        mine, theirs = spec.argv(), ref.job.spec.argv()
        assert flag(theirs, "--storage") == reference_module.reference_url(spec.storage)
        for name in ("--tp", "--workers", "--spare-workers", "--cpus-per-worker", "--model-size", "--steps", "--seed",
                     "--checkpoint-every", "--heartbeat-timeout"):
            assert flag(theirs, name) == flag(mine, name), name
        assert "--fail-at" not in theirs                 # no faults: not the user error either
        recorded, = history.events
        assert flag(recorded["argv"], "--tp") == "2"
    finally:
        reference_module.shutil.rmtree(ref.ray_tmp, ignore_errors=True)


def test_a_reference_of_another_tp_degree_is_not_reused():
    spec = JobSpec(storage="unused", workers="4:4", tp=2, spare_workers=2)
    identity = spec.identity()
    assert identity["tp"] == 2 and identity["spare_workers"] == 2
    assert spec.replace(tp=1).identity() != identity and spec.replace(tp=4).identity() != identity


# ---- model_matches_reference on layouts ----------------------------------------------------------
def tp_summary(sha: str, worlds: list[list[int]], tp: int | None) -> dict:
    s = {"status": "finished", "final_step": 100, "model_sha256": sha, "world_size_history": worlds}
    if tp is not None:
        s["layout_history"] = [[start, {"dp": world // tp, "tp": tp, "pp": 1}] for start, world in worlds]
    return s


def evidence(run: dict, ref: dict) -> Evidence:
    return Evidence(history=[], attempts=[{"summary": run}], total_steps=100, heartbeat_timeout_s=10.0,
                    reference={"summary": ref})


def test_layouts_per_step_follow_the_generations_and_rollbacks():
    s = tp_summary("a", [[0, 4], [40, 4], [30, 4]], tp=2)
    assert layout_per_step([s]) == {step: (4, 2, 1) for step in range(1, 101)}
    assert layout_per_step([tp_summary("a", [[0, 4]], tp=None)]) == {step: (4, 1, 1) for step in range(1, 101)}


def test_the_model_is_compared_for_the_same_layout_and_a_tp_run_keeps_the_guarantee():
    ref = tp_summary("abc", [[0, 4]], tp=2)
    assert model_matches_reference(evidence(tp_summary("abc", [[0, 4], [40, 4], [30, 4]], tp=2), ref)).status == PASS
    verdict = model_matches_reference(evidence(tp_summary("other", [[0, 4], [40, 4]], tp=2), ref))
    assert verdict.status == FAIL


def test_equal_world_sizes_of_another_tp_degree_are_not_the_same_run():
    # DP 4 x TP 1 and DP 2 x TP 2 have the same world size and no common determinism guarantee.
    verdict = model_matches_reference(evidence(tp_summary("other", [[0, 4]], tp=1), tp_summary("abc", [[0, 4]], tp=2)))
    assert verdict.status == SKIP and "TP degree" in verdict.detail
    run = copy.deepcopy(tp_summary("abc", [[0, 4]], tp=2))
    run["layout_history"] = []                      # a summary without layouts: TP 1
    assert model_matches_reference(evidence(run, tp_summary("abc", [[0, 4]], tp=2))).status == SKIP

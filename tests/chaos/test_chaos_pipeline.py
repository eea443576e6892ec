"""The mixed-pp scenario and the PP degree's way to the job's command line (no Ray cluster, no job
started): its job and its reference run carry `--pp 2` and whole pipelines of workers, a layout
that is not whole pipelines (of T x P ranks) is refused, and model_matches_reference compares
layouts with their PP degree, not world sizes and TP degrees alone."""
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
from chaos.scenarios import MIXED_MENU, NOT_IN_MIXED, SCENARIOS, Scenario, check_workers, parse_workers
from chaos.schedule import fixed

pytestmark = pytest.mark.timeout(60)

PP = SCENARIOS["mixed-pp"]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def pp_options(tmp_path, **kw) -> RunOptions:
    return RunOptions(scenario=PP, seed=1, storage=str(tmp_path / "run"), out_dir=str(tmp_path / "out"), **kw)


def test_mixed_pp_is_two_pipelines_of_two_stages_and_a_spare_pipeline_on_mixeds_nodes():
    assert (PP.pipeline_parallel, PP.tensor_parallel) == (2, 1)
    low, high = parse_workers(PP.workers)
    assert low == high == 4                               # min == max: the layout stays DP 2 x PP 2
    assert low % 2 == high % 2 == PP.spare_workers % 2 == 0 and PP.spare_workers == 2
    mixed = SCENARIOS["mixed"]
    assert (PP.nodes, PP.namespaced, PP.model_size, PP.checkpoint_every, PP.heartbeat_timeout_s, PP.strategy) == \
        (mixed.nodes, mixed.namespaced, mixed.model_size, mixed.checkpoint_every, mixed.heartbeat_timeout_s, "ddp")
    # The six workers fit the nodes' CPUs, with one node's room left for a replacement.
    assert PP.cpus_per_worker is not None
    assert (high + PP.spare_workers) * PP.cpus_per_worker <= PP.nodes - 1


@pytest.mark.parametrize("seed", range(10))
def test_mixed_pp_has_mixeds_faults_and_a_user_error_on_any_of_its_ranks(seed):
    s, m = PP.schedule(seed), SCENARIOS["mixed"].schedule(seed)
    assert [e.to_dict() for e in s.entries] == [e.to_dict() for e in m.entries]
    assert set(s.kinds()) == set(FAULT_TYPES) - set(NOT_IN_MIXED)
    assert {e.fault.kind for e in s.entries[:len(MIXED_MENU)]} == set(FAULT_TYPES) - {"user_error", *NOT_IN_MIXED}
    user_error, = s.launch_faults
    # Any rank of the four: a first stage's as well as a last stage's.
    assert user_error.rank == seed % 4 and user_error.step == 3 * PP.checkpoint_every


def test_the_job_command_carries_the_pp_layout(tmp_path):
    argv = job_spec(pp_options(tmp_path)).argv()
    assert flag(argv, "--pp") == "2" and "--tp" not in argv
    assert flag(argv, "--workers") == "4:4"
    assert flag(argv, "--spare-workers") == "2"
    assert flag(argv, "--cpus-per-worker") == "0.5"
    assert flag(argv, "--model-size") == "small" and "--strategy" not in argv     # ddp: the default


def test_the_main_job_takes_the_command_and_splits_the_small_model_in_two_stages(tmp_path):
    # The flags as examples/pretrain.py parses them (no Ray started): P = 2 pipelines of whole
    # ranks, and the small model's 4 blocks cut 2 per stage.
    import gpt
    import pretrain
    args = pretrain.parse_args(job_spec(pp_options(tmp_path)).argv()[2:])
    scaling = pretrain.scaling_config(args)
    assert (scaling.pipeline_parallel_size, scaling.tensor_parallel_size) == (2, 1)
    assert (scaling.min_workers, scaling.max_workers, scaling.spare_workers) == (4, 4, 2)
    cfg = pretrain.model_config(args)
    assert cfg.n_layers == 4 and gpt.pipeline_split_points(cfg, args.pp) == ["blocks.2"]


@pytest.mark.parametrize("name", ["mixed", "mixed-tp"])
def test_a_job_without_pp_gets_no_pp_flag(tmp_path, name):
    argv = job_spec(dataclasses.replace(pp_options(tmp_path), scenario=SCENARIOS[name])).argv()
    assert "--pp" not in argv


def test_a_workers_override_must_be_whole_pipelines(tmp_path):
    assert flag(job_spec(pp_options(tmp_path, workers="2:6")).argv(), "--workers") == "2:6"
    with pytest.raises(SystemExit, match="--pp 2 the workers come in replicas of 2 ranks; min 3, max 3"):
        job_spec(pp_options(tmp_path, workers="3:3"))
    with pytest.raises(SystemExit, match="max 5"):
        job_spec(pp_options(tmp_path, workers="4:5"))


def test_the_cli_refuses_a_workers_override_that_splits_a_pipeline(tmp_path, capsys):
    code = main(["run", "mixed-pp", "--seed", "1", "--storage", str(tmp_path / "run"), "--workers", "3:3",
                 "--out", str(tmp_path / "out"), "--reference", "none"])
    assert code == 2
    assert "multiple of 2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()            # refused before anything ran


def test_the_cli_lists_the_pp_degree(capsys):
    assert main(["list"]) == 0
    line, = (x for x in capsys.readouterr().out.splitlines() if x.startswith("mixed-pp "))
    assert "pp 2" in line and "tp " not in line and "spares 2" in line


def test_a_scenario_must_be_whole_pipelines_of_tp_x_pp_ranks():
    def build(sc, seed):
        return fixed([], seed=seed)
    with pytest.raises(ValueError, match="min 3, max 3"):
        Scenario(name="bad", description="", build=build, steps=10, workers="3:3", pipeline_parallel=2)
    with pytest.raises(ValueError, match="spare 1"):
        Scenario(name="bad", description="", build=build, steps=10, workers="4:4", pipeline_parallel=2,
                 spare_workers=1)
    # TP 2 x PP 2: a replica is 4 ranks; 6 is whole TP replicas but not whole pipelines.
    with pytest.raises(ValueError, match="--tp 2 --pp 2 the workers come in replicas of 4 ranks; min 6, max 6"):
        Scenario(name="bad", description="", build=build, steps=10, workers="6:6", tensor_parallel=2,
                 pipeline_parallel=2)
    Scenario(name="good", description="", build=build, steps=10, workers="4:8", tensor_parallel=2,
             pipeline_parallel=2, spare_workers=4)
    with pytest.raises(ValueError, match="pipeline_parallel must be at least 1, not 0"):
        check_workers("4:4", 1, pp=0, what="x")


def test_the_reference_run_gets_the_same_layout(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(reference_module.JobProcess, "start", lambda self: started.append(self) or self)
    spec = job_spec(pp_options(tmp_path)).replace(fail_at=(1, 60))
    history = History()
    (tmp_path / "out").mkdir()
    ref = reference_module.start_reference(spec, "auto", None, str(tmp_path / "out"), history)
    assert ref is not None and started
    try:
        mine, theirs = spec.argv(), ref.job.spec.argv()
        assert flag(theirs, "--storage") == reference_module.reference_url(spec.storage)
        for name in ("--pp", "--workers", "--spare-workers", "--cpus-per-worker", "--model-size", "--steps", "--seed",
                     "--checkpoint-every", "--heartbeat-timeout"):
            assert flag(theirs, name) == flag(mine, name), name
        assert "--fail-at" not in theirs                 # no faults: not the user error either
        recorded, = history.events
        assert flag(recorded["argv"], "--pp") == "2"
    finally:
        reference_module.shutil.rmtree(ref.ray_tmp, ignore_errors=True)


def test_a_reference_of_another_pp_degree_is_not_reused():
    spec = JobSpec(storage="unused", workers="4:4", pp=2, spare_workers=2)
    identity = spec.identity()
    assert identity["pp"] == 2 and identity["spare_workers"] == 2
    assert spec.replace(pp=1).identity() != identity and spec.replace(pp=4).identity() != identity
    assert spec.replace(pp=1, tp=2).identity() != identity      # the same replica size, another layout


# ---- model_matches_reference on layouts with a PP degree -----------------------------------------
def pp_summary(sha: str, worlds: list[list[int]], pp: int | None, tp: int = 1) -> dict:
    s = {"status": "finished", "final_step": 100, "model_sha256": sha, "world_size_history": worlds}
    if pp is not None:
        s["layout_history"] = [[start, {"dp": world // (tp * pp), "tp": tp, "pp": pp}] for start, world in worlds]
    return s


def evidence(run: dict, ref: dict) -> Evidence:
    return Evidence(history=[], attempts=[{"summary": run}], total_steps=100, heartbeat_timeout_s=10.0,
                    reference={"summary": ref})


def test_layouts_per_step_carry_the_pp_degree_through_generations_and_rollbacks():
    s = pp_summary("a", [[0, 4], [40, 4], [30, 4]], pp=2)
    assert layout_per_step([s]) == {step: (4, 1, 2) for step in range(1, 101)}
    assert layout_per_step([pp_summary("a", [[0, 8]], pp=2, tp=2)]) == {step: (8, 2, 2) for step in range(1, 101)}
    assert layout_per_step([pp_summary("a", [[0, 4]], pp=None)]) == {step: (4, 1, 1) for step in range(1, 101)}
    # A layout without "pp" (a summary from before pipelines) is PP 1; a generation restored at
    # another P from a checkpoint owns the steps after its start.
    older = pp_summary("a", [[0, 4]], pp=1)
    del older["layout_history"][0][1]["pp"]
    assert set(layout_per_step([older]).values()) == {(4, 1, 1)}
    s = pp_summary("a", [[0, 4], [60, 4]], pp=2)
    s["layout_history"][1][1].update(pp=1, dp=4)
    assert layout_per_step([s]) == {**{step: (4, 1, 2) for step in range(1, 61)},
                                    **{step: (4, 1, 1) for step in range(61, 101)}}


def test_the_model_is_compared_for_the_same_layout_and_a_pp_run_keeps_the_guarantee():
    ref = pp_summary("abc", [[0, 4]], pp=2)
    assert model_matches_reference(evidence(pp_summary("abc", [[0, 4], [40, 4], [30, 4]], pp=2), ref)).status == PASS
    assert model_matches_reference(evidence(pp_summary("other", [[0, 4], [40, 4]], pp=2), ref)).status == FAIL


def test_equal_world_sizes_and_tp_degrees_of_another_pp_degree_are_not_the_same_run():
    # DP 4 and DP 2 x PP 2 (or DP 1 x TP 2 x PP 2 and DP 2 x TP 2) have the same world size and no
    # common determinism guarantee.
    verdict = model_matches_reference(evidence(pp_summary("other", [[0, 4]], pp=1), pp_summary("abc", [[0, 4]], pp=2)))
    assert verdict.status == SKIP and "PP degree" in verdict.detail
    verdict = model_matches_reference(evidence(pp_summary("other", [[0, 4]], pp=2, tp=2),
                                               pp_summary("abc", [[0, 4]], pp=1, tp=2)))
    assert verdict.status == SKIP
    run = copy.deepcopy(pp_summary("abc", [[0, 4]], pp=2))
    run["layout_history"] = []                      # a summary without layouts: TP 1, PP 1
    assert model_matches_reference(evidence(run, pp_summary("abc", [[0, 4]], pp=2))).status == SKIP
    # A PP 2 generation in the middle of a run whose reference stayed PP 1: not comparable.
    mixed = pp_summary("abc", [[0, 4], [40, 4], [70, 4]], pp=1)
    mixed["layout_history"][1][1].update(pp=2, dp=2)
    assert model_matches_reference(evidence(mixed, pp_summary("abc", [[0, 4]], pp=1))).status == SKIP

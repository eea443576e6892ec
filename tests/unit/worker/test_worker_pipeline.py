"""Pipeline parallelism inside data-parallel replicas, on real TrainContexts of 4 gloo processes
(no Ray): each schedule against one process training the whole model on the global batch, the
stages' stable parameter names, the warm rung moving each stage from the same stage of a
surviving pipeline, and the whole model's hash gathered over the stages."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "ckpt"))
import pp_ranks

from ckpt_ranks import run_ranks
from elastic._determinism import state_sha256


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def _check_against_reference(results: list[dict], *, pp: int, tp: int = 1, dp: int = 2) -> None:
    ref = pp_ranks.reference(pp_ranks.STEPS, dp=dp)
    assert min(ref["norms"]) > pp_ranks.MAX_NORM        # every step clipped
    unit = pp * tp
    held: dict[str, list] = {}
    for rank, result in enumerate(results):
        # ctx.clip_grad_norm_: the whole model's global norm on every stage of every replica.
        assert _close(result["norms"], ref["norms"]), f"rank {rank}: {result['norms']} vs {ref['norms']}"
        place = result["place"]
        assert (place["dp_rank"], place["pp_rank"], place["tp_rank"]) == (rank // unit, rank // tp % pp, rank % tp)
        for name, values in result["params"].items():
            assert _close(values, ref["params"][name]), f"rank {rank}: {name} differs from the whole model's run"
            held[name] = values
        assert result["lr"] == pytest.approx(1e-2 * dp)
    # Together the stages hold the whole model, each parameter under its whole-model name.
    assert sorted(held) == sorted(ref["params"])
    # A replica's loss is its last stage's; metrics.jsonl's loss the mean over the replicas.
    last = [results[d * unit + (pp - 1) * tp]["losses"] for d in range(dp)]
    means = [sum(step) / dp for step in zip(*last, strict=True)]
    assert _close(means, ref["losses"])
    assert results[0]["records"], "no step record was kept"
    for step, loss in results[0]["records"]:
        assert loss == pytest.approx(means[step - 1], rel=1e-6), f"step {step}"


CASES = [{"strategy": "ddp", "schedule": "1f1b", "warm": True},
         {"strategy": "fsdp", "schedule": "gpipe"},
         {"strategy": "ddp", "schedule": "interleaved1f1b"},
         {"strategy": "ddp", "schedule": "1f1b", "tp": 2, "dp": 1}]


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """Every rank program, in turn, on one start of 4 gloo processes (a start is most of each
    program's time on 2 cores): results per program, one entry per rank."""
    cases = [{k: v for k, v in case.items() if k != "dp"} for case in CASES]
    storage = str(tmp_path_factory.mktemp("pp_ckpt") / "ckpt")
    per_rank = run_ranks("pp_ranks:all_programs", 4, timeout=280, cases=cases, storage=storage)
    return {name: [per_rank[rank][name] for rank in range(4)] for name in per_rank[0]}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_each_schedule_trains_as_the_whole_model_and_a_new_pipeline_restores_warm_per_stage(programs):
    one_f, fsdp, interleaved, tp = ([programs["layouts"][rank][i] for rank in range(4)] for i in range(len(CASES)))

    assert one_f[0]["place"]["mesh"] == ["dp_replicate", "pp", "tp"]
    _check_against_reference(one_f, pp=2)
    # Stage 0 holds inp and blocks 0-1, stage 1 blocks 2-3 and out, under the whole model's names.
    assert one_f[0]["names"] == sorted(n for n in pp_ranks.reference(0, 1)["params"]
                                       if n.startswith(("inp.", "blocks.0.", "blocks.1.")))
    assert all(n.startswith(("blocks.2.", "blocks.3.", "out.")) for n in one_f[1]["names"])
    for rank, result in enumerate(one_f):
        assert result["restored"] == pp_ranks.STEPS
        # Each stage of the new pipeline holds what the same stage of the survivor held ...
        assert result["restored_params"] == one_f[rank % 2]["params"], f"rank {rank} got another stage"
        # ... and the group trains on as one model.
        assert result["next_params"] == one_f[rank % 2]["next_params"]
        # The loss is the last stage's, shared with every stage of the pipeline.
        assert result["next_losses"] == one_f[rank - rank % 2 + 1]["next_losses"] and result["next_losses"][0] > 0
    # What the hang judge sees of a pipeline step: every rank waits for a neighbouring stage in
    # the schedule's send/recv (PIPELINE), then in its gradient reduce and the stages' agreement
    # (SYNC), before the boundary's exchange.
    for case, results in zip(CASES, (one_f, fsdp, interleaved, tp), strict=True):
        for rank, result in enumerate(results):
            step = result["places"][result["places"].index("computing"):]
            step = step[:step.index("exchange") + 1]
            stages = 2 if case["schedule"] == "interleaved1f1b" else 1      # one reduce per stage
            assert "pipeline" in step and step[-2:] == ["sync", "exchange"], (case, rank, step)
            assert step.count("sync") == stages + 1, (case, rank, step)
    assert fsdp[0]["place"]["mesh"] == ["dp_shard", "pp", "tp"]
    _check_against_reference(fsdp, pp=2)
    # Interleaved: each rank runs two of the four stages (rank 0: stages 0 and 2).
    _check_against_reference(interleaved, pp=2)
    assert any(n.startswith("blocks.2.") for n in interleaved[0]["names"])
    assert any(n.startswith("inp.") for n in interleaved[0]["names"])
    # PP 2 x TP 2: one pipeline of two stages, each on two TP ranks.
    _check_against_reference(tp, pp=2, tp=2, dp=1)
    # The run's model hash (rank 0) is of the whole model: every stage's parameters, gathered.
    for results, unit in ((fsdp, 2), (interleaved, 2), (tp, 4)):
        whole = {n: torch.tensor(v, dtype=torch.float32) for r in results[:unit] for n, v in r["params"].items()}
        assert results[0]["hash"] == state_sha256(whole)
        assert all(r["hash"] is None for r in results[1:])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_checkpoint_moves_between_pipeline_degrees_with_each_parameters_optimizer_state(programs):
    """P 1 -> 2 -> 2 -> 1 through checkpoints (the stages' optimizer states are saved flattened,
    by parameter name, so no stage's param groups overwrite another's): every parameter comes
    back in its own param group's values with its own momentum buffer."""
    p1, p2, again, back = ([programs["repartition"][rank][i] for rank in range(4)] for i in range(4))
    saved = p1[0]["trained"]                           # P 1: every rank holds the whole model
    assert all(r["trained"] == saved for r in p1)
    # P 2: each stage's ranks (0, 2: stage 0; 1, 3: stage 1) restored their own parameters' state.
    for rank, result in enumerate(p2):
        assert result["restored"] and set(result["restored"]) < set(saved)
        assert result["restored"] == {n: saved[n] for n in result["restored"]}, f"rank {rank}"
    assert set(p2[0]["restored"]) | set(p2[1]["restored"]) == set(saved)
    assert {n: v[:3] for n, v in saved.items()} == {
        n: ([1.0, 0.0, 0.9] if n.startswith("blocks.") else [2.0, 0.01, 0.9]) for n in saved}
    # P 2 -> 2: each stage restores what it saved.
    for rank, result in enumerate(again):
        assert result["restored"] == p2[rank]["trained"], f"rank {rank}"
    # Back at P 1, from a P 2 checkpoint: the whole model's state is the two stages' together.
    stages = {**again[0]["trained"], **again[1]["trained"]}
    assert all(r["restored"] == stages for r in back)
    assert [r["step"] for r in (p1[0], p2[0], again[0], back[0])] == [2, 3, 4, 4]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fsdp_stages_rebuild_a_lost_pipeline_from_the_copies_in_memory(programs):
    """FSDP x PP: each rank's copy rings within its stage (rank r keeps r - 2's, the same stage of
    the other pipeline), and a new pipeline's stages are rebuilt from the survivors' copies."""
    results = programs["memory"]
    assert [r["held"] for r in results] == [[0, 2], [1, 3], [2, 0], [3, 1]]
    for rank, result in enumerate(results):
        assert result["restored"] == 2
        assert result["holders"] == [0, 1, 0, 1]       # old ranks 2, 3's copies: held by 0, 1
        # Every rank holds exactly the stage its place held before (FSDP gathers the full tensors).
        assert result["after"] == results[rank]["before"], f"rank {rank} got another state"
        assert result["next"] == results[rank % 2]["next"]

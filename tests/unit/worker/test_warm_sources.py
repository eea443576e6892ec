"""The warm rung from many sources (elastic._worker.warm_slices): the byte slices, the
controller's choice of sources, and real transfers on 4 gloo processes (no Ray): receivers end
with the sources' state bitwise, in place, sources untouched and sending in place."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from elastic._controller.forming import GenerationFormer
from elastic._protocol import RestoreKind, RestorePlan, WorkerPhase, WorkerReport
from elastic._worker.warm_slices import Piece, cut_slices
from elastic.config import FailureConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "ckpt"))
from ckpt_ranks import run_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("sizes", [[10], [3, 0, 7, 1], [100, 1, 1], [0, 0], [5, 5, 5, 5]])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_slices_cover_every_byte_once_and_none_exceeds_its_share(sizes, parts):
    slices = cut_slices(sizes, parts)
    assert len(slices) == parts
    covered = {slot: [0] * size for slot, size in enumerate(sizes)}
    total = sum(sizes)
    for pieces in slices:
        assert sum(p.end - p.start for p in pieces) <= -(-total // parts)
        for p in pieces:
            assert 0 <= p.start < p.end <= sizes[p.slot]
            for b in range(p.start, p.end):
                covered[p.slot][b] += 1
    assert all(c == 1 for counts in covered.values() for c in counts)


def test_a_tensor_larger_than_a_slice_is_cut_across_sources():
    assert cut_slices([2, 12, 2], 2) == [[Piece(0, 0, 2), Piece(1, 0, 6)], [Piece(1, 6, 12), Piece(2, 0, 2)]]


def _report(step: int, has_state: bool) -> WorkerReport:
    return WorkerReport(phase=WorkerPhase.INTERRUPTED, generation=1, rank=0, step=step, has_state=has_state,
                        records=[])


def _former() -> GenerationFormer:
    # reform_plan's warm branch reads only its arguments (no storage call before it answers).
    return GenerationFormer(None, None, None, failure=FailureConfig(), clock=time.monotonic)  # type: ignore[arg-type]


def test_every_member_holding_the_newest_step_is_a_source_and_an_older_one_receives():
    settled = {10: _report(11, True), 11: _report(10, True), 12: _report(11, True), 13: _report(0, False)}
    ok, plan = _former().reform_plan([10, 11, 12, 13], settled)
    assert ok and isinstance(plan, RestorePlan) and plan.kind == RestoreKind.BROADCAST
    assert plan.sources == (0, 2) and plan.source_rank == 0 and plan.step == 11
    assert plan.warm_sources == (0, 2)


def test_a_plan_without_sources_means_its_source_rank_alone():
    assert RestorePlan("broadcast", source_rank=2).warm_sources == (2,)
    assert RestorePlan("fresh").warm_sources == ()


CASES = {"two_sources": ([0, 2], 1000), "one_source": ([1], 1000), "three_sources_big_tensor": ([0, 1, 2], 50_000),
         "tiny_state": ([3, 1], 1)}
EXACT = "('optimizer', 'state', 0, 'exp_avg')"     # the transposed Adam moment: not contiguous


# One start of 4 gloo processes runs every case in turn (a test each would start them again,
# and under xdist a module fixture starts once per worker).
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_transfers_on_four_ranks():
    cases = [{"sources": sources, "big": big} for sources, big in CASES.values()]
    cases.append({"sources": [0, 1], "big": 100, "partial_template": True})
    results = run_ranks("warm_ranks:transfers", 4, timeout=240, cases=cases)
    by_case = [[results[rank][i] for rank in range(4)] for i in range(len(cases) + 1)]
    for (sources, big), case in zip(CASES.values(), by_case, strict=False):
        _receivers_end_with_the_sources_state_bitwise_in_place(sources, big, case)
    _a_receiver_whose_template_lacks_a_tensor_gets_it_in_a_buffer(by_case[-2])
    _sources_that_disagree_fail_on_every_rank_without_a_hang(by_case[-1])


def _receivers_end_with_the_sources_state_bitwise_in_place(sources, big, results):
    truth = results[0]["truth"]
    nbytes = results[next(r for r in range(4) if r not in sources)]["nbytes"]
    slice_bytes = -(-sum(nbytes.values()) // len(sources))
    if len(sources) > 1 and big > 1:
        assert nbytes["('model', 'big')"] > slice_bytes      # this tensor is cut across sources
    for rank, result in enumerate(results):
        assert result["digest"] == truth, f"sources {sources}: rank {rank} differs from the sources' state"
        if rank in sources:
            # A source sends its own tensors: it gets them back, unchanged, and stages only the
            # one that is not contiguous.
            assert result["same_object"] and result["untouched"]
            assert result["extra_bytes"] == nbytes[EXACT]
        else:
            assert result["plain"] == result["truth_plain"]      # the plain values are the source's
            # Everything lands in the template's own tensors; the transposed one is received into
            # a buffer and copied in.
            assert len(result["in_place"]) == len(truth)
            assert result["extra_bytes"] == nbytes[EXACT] <= slice_bytes


def _a_receiver_whose_template_lacks_a_tensor_gets_it_in_a_buffer(results):
    for receiver in results[2:]:
        assert receiver["digest"] == results[0]["truth"] and receiver["plain"] == receiver["truth_plain"]
        counter = [p for p in receiver["nbytes"] if p.startswith("('counter'")]
        assert not set(counter) & set(receiver["in_place"])
        assert receiver["extra_bytes"] == sum(receiver["nbytes"][p] for p in counter) + receiver["nbytes"][EXACT]


def _sources_that_disagree_fail_on_every_rank_without_a_hang(results):
    assert [r["error"] for r in results] == ["StateError"] * 4
    assert all("warm source 1 holds" in r["message"] for r in results)
    assert "bias" in results[1]["message"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_ddp_generation_restores_warm_from_its_survivors_bitwise():
    """Two of four, one of four, and all four ranks hold the state (one start for the three)."""
    cases = {"two_of_four": [0, 2], "one_of_four": [1], "all_four": [0, 1, 2, 3]}
    results = run_ranks("warm_ranks:warm_restores", 4, timeout=240, cases=list(cases.values()), steps=3)
    for i, name in enumerate(cases):
        truth = results[0][i]["before"]
        for rank in range(4):
            result = results[rank][i]
            assert result["before"] == truth          # DDP: every rank held the same state
            assert result["restored"] == 3
            assert result["after"] == truth, f"{name}: rank {rank}'s restored state differs from the survivors'"
        # ... and they train on in lockstep.
        assert len({repr(sorted(results[rank][i]["next"].items())) for rank in range(4)}) == 1, name
        assert len({(results[rank][i]["samples"], results[rank][i]["lr"]) for rank in range(4)}) == 1, name

"""The compute spot check (elastic._worker.spot_check): its verdict on one table, and on 3 real
gloo ranks under DDP, that a check changes nothing of the training and that a wrong gradient on
one rank, which the all-reduce hands to every replica, is found at the next check and its rank
named."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "ckpt"))
from ckpt_ranks import run_ranks
from elastic._worker import fingerprint
from elastic._worker.spot_check import SPOT_RTOL, agreeing_classes, surrogate_loss


def _row(lo: float, hi: float, *stats: float) -> list[float]:
    return [lo, hi, 0.0, 1.0, *stats]


def test_exact_rows_agree_only_on_equal_fingerprints_and_the_majority_names_the_odd_rank():
    table = torch.tensor([_row(1, 2, 5.0), _row(1, 2, 5.0), _row(7, 2, 5.0)], dtype=torch.float64)
    verdict = fingerprint.judge(agreeing_classes(table, exact=True), 1, 10)
    assert verdict is not None and verdict.named == (2,) and verdict.suspects == ()
    # Two ranks that disagree: no majority, both are suspects.
    verdict = fingerprint.judge(agreeing_classes(table[1:], exact=True), 1, 10)
    assert verdict is not None and verdict.named == () and verdict.suspects == (0, 1)
    assert fingerprint.judge(agreeing_classes(table[:2], exact=True), 1, 10) is None


def test_tolerant_rows_agree_within_the_relative_tolerance_only():
    base = _row(1, 2, 100.0, 4.0, 0.5)
    near = _row(3, 4, 100.0 * (1 + SPOT_RTOL / 2), 4.0, 0.5)      # other bits, same values to tolerance
    far = _row(1, 2, 100.0 * (1 + 10 * SPOT_RTOL), 4.0, 0.5)
    table = torch.tensor([base, near, far, base], dtype=torch.float64)
    verdict = fingerprint.judge(agreeing_classes(table, exact=False), 1, 3)
    assert verdict is not None and verdict.named == (2,)


def test_the_surrogate_loss_reaches_every_floating_output_and_refuses_none():
    a = torch.ones(2, requires_grad=True)
    b = torch.full((3,), 2.0, requires_grad=True)
    loss = surrogate_loss({"logits": a * 3, "aux": (b, torch.arange(3))})
    ga, gb = torch.autograd.grad(loss, [a, b])
    assert torch.allclose(ga, torch.full((2,), 9.0)) and torch.allclose(gb, torch.full((3,), 4.0 / 3))
    with pytest.raises(TypeError, match="spot_check_every_n_steps=None"):
        surrogate_loss(torch.arange(3))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_checks_change_nothing_and_a_wrong_gradient_is_found_at_the_next_check(tmp_path):
    results = run_ranks("spot_ranks:cases", 3, timeout=160, marker=str(tmp_path / "bad-gradient.fired"))
    for rank, result in enumerate(results):
        checked, unchecked, bad = result["checked"], result["unchecked"], result["bad"]
        # Clean: every check passed, and training is bit for bit what it is without them (the
        # recompute draws no dropout mask from the training RNG, moves no batch-norm statistic
        # and leaves the gradients alone).
        assert checked["error"] is None and checked["step"] == 6 and checked["verified"] == 6
        assert unchecked["error"] is None and unchecked["verified"] == 0
        assert checked["params"] == unchecked["params"], f"rank {rank}: the spot check changed the training"
        assert checked["buffers"] == unchecked["buffers"], f"rank {rank}: the spot check moved batch norm's statistics"
        assert checked["params"] == results[0]["checked"]["params"]
        # Rank 1's gradient goes wrong from step 3: its parameters still agree with the others'
        # (the all-reduce shares the error), and the check at step 4 names it; the run must go
        # back to before step 3 (the check at 2 passed).
        assert bad["error"] is not None, f"rank {rank}: the wrong gradient went unseen"
        assert bad["error"]["step"] == 4 and bad["error"]["ranks"] == [1] and bad["error"]["suspects"] == []
        assert bad["error"]["since"] == 3 and bad["verified"] == 2
        assert "in compute at step 4" in bad["error"]["message"]


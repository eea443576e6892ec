"""The parameters' fingerprint and the replicas' verdict (elastic/_worker/fingerprint.py): one
flipped bit anywhere changes it, the same parameters give the same value whatever their order of
summation, and the verdict names the rank a majority of its replicas disagrees with, or every
holder of a position without one."""
from __future__ import annotations

import pytest
import torch

from elastic._worker.fingerprint import Verdict, fingerprint, halves, judge

pytestmark = pytest.mark.timeout(30)


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Sizes of whole 8-byte words (read as int64 words) and not (the last bytes one by one).
    return [torch.randn(17, 5, generator=g), torch.randn(33, generator=g).to(torch.bfloat16),
            torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(16, 4, generator=g), torch.empty(0)]


def test_every_single_bit_flip_changes_the_fingerprint():
    params = _params()
    clean = int(fingerprint(params))
    for index, tensor in enumerate(params[:4]):
        bits = tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
        for element in (0, tensor.numel() // 2, tensor.numel() - 1):
            for bit in range(tensor.element_size() * 8):
                flat = bits.view(-1)
                before = flat[element].clone()
                flat[element] ^= (1 << bit) if bit < 63 else -(1 << 63)
                assert int(fingerprint(params)) != clean, (index, element, bit)
                flat[element] = before
    assert int(fingerprint(params)) == clean


def test_equal_parameters_agree_and_a_value_moved_between_tensors_does_not():
    a, b = _params(1), _params(1)
    assert int(fingerprint(a)) == int(fingerprint(b))
    # The same values in a non-contiguous layout: the bits, not the layout, are folded.
    assert int(fingerprint([a[0].t().contiguous().t()] + a[1:])) == int(fingerprint(a))
    # Two tensors' contents swapped (same shapes): per-tensor multipliers tell them apart.
    x, y = torch.randn(8), torch.randn(8)
    assert int(fingerprint([x, y])) != int(fingerprint([y, x]))
    assert fingerprint([torch.empty(0)]) is None


def test_the_halves_are_exact_in_float64():
    value = torch.tensor(-(1 << 63) + 12345, dtype=torch.int64)
    lo, hi = halves(value)
    assert (int(hi.item()) << 32 | int(lo.item())) == int(value) & ((1 << 64) - 1)
    assert lo.dtype == hi.dtype == torch.float64


def test_the_verdict_names_the_minority_or_suspects_every_holder():
    good, bad = (1.0, 2.0), (1.0, 3.0)
    assert judge([good] * 4, unit=1, step=7) is None
    # DDP, 3 replicas: the rank that differs from the other two.
    assert judge([good, bad, good], unit=1, step=7) == Verdict(7, named=(1,), suspects=())
    # 2 replicas: no majority, both suspects.
    assert judge([good, bad], unit=1, step=7) == Verdict(7, named=(), suspects=(0, 1))
    # TP 2 x DP 3: positions (rank % 2) compare apart; rank 3 is position 1's odd one out.
    other = (5.0, 6.0)
    keys = [good, other, good, bad, good, other]
    assert judge(keys, unit=2, step=9) == Verdict(9, named=(3,), suspects=())
    # No replicas (FSDP: one unit of the whole world): nothing compared.
    assert judge([good, bad, other], unit=3, step=1) is None
    # 2 against 2: suspects, all four.
    assert judge([good, good, bad, bad], unit=1, step=2).ranks == (0, 1, 2, 3)

"""Silent data corruption: a fingerprint of each rank's parameters per step, and the verdict of
the ranks that must agree.

After an optimizer step every data-parallel replica holds bit-identical parameters (DDP: every
rank; under TP or PP, the same place of every replica; under HSDP, the same position of every
shard group). A bit flipped in one rank's memory, or a wrong update computed there, breaks that
equality and, in a few steps, trains every replica on it through the gradient all-reduce. So each
rank folds its parameters into a 64-bit fingerprint at every step and the step's exchange
(elastic._worker.step_exchange: the all-gather the boundary does anyway) carries it, as two
32-bit halves, each exact in the exchange's float64 slots. No extra collective.

When. Before the step's update (a step pre-hook of the first prepared optimizer): the parameters
as that step's forward and backward used them. Taken after the update only, a flipped low bit
could be gone by then, rounded away by the update after the forward and backward had used it,
and the run trained on unseen (SDC2 over all 32 bits, BENCHMARKS.md: a weight's bit 0). After the
update too at the steps whose state is kept (a checkpoint, a copy in memory, the final step) and
where no optimizer was prepared, so that what is kept is what the replicas agreed on; a group
that leaves the loop (a rescale, a notice) compares the state it leaves with first
(StepBoundary.verify_leaving_state). `judge_step` says, on a verdict, from which step on the state
may be corrupt: agreeing before the update, the replicas held alike the state after the step
before; agreeing after it, the state after this one.

The fingerprint. Each parameter's local data (a DTensor's local shard) is read as raw bytes, 8 at
a time as int64 words (the bit patterns, not the values: -0.0 and 0.0 differ, a NaN's payload
counts), and summed with wrap-around into an int64; the per-tensor sums are combined with an odd
multiplier per tensor, so a value that moved between tensors changes it too. Words, not elements:
summing float32 bits as int32 widened to int64 ran at 2.3 ms for the small GPT's 2 M parameters on
one core, as int64 words in 0.7 ms, about what a float sum of each tensor takes. Integer sums are associative: the same
parameters give the same fingerprint on every rank, whatever the kernel's reduction order. Any
single flipped bit changes the sum (by +-2^k): a one-bit fault always changes the fingerprint; many faults
could in principle cancel, with odds of about 2^-64 for random ones. Cost: one read of the
parameters per step (no copy), a fraction of what the optimizer step reads and writes (Adam
reads and writes parameters, gradients and two moments). The optimizer's state is not folded
in: a corrupt moment shows in the parameters at the next step it updates.

The verdict (`judge`). The ranks of one position in every unit (rank % unit) must agree. With 3
or more holders, the ones that differ from a strict majority are named; without a strict
majority (2 holders, or 2 against 2) every holder of the position is a suspect. Under FSDP
without replicas a rank's shards are held once: there is nothing to compare (the check needs
replicas: DDP, HSDP, or TP/PP with 2 or more data-parallel replicas).
"""
from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_MASK32 = (1 << 32) - 1
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Odd multipliers, one per tensor in order (a golden-ratio sequence, reduced to signed int64).
_GOLDEN = 0x9E3779B97F4A7C15


def _multiplier(index: int) -> int:
    value = ((index + 1) * _GOLDEN) & ((1 << 64) - 1) | 1
    return value - (1 << 64) if value >= 1 << 63 else value


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: a DTensor's local shard, else the tensor."""
    from torch.distributed.tensor import DTensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _fold(local: torch.Tensor) -> torch.Tensor:
    """The wrap-around int64 sum of a tensor's bytes read as 8-byte words (the last < 8 bytes
    one by one)."""
    flat = local.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    try:
        if flat.numel() * flat.element_size() % 8 == 0:
            return flat.view(torch.int64).sum()          # the common case: one view, one sum
        raw = flat.view(torch.uint8)
        whole = raw.numel() // 8 * 8
        tail = raw[whole:].to(torch.int64).sum()
        return raw[:whole].view(torch.int64).sum() + tail if whole else tail
    except RuntimeError:
        # Bytes that do not start on an 8-byte boundary: the elements' bits, widened (slower).
        return flat.view(_BITS[flat.element_size()]).sum(dtype=torch.int64)


def fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """The 64-bit fingerprint of `tensors` (their local data) as a 0-d int64 tensor on their
    device; None when there is nothing to fold (no tensor with elements)."""
    sums: list[torch.Tensor] = []
    held: list[int] = []
    for index, tensor in enumerate(tensors):
        local = local_data(tensor).detach()
        if local.numel():
            sums.append(_fold(local))
            held.append(index)
    if not sums:
        return None
    # One multiply and one sum for all (a few kernel launches per tensor is most of the cost).
    return (torch.stack(sums) * _weights(tuple(held), sums[0].device)).sum()


@functools.lru_cache(maxsize=64)
def _weights(indices: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The tensors' multipliers, made once per layout and device (a host-to-device copy at every
    step would make the host wait for the device)."""
    return torch.tensor([_multiplier(i) for i in indices], dtype=torch.int64, device=device)


def halves(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fingerprint as its low and high 32 bits, each a float64 (exact: below 2^53)."""
    return ((value & _MASK32).to(torch.float64), ((value >> 32) & _MASK32).to(torch.float64))


@dataclass(frozen=True)
class Verdict:
    """Ranks whose fingerprints disagree with their position's other holders at `step`."""

    step: int
    named: tuple[int, ...]       # differ from a strict majority of their position: corrupt
    suspects: tuple[int, ...]    # of positions without a strict majority: any of them may be

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.named + self.suspects))


def judge(keys: Sequence[tuple[float, ...]], unit: int, step: int) -> Verdict | None:
    """The verdict on one step's fingerprints (`keys`, by rank), for units of `unit` ranks whose
    same positions hold the same state; None when every position agrees (or nothing is held
    twice)."""
    world = len(keys)
    if unit < 1 or world % unit or world // unit < 2:
        return None
    named: list[int] = []
    suspects: list[int] = []
    for position in range(unit):
        ranks = range(position, world, unit)
        counts = Counter(keys[r] for r in ranks)
        if len(counts) == 1:
            continue
        value, count = counts.most_common(1)[0]
        if 2 * count > len(ranks):
            named.extend(r for r in ranks if keys[r] != value)
        else:
            suspects.extend(ranks)
    if not named and not suspects:
        return None
    return Verdict(step, tuple(named), tuple(suspects))


def judge_step(*, after: list[tuple[float, float]], before: list[tuple[float, float]], unit: int, step: int,
               clean_through: int) -> tuple[Verdict | None, int]:
    """One step's verdict from its two fingerprints by rank, each (0, 0) where not taken: `after`
    the step's update, `before` it (what its forward and backward used); and the newest step
    whose state the replicas held alike, given the one known so far (`clean_through`). A rank
    that differs in either is named. Agreeing before the update, the replicas held alike the
    state after step - 1; agreeing after it, the state after `step`. So on a verdict the first
    step that may be corrupt is the returned step + 1: a flip found before the update came after
    the newest state known alike (it may be gone by the update, rounded away, after this step's
    forward and backward used it); one found only after it came in the update."""
    taken = [k != (0.0, 0.0) for k in before], [k != (0.0, 0.0) for k in after]
    if any(taken[0]) and judge(before, unit, step) is None:
        clean_through = max(clean_through, step - 1)
    verdict = judge([a + b for a, b in zip(after, before, strict=True)], unit, step)
    if verdict is None and any(taken[1]):
        clean_through = step
    return verdict, clean_through

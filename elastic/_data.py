"""Elastic, resumable data loading: which samples each rank reads at each step.

The sample order is a pure function of (seed, epoch); consumption is counted in global samples.
At a step with world size W and per-rank batch B, rank r reads global positions
[seen + r*B, seen + (r+1)*B) of that order, so a resume at any world size neither repeats nor
skips a sample.

With LRScalingConfig(mode="constant_global_batch") the global batch is G = base_world_size x B
at every W: rank r reads [seen + r*G/W, seen + (r+1)*G/W) as G/(W*B) micro-batches of B, one per
yield (see elastic._accumulation).
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.utils.data import default_collate

from elastic._accumulation import rank_positions
from elastic._state import mix_seed
from elastic.errors import ElasticError

if TYPE_CHECKING:
    from elastic.context import TrainContext


class ElasticLoader:
    """Iterable of per-rank batches from the current step up to `total_steps`.

    Reads the step and sample counters from the context when iterated, so it may be created
    before `ctx.restore`.
    """

    def __init__(self, ctx: "TrainContext", dataset: Any, batch_size: int, *, shuffle: bool = True,
                 collate_fn: Callable[[list[Any]], Any] | None = None, seed: int | None = None):
        if batch_size < 1:
            raise ElasticError(f"prepare_data: batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise ElasticError("prepare_data: the dataset is empty")
        self._ctx = ctx
        self._dataset = dataset
        self.batch_size = batch_size
        self._shuffle = shuffle
        self._collate = collate_fn or default_collate
        self._seed = ctx.seed if seed is None else seed
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step (1 unless the global batch is held constant)."""
        accumulation = getattr(self._ctx, "_accumulation", None)
        return accumulation.steps if accumulation is not None else 1

    @property
    def global_batch(self) -> int:
        return self.batch_size * self._ctx.world_size * self.accum_steps

    def __len__(self) -> int:
        """Batches (micro-batches) this loader still yields."""
        return max(0, self._ctx.total_steps - self._ctx.step) * self.accum_steps

    def sample_ids(self, samples_seen: int, rank: int) -> list[int]:
        """Dataset indices rank `rank` reads at the step that starts after `samples_seen`."""
        positions = rank_positions(samples_seen, self.global_batch, self._ctx.world_size, rank)
        return [self._dataset_index(g) for g in positions]

    def _dataset_index(self, global_position: int) -> int:
        n = len(self._dataset)
        epoch, position = divmod(global_position, n)
        if not self._shuffle:
            return position
        order = self._orders.get(epoch)
        if order is None:
            generator = torch.Generator().manual_seed(mix_seed(self._seed, "epoch", epoch))
            order = torch.randperm(n, generator=generator)
            self._orders = {epoch: order}   # one epoch cached: bounded memory
        return int(order[position])

    def __iter__(self) -> Iterator[Any]:
        ctx, accum, batch = self._ctx, self.accum_steps, self.batch_size
        accumulation = getattr(ctx, "_accumulation", None)
        while ctx.step < ctx.total_steps:
            step = ctx.step
            # The whole group's ids of this step, in global order (every rank computes the same);
            # this rank's are its slice of them.
            group_ids = [self._dataset_index(g) for g in range(ctx.samples_seen, ctx.samples_seen + self.global_batch)]
            share = self.global_batch // ctx.world_size
            ids = group_ids[ctx.rank * share:(ctx.rank + 1) * share]
            ctx._begin_step(self.global_batch, group_ids)
            for micro in range(accum):
                # Randomness inside the step (dropout, ...) depends only on (seed, step, rank); with
                # accumulation on the micro-batch's place in the global batch, which no W changes.
                micro_seed = mix_seed(ctx.seed, "step", step, ctx.rank) if accumulation is None else \
                    mix_seed(ctx.seed, "step", step, "micro", ctx.rank * accum + micro)
                torch.manual_seed(micro_seed)
                random.seed(micro_seed)
                if accumulation is not None:
                    accumulation.begin_micro(micro, getattr(ctx, "_model", None))
                yield self._collate([self._dataset[i] for i in ids[micro * batch:(micro + 1) * batch]])
                done = ctx.step != step if micro == accum - 1 else accumulation.reported() == micro + 1
                if not done:
                    raise ElasticError("ctx.report() must be called once per batch of ctx.prepare_data's loader")

"""Elastic, resumable data loading: which samples each rank reads at each step.

The sample order is a pure function of (seed, epoch); consumption is counted in global samples.
At a step with world size W and per-rank batch B, rank r reads global positions
[seen + r*B, seen + (r+1)*B) of that order, so a resume at any world size neither repeats nor
skips a sample.
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.utils.data import default_collate

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
    def global_batch(self) -> int:
        return self.batch_size * self._ctx.world_size

    def __len__(self) -> int:
        return max(0, self._ctx.total_steps - self._ctx.step)

    def sample_ids(self, samples_seen: int, rank: int) -> list[int]:
        """Dataset indices rank `rank` reads at the step that starts after `samples_seen`."""
        start = samples_seen + rank * self.batch_size
        return [self._dataset_index(g) for g in range(start, start + self.batch_size)]

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
        ctx = self._ctx
        while ctx.step < ctx.total_steps:
            step = ctx.step
            # The whole group's ids of this step, in global order (every rank computes the same);
            # this rank's are its slice of them.
            group_ids = [self._dataset_index(g) for g in range(ctx.samples_seen, ctx.samples_seen + self.global_batch)]
            ids = group_ids[ctx.rank * self.batch_size:(ctx.rank + 1) * self.batch_size]
            # Randomness inside the step (dropout, ...) depends only on (seed, step, rank).
            step_seed = mix_seed(ctx.seed, "step", step, ctx.rank)
            torch.manual_seed(step_seed)
            random.seed(step_seed)
            ctx._begin_step(self.global_batch, group_ids)
            yield self._collate([self._dataset[i] for i in ids])
            if ctx.step == step:
                raise ElasticError("ctx.report() must be called once per batch of ctx.prepare_data's loader")

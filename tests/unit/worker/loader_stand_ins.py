"""Stand-ins around the elastic loader: the part of a TrainContext it reads (`Ctx`) and a dataset
whose samples show what __getitem__ drew from the global RNGs (`Noisy`). Shared by the loader's
tests and by the fresh interpreters some of them start."""
from __future__ import annotations

import random

import numpy
import torch

from elastic._worker.accumulation import Accumulation
from elastic.context import RescaleInterrupt

CPU = torch.device("cpu")


class Ctx:
    """What the loader reads of a TrainContext. report() counts the step's samples, as
    TrainContext does, and raises RescaleInterrupt after step `rescale_at`."""

    def __init__(self, *, total_steps=12, step=0, samples_seen=0, world_size=1, rank=0, seed=0,
                 device=CPU, accum=None, rescale_at=None):
        self.total_steps, self.step, self.samples_seen = total_steps, step, samples_seen
        self.dp_size, self.dp_rank, self.seed, self.device = world_size, rank, seed, device
        self.accumulation = Accumulation(accum) if accum else None
        self._model = None
        self.rescale_at = rescale_at
        self.consumed: list[int] = []          # ids of the reported steps, in global order
        self._pending: tuple[int, list[int]] | None = None

    def begin_step(self, global_batch, ids):
        self._pending = (global_batch, list(ids))

    def report(self):
        if self.accumulation is not None and self.accumulation.defer_report(0.0):
            return
        global_batch, ids = self._pending
        self.step += 1
        self.samples_seen += global_batch
        self.consumed += ids
        if self.step == self.rescale_at:
            raise RescaleInterrupt()


class Noisy(torch.utils.data.Dataset):
    """Each sample: its id and what __getitem__ drew from torch, random and numpy."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return {"id": torch.tensor(i), "torch": torch.rand(()), "random": torch.tensor(random.random()),
                "numpy": torch.tensor(numpy.random.rand())}

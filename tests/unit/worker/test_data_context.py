"""prepare_data with worker processes on a real TrainContext (one-rank gloo group, no Ray): a
rescale unwinds the loop mid-epoch, the next generation restores warm and reads on, and the
run consumes exactly the samples of a clean run, with no worker process left behind."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loader_stand_ins import Noisy

from elastic._determinism import DataOrder
from elastic._worker.loader import ElasticLoader
from elastic.context import RescaleInterrupt
from support import no_children

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

BATCH, TOTAL = 4, 12


def train(ctx, stop_after: int | None = None) -> list[list[int]]:
    """The user's loop, loading with two worker processes; asks for a rescale after `stop_after`."""
    model = ctx.prepare_model(torch.nn.Linear(1, 1))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = ctx.prepare_data(Noisy(), batch_size=BATCH, num_workers=2, prefetch_factor=3)
    ctx.restore()
    read = []
    for batch in loader:
        assert batch["id"].device == ctx.device
        read.append(batch["id"].tolist())
        loss = model(batch["torch"].unsqueeze(1)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if ctx.step + 1 == stop_after:
            ctx._boundary._stop_requested.set()         # what the controller's stop request does
        ctx.report(loss=loss)
    return read


def expected_order(samples: int) -> str:
    loader = ElasticLoader(SimpleNamespace(seed=0, dp_size=1, total_steps=1), Noisy(), batch_size=1)
    return DataOrder.of(loader._dataset_indices(0, samples)).hexdigest()


def test_a_rescale_then_a_warm_resume_with_workers_consumes_exactly_a_clean_runs_samples(generations):
    run = generations(total_steps=TOTAL)
    with pytest.raises(RescaleInterrupt):
        train(run.context("fresh"), stop_after=5)
    assert no_children(), "a loader worker outlived the unwound loop"
    progress = run.worker.progress
    # The workers had fetched batches of steps 6.. ahead: none of them counts.
    assert progress.step == 5 and progress.samples_seen == 5 * BATCH
    assert progress.data_order.hexdigest() == expected_order(5 * BATCH)

    rest = train(run.context("broadcast", source_rank=0))
    assert no_children()
    assert progress.step == TOTAL and progress.samples_seen == TOTAL * BATCH
    assert progress.data_order.hexdigest() == expected_order(TOTAL * BATCH)
    assert len(rest) == TOTAL - 5

    clean = generations(total_steps=TOTAL)
    assert train(clean.context("fresh"))[5:] == rest
    assert clean.worker.progress.data_order == progress.data_order


def test_a_dataset_shorter_than_one_global_batch_is_a_config_error(generations):
    from elastic import ConfigError
    ctx = generations().context("fresh")
    with pytest.raises(ConfigError, match="fewer than one global batch of 8"):
        ctx.prepare_data(list(range(5)), batch_size=8)

"""A ray.data.Dataset as indexable rows on the shared local Ray (elastic._worker.ray_data): the rows
in the dataset's order across blocks, one materialization shared by every rank, blocks that
outlive the worker that built an in-memory dataset, a cluster without a free CPU refused with a
message instead of a hang, the iterables the loader refuses, and prepare_data on a real
TrainContext. (Through a run, a kill and a resume: test_parquet_exactly_once.py; the parts without
Ray: tests/unit/worker/test_ray_data_rows.py.)"""
from __future__ import annotations

import sys
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ray import cloudpickle
from torch.utils.data import default_collate

from elastic._run_names import NAMESPACE, RunNames, remove_holders
from elastic._worker.loader import ElasticLoader
from elastic._worker.ray_data import open_rows, source_name
from elastic.errors import ConfigError
from support import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The functions and classes below run in Ray's processes, which cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StandInController:
    """Named as a run's controller: the run's data sources stay while it lives."""

    def ready(self) -> bool:
        return True


@pytest.fixture
def run_names(ray_session):
    """A run's names, its controller standing in; its data sources are removed after the test, as
    the controller does when a run ends."""
    import ray
    names = RunNames(f"test{uuid.uuid4().hex[:12]}")
    controller = ray.remote(num_cpus=0)(StandInController).options(name=names.controller(),
                                                                   namespace=NAMESPACE).remote()
    ray.get(controller.ready.remote(), timeout=60)
    yield names
    remove_holders(names.run_id)
    ray.kill(controller)
    wait_for(lambda: not names.data_sources(), 15, "the test's data sources to go")


def slow_first_block(batch):
    """Block 0 finishes last: without preserve_order the materialized blocks would not be in order."""
    if batch["id"][0] == 0:
        time.sleep(0.5)
    return {"id": batch["id"], "square": batch["id"] ** 2}


def test_rows_are_the_datasets_rows_in_order_across_blocks(ray_session, run_names):
    import ray.data
    dataset = ray.data.range(60, override_num_blocks=6).map_batches(slow_first_block)
    rows = open_rows(dataset, names=run_names, n=0, storage="unused", cache_bytes=0)   # one block cached
    assert len(rows) == 60 and len(rows._blocks) == 6
    assert [int(rows[i]["id"]) for i in range(60)] == list(range(60))
    assert rows.cache_info()["fetches"] == 6                # in order: each block fetched once
    picked = rows.__getitems__([59, 0, 10, 9, 31, 30, 59])   # across boundaries, out of order, twice
    assert [int(r["id"]) for r in picked] == [59, 0, 10, 9, 31, 30, 59]
    assert [int(r["square"]) for r in picked] == [59 ** 2, 0, 100, 81, 31 ** 2, 900, 59 ** 2]
    batch = default_collate(picked)                          # what the loader's collate makes of them
    assert isinstance(batch["id"], torch.Tensor) and batch["id"].tolist() == [59, 0, 10, 9, 31, 30, 59]
    assert rows[-1]["id"] == 59
    with pytest.raises(IndexError):
        rows[60]


def test_two_ranks_share_one_materialization_per_prepare_data_call(ray_session, run_names):
    import ray
    import ray.data
    first = open_rows(ray.data.range(30, override_num_blocks=3), names=run_names, n=0, storage="unused")
    # A second rank (or a replacement, or the next generation) builds its own Dataset object: the
    # run's data source already holds the materialized one, and hands out the same blocks.
    second = open_rows(ray.data.range(30, override_num_blocks=3), names=run_names, n=0, storage="unused")
    assert [b.ref for b in second._blocks] == [b.ref for b in first._blocks]
    source = ray.get_actor(run_names.data_source(0), namespace=NAMESPACE)
    assert source._actor_id == first._source._actor_id == second._source._actor_id
    other = open_rows(ray.data.range(5), names=run_names, n=1, storage="unused")   # the loop's next call
    assert len(other) == 5 and run_names.data_sources() == [run_names.data_source(0), run_names.data_source(1)]
    assert remove_holders(run_names.run_id) == 2
    wait_for(lambda: not run_names.data_sources(), 15, "the data sources to go")


def test_a_data_source_ends_once_its_runs_controller_is_gone(ray_session, run_names):
    # What ends it when no controller removed it: a driver and its controller both lost.
    import ray
    import ray.data
    open_rows(ray.data.range(5), names=run_names, n=0, storage="unused")
    ray.kill(ray.get_actor(run_names.controller(), namespace=NAMESPACE))
    wait_for(lambda: not run_names.data_sources(), 30, "the data source to end itself")


class RankThatBuilds:
    """A rank that builds an in-memory dataset (its blocks are this process's) and prepares it."""

    def prepare(self, names: RunNames) -> tuple[int, list]:
        """The rows prepared, and the dataset's own blocks."""
        import ray.data
        dataset = ray.data.from_items([{"id": i, "name": f"row {i}"} for i in range(20)])
        rows = len(open_rows(dataset, names=names, n=0, storage="unused"))
        return rows, [e.ref for b in dataset.iter_internal_ref_bundles() for e in b.blocks]


def lost(ref) -> bool:
    import ray
    from ray.exceptions import ObjectLostError
    try:
        ray.get(ref, timeout=5)
        return False
    except ObjectLostError:
        return True


def test_blocks_of_an_in_memory_dataset_outlive_the_worker_that_built_it(ray_session, run_names):
    import ray
    import ray.data
    rank = ray.remote(num_cpus=1)(RankThatBuilds).remote()
    rows, its_blocks = ray.get(rank.prepare.remote(run_names), timeout=60)
    assert rows == 20 and its_blocks
    ray.kill(rank)                    # the rank dies, and with it every object it owned
    wait_for(lambda: lost(its_blocks[0]), 30, "the blocks the rank built to be lost with it")
    later = open_rows(ray.data.range(1), names=run_names, n=0, storage="unused")
    assert [(int(r["id"]), r["name"]) for r in later.__getitems__(list(range(20)))] == \
        [(i, f"row {i}") for i in range(20)]


def test_a_cluster_without_a_free_cpu_is_refused_with_a_message_not_a_hang(ray_session, run_names):
    import ray
    import ray.data
    free = ray.available_resources().get("CPU", 0.0)
    hog = ray.remote(num_cpus=free)(Hog).remote()
    try:
        ray.get(hog.ready.remote(), timeout=30)
        started = time.monotonic()
        with pytest.raises(ConfigError, match=r"prepare_data: Ray Data needs free CPUs.*none of the cluster's 6 CPUs "
                                              r"was free for 1s.*ScalingConfig.max_workers"):
            open_rows(ray.data.range(10), names=run_names, n=0, storage="unused", cpu_wait_s=1.0)
        assert time.monotonic() - started < 20
    finally:
        ray.kill(hog)


class Hog:
    """An actor that holds CPUs, as a run's workers do."""

    def ready(self) -> bool:
        return True


def test_iterables_of_ray_data_are_refused(ray_session):
    import ray.data
    dataset = ray.data.range(10)
    with pytest.raises(ConfigError, match=r"a Ray DataIterator .* pass the ray.data.Dataset itself"):
        ElasticLoader(SimpleNamespace(seed=0, dp_size=1, total_steps=1), dataset.iterator(), batch_size=2)
    with pytest.raises(ConfigError, match=r"a ray.data.Dataset \(\w+\) must go through ctx.prepare_data"):
        ElasticLoader(SimpleNamespace(seed=0, dp_size=1, total_steps=1), dataset, batch_size=2)


@pytest.fixture
def context(ray_session, tmp_path):
    """A TrainContext over a one-rank gloo group in this process: a context outside a run (no run
    id), as the benchmarks build one. Its data source, named after the storage, is removed after."""
    import ray

    from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
    from elastic._worker.state import WorkerState
    from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
    from elastic.context import TrainContext
    storage = str(tmp_path / "run")
    spec = RunSpec(user_code=b"", total_steps=5, seed=0, scaling=ScalingConfig(strategy="ddp"),
                   checkpoint=CheckpointConfig(storage=storage, keep=None, async_save=False), failure=FailureConfig())
    plan = GenerationPlan(generation=1, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                          restore=RestorePlan("fresh"), timeout_s=60.0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield TrainContext(plan=plan, spec=spec, worker=WorkerState(), loop_config=None,
                           stop_requested=threading.Event(), preempted=threading.Event(), device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()
        try:
            ray.kill(ray.get_actor(source_name(None, 0, storage), namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass


def test_prepare_data_reads_a_ray_dataset_in_the_loaders_order(context):
    import ray.data
    dataset = ray.data.range(40, override_num_blocks=4).map_batches(slow_first_block)
    with pytest.raises(ConfigError, match="num_workers > 0 is not supported with a ray.data.Dataset"):
        context.prepare_data(dataset, batch_size=4, num_workers=2)
    model = context.prepare_model(torch.nn.Linear(1, 1))
    optimizer = context.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    loader = context.prepare_data(dataset, batch_size=4)
    context.restore()
    read = []
    for batch in loader:
        assert set(batch) == {"id", "square"} and batch["square"].dtype == torch.int64
        read += batch["id"].tolist()
        loss = model(batch["id"].float().unsqueeze(1)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        context.report(loss=loss)
    # Row i is the dataset's i-th row (id i), read in the loader's order over 40 indices.
    order = ElasticLoader(SimpleNamespace(seed=0, dp_size=1, total_steps=1), range(40), batch_size=1)
    assert read == order._dataset_indices(0, 20) and context.step == 5

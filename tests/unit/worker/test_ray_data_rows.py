"""The parts of a Ray Dataset's indexable rows that need no Ray (elastic._worker.ray_data): the
row index over blocks, the block cache, the names of the data sources; and the loader's refusal of
sources it cannot address by index. (With Ray: tests/integration/test_ray_data_source.py.)"""
from __future__ import annotations

import pytest
import torch
from loader_stand_ins import Ctx

from elastic._run_names import RunNames
from elastic._worker.loader import ElasticLoader, check_map_style
from elastic._worker.ray_data import BlockCache, BlockIndex, check_loader_options, source_name
from elastic.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

SUPPORTED = r"map-style dataset.*elastic\.ParquetTokens.*ray\.data\.Dataset"


def test_a_global_row_maps_to_its_block_and_offset_across_block_boundaries():
    index = BlockIndex([3, 1, 4])
    assert len(index) == 8
    assert [index.locate(i) for i in range(8)] == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1), (2, 2), (2, 3)]
    assert index.locate(-1) == (2, 3) and index.locate(-8) == (0, 0)
    for outside in (8, -9):
        with pytest.raises(IndexError, match="out of range for a Ray Dataset of 8 rows"):
            index.locate(outside)


def test_a_block_without_rows_holds_no_index():
    index = BlockIndex([2, 0, 2])
    assert [index.locate(i) for i in range(4)] == [(0, 0), (0, 1), (2, 0), (2, 1)]


def test_the_cache_keeps_blocks_within_its_bytes_and_always_the_newest():
    fetched: list[int] = []

    def fetch(key):
        def get():
            fetched.append(key)
            return f"block {key}"
        return get

    cache = BlockCache(budget=250)
    assert [cache.get(k, 100, fetch(k)) for k in (0, 1, 0, 2, 0)] == ["block 0", "block 1", "block 0", "block 2",
                                                                    "block 0"]
    assert fetched == [0, 1, 2]                # 0 stayed (used again before 2 came); 1 was the oldest
    assert cache.info() == {"fetches": 3, "cached": 2, "bytes": 200}
    cache.get(1, 100, fetch(1))
    assert fetched[-1] == 1 and cache.info()["cached"] == 2
    tiny = BlockCache(budget=0)                # smaller than any block: still holds the newest
    tiny.get(0, 100, fetch(0))
    tiny.get(0, 100, fetch(0))
    assert tiny.info() == {"fetches": 1, "cached": 1, "bytes": 100}
    tiny.clear()
    assert tiny.info()["cached"] == 0
    with pytest.raises(ConfigError):
        BlockCache(budget=-1)


def test_data_sources_are_named_after_the_run_and_the_order_of_the_call():
    names = RunNames.of_controller("abc123.controller")
    assert names == RunNames("abc123") and names.data_source(1) == "abc123.data1"
    assert RunNames.of_controller(None) is None and RunNames.of_controller("abc123.w0.b0@pg") is None
    assert source_name(names, 0, "s3://b/run") == "abc123.data0"
    # Outside a run: named after the storage (one live run per URL), the same for every rank.
    assert source_name(None, 2, "s3://b/run") == source_name(None, 2, "s3://b/run") != source_name(None, 2, "/x")
    assert source_name(None, 2, "s3://b/run").endswith(".data2")
    # Not a worker's name: the controller's adoption never takes a data source for a worker.
    assert names.parse_worker(names.data_source(0)) is None


def test_worker_processes_are_refused_for_a_ray_dataset():
    check_loader_options({"num_workers": 0, "pin_memory": False})
    with pytest.raises(ConfigError, match="num_workers > 0 is not supported with a ray.data.Dataset.*no Ray "
                                          "connection.*map_batches"):
        check_loader_options({"num_workers": 2})


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


class LengthOnly:
    def __len__(self):
        return 10


@pytest.mark.parametrize(("source", "named"), [
    (Stream(), "torch IterableDataset"),
    ((i for i in range(10)), "iterator or generator"),
    (map(int, range(10)), "iterator or generator"),
    ({1, 2, 3}, r"set has no __len__ and __getitem__"),
    (LengthOnly(), r"LengthOnly has no __len__ and __getitem__"),
])
def test_sources_that_cannot_be_sharded_or_resumed_are_refused_naming_the_supported_ones(source, named):
    with pytest.raises(ConfigError, match=rf"prepare_data: (a|an|) ?{named}.*{SUPPORTED}"):
        ElasticLoader(Ctx(), source, batch_size=2)


def test_map_style_sources_pass():
    for source in (list(range(4)), range(4), torch.arange(4), torch.utils.data.TensorDataset(torch.arange(4))):
        check_map_style(source)

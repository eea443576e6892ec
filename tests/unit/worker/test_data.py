"""Data order and the model hash: pure functions the determinism guarantees rest on."""
import pytest
import torch

from elastic._determinism import DATA_ORDER_BLOCK, DataOrder, mix_seed, state_sha256
from elastic._worker.loader import ElasticLoader, seed_everything

pytestmark = pytest.mark.timeout(30)


class FakeCtx:
    def __init__(self, world_size, rank=0, seed=0):
        self.dp_size, self.dp_rank, self.seed = world_size, rank, seed     # the loader reads the data-parallel place
        self.step, self.samples_seen, self.total_steps = 0, 0, 10_000


def consumed(world_sizes, batch_size=4, n=1000, seed=0):
    """Ids read by all ranks, step by step, while the world size changes as given."""
    ids, seen = [], 0
    for world_size in world_sizes:
        for rank in range(world_size):
            loader = ElasticLoader(FakeCtx(world_size, rank, seed), list(range(n)), batch_size)
            ids += loader.sample_ids(seen, rank)
        seen += world_size * batch_size
    return ids


def test_resize_neither_repeats_nor_skips():
    steady = consumed([2] * 30)                              # 240 samples at world size 2
    resized = consumed([2] * 10 + [3] * 5 + [1] * 10 + [2] * 5)   # 80 + 60 + 40 + 40 = 220
    assert len(set(resized)) == len(resized)                 # no repeat within the epoch
    assert resized == steady[:len(resized)]                  # the same order, nothing skipped


def test_order_is_a_pure_function_of_seed_and_epoch():
    assert consumed([2] * 5, seed=1) == consumed([2] * 5, seed=1)
    assert consumed([2] * 5, seed=1) != consumed([2] * 5, seed=2)
    full = consumed([4] * 60, n=960)                          # 60 steps x 16 samples: one epoch
    assert sorted(full) == list(range(960))
    second_epoch = consumed([4] * 120, n=960)[960:]
    assert sorted(second_epoch) == list(range(960)) and second_epoch != full


def test_a_steps_ids_across_an_epochs_end_are_the_two_epochs_orders():
    loader = ElasticLoader(FakeCtx(1, seed=3), list(range(10)), 4)
    orders = [torch.randperm(10, generator=torch.Generator().manual_seed(mix_seed(3, "epoch", e))).tolist()
              for e in range(3)]
    assert loader._dataset_indices(7, 23) == orders[0][7:] + orders[1] + orders[2][:3]
    assert sum((loader._dataset_indices(g, g + 1) for g in range(7, 23)), []) == loader._dataset_indices(7, 23)
    unshuffled = ElasticLoader(FakeCtx(1), list(range(10)), 4, shuffle=False)
    assert unshuffled._dataset_indices(8, 13) == [8, 9, 0, 1, 2]


def test_the_data_order_depends_on_the_ids_in_order_not_on_their_grouping_into_steps():
    ids = list(range(1000, 1000 + 3 * DATA_ORDER_BLOCK + 5))
    whole = DataOrder.of(ids)
    for step in (1, 7, 16, DATA_ORDER_BLOCK, DATA_ORDER_BLOCK + 3):
        grouped = DataOrder()
        for start in range(0, len(ids), step):
            grouped.extend(ids[start:start + step])
        assert grouped == whole and grouped.hexdigest() == whole.hexdigest()
    swapped = ids[:]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    assert DataOrder.of(swapped).hexdigest() != whole.hexdigest()
    # Every prefix has its own digest, on both sides of a block's end.
    digests = {DataOrder.of(ids[:n]).hexdigest() for n in range(DATA_ORDER_BLOCK - 2, DATA_ORDER_BLOCK + 3)}
    assert len(digests) == 5


def test_the_data_order_goes_on_from_its_saved_state_and_from_a_digest_saved_without_a_tail():
    ids = list(range(2 * DATA_ORDER_BLOCK + 9))
    head = DataOrder.of(ids[:DATA_ORDER_BLOCK + 4])
    chain, tail = head.state()
    resumed = DataOrder(chain, bytes.fromhex(tail))
    resumed.extend(ids[DATA_ORDER_BLOCK + 4:])
    assert resumed == DataOrder.of(ids)
    # A state from before the tail existed (one digest) goes on as the chain: the digest reads
    # the same at once and moves on with the ids after it.
    legacy = DataOrder("ab" * 32)
    assert legacy.hexdigest() == "ab" * 32
    legacy.extend([1, 2])
    assert legacy.hexdigest() not in ("ab" * 32, DataOrder.of([1, 2]).hexdigest())
    with pytest.raises(ValueError, match="whole ids"):
        DataOrder(chain, b"\x00" * 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the lazy CUDA seed is queued only without CUDA started")
def test_seeding_a_step_seeds_every_rng_without_formatting_a_stack(monkeypatch):
    import random
    import traceback

    import numpy
    torch.manual_seed(11)
    want = (torch.rand(3), random.random(), numpy.random.rand())

    def no_stack(*args, **kwargs):
        raise AssertionError("a stack trace was formatted (torch's lazy CUDA seed): ~0.2 ms a call, twice a step")
    monkeypatch.setattr(traceback, "format_stack", no_stack)
    random.seed(0)
    numpy.random.seed(0)
    seed_everything(11)
    got = (torch.rand(3), random.random(), numpy.random.rand())
    random.seed(11)
    numpy.random.seed(11)
    assert torch.equal(got[0], want[0]) and got[1:] == (random.random(), numpy.random.rand())


def test_loader_requires_report_each_step():
    ctx = FakeCtx(1)
    ctx.begin_step = lambda global_batch, ids: None
    loader = ElasticLoader(ctx, list(range(10)), 2)
    it = iter(loader)
    next(it)
    with pytest.raises(Exception, match="report"):
        next(it)


def test_state_hash_is_exact():
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    b = {k: v.clone() for k, v in a.items()}
    assert state_sha256(a) == state_sha256(b)
    b["w"][1, 2] = torch.nextafter(b["w"][1, 2], torch.tensor(100.0))
    assert state_sha256(a) != state_sha256(b)


def test_mix_seed_is_stable_and_distinct():
    assert mix_seed(0, "step", 5, 1) == mix_seed(0, "step", 5, 1)
    assert len({mix_seed(0, "step", s, r) for s in range(50) for r in range(4)}) == 200

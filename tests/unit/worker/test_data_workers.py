"""The loader's DataLoader without Ray: worker processes change neither which samples a step
reads nor what it draws at random, prefetched batches of steps that never ran are not counted,
and no worker process outlives the loop."""
from __future__ import annotations

import gc
import multiprocessing
import os
import random
import signal
import textwrap

import numpy
import pytest
import torch
from loader_stand_ins import Ctx, Noisy

from chaos.services import wait_until
from elastic._determinism import DataOrder, mix_seed
from elastic._worker.loader import ElasticLoader
from elastic.context import RescaleInterrupt
from elastic.errors import ConfigError, ElasticError
from support import REPO_ROOT, fresh_python, no_children, pid_alive

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


CPU = torch.device("cpu")


def drawn() -> tuple[float, float, float]:
    """What the loop body draws from the three global RNGs."""
    return float(torch.rand(())), random.random(), float(numpy.random.rand())


def run(ctx, **options) -> tuple[list[dict], list[tuple]]:
    """Every batch the loader yields, and what the loop body drew after each."""
    batches, draws = [], []
    for batch in ElasticLoader(ctx, Noisy(), 4, **options):
        batches.append({k: v.tolist() for k, v in batch.items()})
        draws.append(drawn())
        ctx.report()
    return batches, draws


def test_workers_change_neither_the_batches_nor_the_randomness():
    serial, parallel = Ctx(), Ctx()
    assert run(serial) == run(parallel, num_workers=2)
    assert serial.consumed == parallel.consumed and len(serial.consumed) == 12 * 4
    assert no_children()


def test_getitem_randomness_differs_between_batches_and_from_the_loop():
    batches, draws = run(Ctx(total_steps=4), num_workers=2)
    noise = [tuple(b["torch"]) for b in batches]
    assert len(set(noise)) == 4 and all(len(set(n)) == 4 for n in noise)
    assert {d[0] for d in draws}.isdisjoint(x for n in noise for x in n)


def test_numpy_random_and_torch_are_seeded_per_step_and_rank():
    for rank in (0, 1):
        ctx = Ctx(total_steps=3, world_size=2, rank=rank, seed=7)
        _, draws = run(ctx, num_workers=1)
        for step, got in enumerate(draws):
            seed = mix_seed(7, "step", step, rank)
            expected = (float(torch.rand((), generator=torch.Generator().manual_seed(seed))),
                        random.Random(seed).random(), numpy.random.RandomState(seed % 2**32).rand())
            assert got == expected


def test_a_resume_from_a_step_reads_exactly_the_remaining_ids():
    clean = Ctx(world_size=2, rank=1)
    full, _ = run(clean, num_workers=2)
    resumed = Ctx(world_size=2, rank=1, step=5, samples_seen=5 * 2 * 4)
    rest, _ = run(resumed, num_workers=2)
    assert rest == full[5:] and resumed.consumed == clean.consumed[5 * 8:]


def test_a_rescale_mid_epoch_stops_the_workers_and_counts_only_reported_steps():
    ctx = Ctx(total_steps=40, rescale_at=5)
    loader = ElasticLoader(ctx, Noisy(), 4, num_workers=2, prefetch_factor=4)   # up to 8 batches ahead
    seen = []
    with pytest.raises(RescaleInterrupt):
        for batch in loader:
            seen.append(batch["id"].tolist())
            assert len(multiprocessing.active_children()) == 2
            ctx.report()
    assert no_children(), "a worker process outlived the unwound loop"
    # Only the five reported steps count, not the batches the workers had fetched ahead.
    assert ctx.step == 5 and ctx.samples_seen == 20 and ctx.consumed == [i for b in seen for i in b]
    # The next generation reads on from there: together, exactly a clean run's samples.
    after = Ctx(total_steps=40, step=ctx.step, samples_seen=ctx.samples_seen)
    run(after, num_workers=2)
    clean = Ctx(total_steps=40)
    run(clean)
    assert ctx.consumed + after.consumed == clean.consumed
    resumed = DataOrder.of(ctx.consumed)
    resumed.extend(after.consumed)
    assert resumed == DataOrder.of(clean.consumed)


def test_an_iterator_held_past_its_generation_is_closed_by_the_next_one():
    old = Ctx(total_steps=40)
    held = iter(ElasticLoader(old, Noisy(), 4, num_workers=2))
    next(held)
    assert len(multiprocessing.active_children()) == 2
    new = Ctx(total_steps=40)
    fresh = iter(ElasticLoader(new, Noisy(), 4, num_workers=1))
    next(fresh)
    assert len(multiprocessing.active_children()) == 1     # the old generation's two are gone
    old.report()
    with pytest.raises(ElasticError, match="closed"):
        next(held)
    del fresh
    assert no_children()


def test_persistent_workers_survive_a_break_and_read_on():
    ctx = Ctx(total_steps=8)
    loader = ElasticLoader(ctx, Noisy(), 4, num_workers=2, persistent_workers=True)
    first = []
    for batch in loader:
        first.append(batch["id"].tolist())
        ctx.report()
        if ctx.step == 3:
            break
    workers = {p.pid for p in multiprocessing.active_children()}
    assert len(workers) == 2
    rest = []
    for batch in loader:
        rest.append(batch["id"].tolist())
        ctx.report()
    assert no_children()                 # the end of the run ends them
    clean = Ctx(total_steps=8)
    run(clean)
    assert [i for b in first + rest for i in b] == ctx.consumed == clean.consumed
    loader2 = ElasticLoader(Ctx(total_steps=8), Noisy(), 4, num_workers=2, persistent_workers=True)
    next(iter(loader2))
    loader2.close()
    assert no_children()


def test_accumulated_micro_batches_are_the_same_with_workers():
    serial, parallel = Ctx(world_size=2, rank=1, accum=3), Ctx(world_size=2, rank=1, accum=3)
    assert run(serial) == run(parallel, num_workers=2)
    assert len(serial.consumed) == 12 * 2 * 3 * 4 and serial.consumed == parallel.consumed


def test_batches_are_moved_to_the_context_device_through_nested_containers():
    class Nested(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"x": torch.tensor([i]), "pair": (torch.tensor(i), torch.tensor(-i)), "name": f"s{i}"}

    ctx = Ctx(total_steps=2, device=torch.device("meta"))   # a device other than the CPU, on any machine
    loader = ElasticLoader(ctx, Nested(), 2, num_workers=1)
    assert not loader._loader.pin_memory                    # pinned only for CUDA
    for batch in loader:
        assert batch["x"].device.type == "meta" and [t.device.type for t in batch["pair"]] == ["meta", "meta"]
        assert batch["name"] == [f"s{i}" for i in ctx._pending[1]]
        ctx.report()


def test_a_custom_collate_and_getitems_are_used():
    class Batched(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitems__(self, ids):
            return [("batched", i) for i in ids]

    ctx = Ctx(total_steps=2)
    loader = ElasticLoader(ctx, Batched(), 3, shuffle=False, num_workers=1, collate_fn=lambda s: [i for _, i in s])
    got = []
    for batch in loader:
        got.append(batch)
        ctx.report()
    assert got == [[0, 1, 2], [3, 4, 5]]


class Collecting(Noisy):
    def __getitem__(self, i):
        gc.collect()
        return super().__getitem__(i)


class Finalized:
    """Garbage in a cycle whose finalizer notes the process that ran it."""

    def __init__(self, path):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_a_worker_never_finalizes_the_parents_garbage(tmp_path):
    log = tmp_path / "finalized"
    gc.disable()       # the cycle stays uncollected in this process until the workers have started
    try:
        Finalized(str(log))
        ctx = Ctx(total_steps=2)
        for _ in ElasticLoader(ctx, Collecting(), 4, num_workers=2):
            ctx.report()
    finally:
        gc.enable()
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())]


def test_a_parquet_corpus_reads_the_same_in_worker_processes(tmp_path):
    from elastic import ParquetTokens, write_token_shards
    url = str(tmp_path / "corpus")
    write_token_shards(url, [numpy.arange(k * 50, (k + 1) * 50).repeat(5).reshape(50, 5) for k in range(3)],
                       row_group_size=8)
    batches = {}
    for workers in (0, 2):
        ctx, read = Ctx(total_steps=10, world_size=2, rank=1), []
        for batch in ElasticLoader(ctx, ParquetTokens(url, 4), 4, num_workers=workers):
            read.append(batch[:, 0].tolist())
            ctx.report()
        batches[workers] = read
        # Row k holds token k: rank 1 reads the second half of each step's 8 ids.
        mine = [i for step in range(10) for i in ctx.consumed[step * 8 + 4:step * 8 + 8]]
        assert [i for b in read for i in b] == mine
    assert batches[0] == batches[2]


@pytest.mark.parametrize("options, match", [
    ({"sampler": None}, "sampler= is not accepted.*shuffle="),
    ({"batch_sampler": []}, "batch_sampler= is not accepted"),
    ({"drop_last": True}, "drop_last= is not accepted.*never a partial batch"),
    ({"generator": torch.Generator()}, "generator= is not accepted.*seed"),
    ({"in_order": False}, "in_order= is not accepted.*step order"),
    ({"num_wrkers": 2}, r"unknown option num_wrkers=.*num_workers, pin_memory"),
    ({"num_workers": -1}, "num_workers must be an integer >= 0"),
    ({"prefetch_factor": 4}, "prefetch_factor= needs worker processes"),
    ({"persistent_workers": True}, "persistent_workers= needs worker processes"),
    ({"num_workers": 1, "prefetch_factor": 0}, "prefetch_factor .* >= 1"),
    ({"timeout": -1}, "timeout .* >= 0"),
    ({"num_workers": 1, "multiprocessing_context": "nope"}, "valid start method"),
])
def test_bad_options_are_config_errors_that_say_why(options, match):
    with pytest.raises(ConfigError, match=match):
        ElasticLoader(Ctx(), Noisy(), 4, **options)


KILLED_PARENT = textwrap.dedent("""
    import multiprocessing, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    sys.path[:0] = [os.path.join(sys.argv[1], "tests"), os.path.join(sys.argv[1], "tests", "unit", "worker")]
    from loader_stand_ins import Ctx, Noisy
    from elastic._worker.loader import ElasticLoader
    it = iter(ElasticLoader(Ctx(total_steps=100), Noisy(), 4, num_workers=2))
    next(it)
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_the_workers_of_a_killed_rank_die_with_it():
    # Otherwise they live on until torch's watchdog notices (about 5 s), holding copies of the
    # rank's sockets: its peers would not see its connections close.
    done = fresh_python(KILLED_PARENT, REPO_ROOT, timeout_s=20)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    pids = [int(p) for p in done.stdout.decode().split()]
    assert len(pids) == 2
    wait_until(lambda: not any(pid_alive(p) for p in pids), 2.0, "the workers to end after their parent was killed",
               interval_s=0.01)

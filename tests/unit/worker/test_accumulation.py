"""constant_global_batch mode without Ray: the divisibility check, the accumulation arithmetic,
and that accumulated micro-steps make the same update as one step over the whole batch."""
import pytest
import torch
from torch import nn

from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig
from elastic._worker.accumulation import Accumulation, accumulation_steps, rank_positions, wrap_optimizer
from elastic._worker.loader import ElasticLoader
from elastic.config import ConfigError, LRScalingConfig, check_divisible

pytestmark = pytest.mark.timeout(30)


def test_divisible_by_every_allowed_world_size_passes():
    check_divisible(12, 2, 4)
    check_divisible(6, 1, 3)


def test_sizes_that_do_not_divide_are_named_and_the_lcm_suggested():
    with pytest.raises(ConfigError, match=r"not divisible by world sizes \[4\] .*multiple of 12"):
        check_divisible(6, 2, 4)
    with pytest.raises(ConfigError, match=r"\[4, 5\] .*multiple of 60"):
        check_divisible(6, 3, 6)


def test_unbounded_world_size_is_refused_in_constant_batch_mode():
    with pytest.raises(ConfigError, match="max_workers"):
        check_divisible(12, 2, None)


def trainer(tmp_path, lr, workers=(2, 4), total_steps=100):
    return ElasticTrainer(lambda ctx: None, total_steps=total_steps, checkpoint=CheckpointConfig(storage=str(tmp_path)),
                          scaling=ScalingConfig(min_workers=workers[0], max_workers=workers[1]), lr=lr)


def test_trainer_checks_the_global_batch_at_configuration_time(tmp_path):
    constant = dict(mode="constant_global_batch")
    with pytest.raises(ConfigError, match=r"\[4\].*multiple of 12"):
        trainer(tmp_path, LRScalingConfig(base_world_size=6, **constant))
    with pytest.raises(ConfigError, match="max_workers"):
        trainer(tmp_path, LRScalingConfig(base_world_size=6, **constant), workers=(2, None))
    assert trainer(tmp_path, LRScalingConfig(base_world_size=12, **constant)).lr.base_world_size == 12
    # Linear mode has no divisibility constraint.
    assert trainer(tmp_path, LRScalingConfig(base_world_size=6)).lr.mode == "linear"


def test_warmup_as_long_as_the_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="warmup_steps"):
        trainer(tmp_path, LRScalingConfig(base_world_size=12, warmup_steps=100), total_steps=100)


def test_accumulation_steps_and_rank_positions_cover_the_global_batch_once():
    assert [accumulation_steps(12, w) for w in (1, 2, 3, 4, 6, 12)] == [12, 6, 4, 3, 2, 1]
    with pytest.raises(Exception, match="does not divide"):
        accumulation_steps(12, 5)
    for world_size in (1, 2, 3, 6):
        positions = [p for r in range(world_size) for p in rank_positions(100, 24, world_size, r)]
        assert positions == list(range(100, 124))


class FakeCtx:
    """What the loader reads of a TrainContext; report() follows TrainContext's accumulation."""

    def __init__(self, world_size, rank, accum, seen=0):
        self.dp_size, self.dp_rank, self.seed, self.total_steps = world_size, rank, 0, 100
        self.step, self.samples_seen, self._model = 0, seen, None
        self.accumulation = Accumulation(accum)
        self.begun = []

    def begin_step(self, global_batch, ids):
        self.begun.append((global_batch, list(ids)))
        self._pending = global_batch

    def report(self):
        if not self.accumulation.defer_report(0.0):
            self.step += 1
            self.samples_seen += self._pending


def micro_batches(world_size, base_world_size=6, batch=2, steps=2):
    """Every rank's micro-batches, keyed by their place in the global batch: (step, index)."""
    out = {}
    for rank in range(world_size):
        ctx = FakeCtx(world_size, rank, base_world_size // world_size)
        loader = ElasticLoader(ctx, list(range(1000)), batch, shuffle=True)
        assert loader.global_batch == base_world_size * batch and len(loader) == 100 * ctx.accumulation.steps
        for i, micro in enumerate(loader):
            step, k = divmod(i, ctx.accumulation.steps)
            out[(step, rank * ctx.accumulation.steps + k)] = micro.tolist()
            ctx.report()
            if ctx.step == steps:
                break
        assert all(gb == base_world_size * batch for gb, _ in ctx.begun)
    return out


def test_micro_batches_are_the_same_samples_at_every_world_size():
    reference = micro_batches(6)
    assert len(reference) == 12 and all(len(b) == 2 for b in reference.values())
    for world_size in (1, 2, 3):
        assert micro_batches(world_size) == reference


def test_loader_requires_a_report_per_micro_batch():
    ctx = FakeCtx(world_size=2, rank=0, accum=3)
    it = iter(ElasticLoader(ctx, list(range(100)), 2))
    next(it)
    with pytest.raises(Exception, match="report"):
        next(it)


def train(accum, zero_first, steps=3):
    """Three SGD-with-momentum steps over the same 12 samples per step, split into `accum`
    micro-batches driven like the loader and report() drive the user's loop."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulation(accum)
    wrap_optimizer(opt, acc)
    data = torch.randn(steps, 12, 4)
    for s in range(steps):
        for m, x in enumerate(data[s].chunk(accum)):
            acc.begin_micro(m, model)
            if zero_first:
                opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            if not acc.final:
                assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            if not zero_first:
                opt.zero_grad()
            acc.defer_report(loss.item())
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("zero_first", [False, True])
def test_accumulated_micro_steps_match_one_full_batch_step(zero_first):
    full = train(1, zero_first)
    for accum in (2, 3, 6):
        # Equal up to float summation order (the mean of means vs one mean).
        for a, b in zip(train(accum, zero_first), full, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_mean_loss_and_rewrapping():
    acc = Accumulation(2)
    acc.begin_micro(0, None)
    assert acc.defer_report(1.0) is True
    acc.begin_micro(1, None)
    assert acc.defer_report(3.0) is False and acc.mean_loss() == 2.0
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    wrap_optimizer(opt, acc)
    step = opt.step
    wrap_optimizer(opt, Accumulation(3))        # a new generation points the same optimizer at its state
    assert opt.step is step and opt.__dict__["_elastic_accumulation"][0].steps == 3


def test_tensor_losses_are_summed_where_they_are_and_never_read_per_micro_batch():
    acc = Accumulation(3)
    losses = [torch.tensor(1.0, requires_grad=True) * 1, torch.tensor([2.0]), torch.tensor(6.0, dtype=torch.bfloat16)]
    for micro, loss in enumerate(losses):
        acc.begin_micro(micro, None)
        acc.defer_report(loss)
    # A tensor (on a GPU: on the device, read with the step's exchange a step later), detached,
    # in float64 whatever the loss's dtype.
    mean = acc.mean_loss()
    assert isinstance(mean, torch.Tensor) and not mean.requires_grad and mean.dtype == torch.float64
    assert mean.item() == 3.0
    acc.begin_micro(0, None)                    # the next step starts from zero
    acc.defer_report(None)
    assert acc.mean_loss() == 0.0


def run_micro_steps(model, accum=3):
    acc = Accumulation(accum)
    for micro in range(accum):
        acc.begin_micro(micro, model)
        model(torch.randn(2, 4)).sum().backward()
        yield micro


def test_ddp_syncs_gradients_only_on_the_final_micro_step(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(nn.Linear(4, 4))
    launches = []

    def counting_hook(state, bucket):
        launches.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, counting_hook)
    seen = [len(launches) for _ in run_micro_steps(model)]
    assert seen[:2] == [0, 0] and seen[2] >= 1


def test_fsdp2_reduce_scatters_only_on_the_final_micro_step(one_rank_group, monkeypatch):
    # FSDP2 has no public hook on its reduce-scatter; count calls of the private function that
    # issues it (an AttributeError here means torch moved it: update the name, do not skip).
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    calls = []
    real = param_group.foreach_reduce
    monkeypatch.setattr(param_group, "foreach_reduce", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
    assert [len(calls) for _ in run_micro_steps(model)] == [0, 0, 1]


def schedule_run(accum: int, built: str, steps: int = 4, plateau: bool = False):
    """`train`'s loop with a torch LR scheduler stepped in the loop body (per micro-batch, as the
    body runs), built before or after the optimizer is wrapped: (its LR per optimizer step, its
    last_epoch, the parameters)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulation(accum)

    def build():
        if plateau:
            return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    sched = build() if built == "before" else None
    wrap_optimizer(opt, acc)
    if sched is None:
        sched = build()
    data = torch.randn(steps, 12, 4)
    lrs = []
    for s in range(steps):
        for m, x in enumerate(data[s].chunk(accum)):
            acc.begin_micro(m, model)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            sched.step(1.0) if plateau else sched.step()     # a constant metric: the plateau halves each step
            opt.zero_grad()
            acc.defer_report(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
    return lrs, sched.last_epoch, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("built", ["before", "after"])
@pytest.mark.parametrize("plateau", [False, True])
def test_a_torch_scheduler_steps_once_per_optimizer_step_in_either_build_order(built, plateau):
    # Issue 34: built after the optimizer was prepared, LambdaLR crashed ("'function' object has
    # no attribute '__func__'"); built before, it stepped per micro-batch, accum times too fast.
    lrs, last_epoch, params = schedule_run(1, built, plateau=plateau)
    assert last_epoch == 4
    for accum in (2, 3):
        got_lrs, got_epoch, got_params = schedule_run(accum, built, plateau=plateau)
        assert got_epoch == last_epoch and got_lrs == lrs, (accum, got_lrs, lrs)
        for a, b in zip(got_params, params, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

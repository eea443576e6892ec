"""The state contract on a real TrainContext over a one-rank gloo group (no Ray): every object
handed to `ctx.restore` survives a warm restore and a checkpoint restore; the guards; report()'s
metrics; the torchrun environment; the run's end status."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic import CheckpointError, RestoreRequiredError, StateError
from elastic._controller.actor import run_status
from elastic._protocol import GenerationPlan, RestorePlan, WorkerInfo, placement
from elastic._worker.train_state import STATE_KINDS
from elastic._worker.worker import _set_torchrun_environment

pytestmark = pytest.mark.timeout(120)


class Counter:
    """A user's own Stateful object."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = int(state["seen"])


class Objects:
    """A GAN-like job: two models, two optimizers, a LambdaLR, an EMA module and a counter."""

    def __init__(self, ctx, seed: int):
        torch.manual_seed(seed)
        self.gen = ctx.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)))
        self.disc = ctx.prepare_model(nn.Linear(4, 1))
        self.opt_g = ctx.prepare_optimizer(torch.optim.AdamW(self.gen.parameters(), lr=1e-2))
        self.opt_d = ctx.prepare_optimizer(torch.optim.SGD(self.disc.parameters(), lr=1e-2, momentum=0.9))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt_g, lambda s: 1.0 / (1 + s))
        self.ema = torch.optim.swa_utils.AveragedModel(
            self.gen.module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        self.counter = Counter()

    def restore(self, ctx) -> int:
        return ctx.restore(model=self.gen, optimizer=self.opt_g, disc=self.disc, opt_d=self.opt_d,
                           sched=self.sched, ema=self.ema, counter=self.counter)

    def train(self, ctx, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(8, 4)
            loss = self.disc(self.gen(x)).mean()
            loss.backward()
            self.opt_g.step()
            self.opt_d.step()
            self.opt_g.zero_grad()
            self.opt_d.zero_grad()
            self.sched.step()
            self.ema.update_parameters(self.gen.module)
            self.counter.seen += 8
            ctx.report(loss=loss, accuracy=0.5, grad_norm=torch.tensor(2.0))

    def snapshot(self) -> dict:
        """Every object's state, copied."""
        return copy.deepcopy({"gen": self.gen.module.state_dict(), "disc": self.disc.module.state_dict(),
                              "opt_g": self.opt_g.state_dict()["state"], "opt_d": self.opt_d.state_dict()["state"],
                              "sched": {k: v for k, v in self.sched.state_dict().items() if k != "lr_lambdas"},
                              "lr": self.opt_g.param_groups[0]["lr"],
                              "ema": self.ema.state_dict(), "counter": self.counter.seen})


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("rung", ["broadcast", "checkpoint"])
def test_every_object_handed_to_restore_survives_both_rungs(generations, rung):
    run = generations()
    ctx = run.context("fresh")
    first = Objects(ctx, seed=1)
    assert first.restore(ctx) == 0
    first.train(ctx, 3)
    ctx.save_checkpoint(wait=True)
    before = first.snapshot()
    assert before["sched"]["last_epoch"] == 3 and before["counter"] == 24

    # The next generation builds everything afresh (other initial weights) and restores it.
    ctx = run.context(rung, source_rank=0)
    second = Objects(ctx, seed=2)
    assert second.restore(ctx) == 3 and ctx.step == 3
    assert_same(before, second.snapshot())
    # The scheduler continues where it was: the next step's LR is the one the first would set.
    first.sched.step()
    second.sched.step()
    assert second.opt_g.param_groups[0]["lr"] == first.opt_g.param_groups[0]["lr"]


def test_the_checkpoint_names_each_objects_kind_for_export(generations):
    run = generations()
    ctx = run.context("fresh")
    objects = Objects(ctx, seed=1)
    objects.restore(ctx)
    objects.train(ctx, 1)
    extra = ctx._state.state_dict()["extra"]
    assert json.loads(extra[STATE_KINDS]) == {
        "model": "module", "optimizer": "optimizer", "disc": "module", "opt_d": "optimizer",
        "sched": "stateful", "ema": "module", "counter": "stateful"}


def test_a_checkpoint_without_a_name_the_loop_asks_for_fails_naming_it(generations):
    # DCP refuses the load (the key is missing); the error names it, and nothing is half-loaded.
    run = generations()
    ctx = run.context("fresh")
    model = ctx.prepare_model(nn.Linear(4, 1))
    ctx.restore(model=model)
    ctx.save_checkpoint(wait=True)
    ctx = run.context("checkpoint")
    model = ctx.prepare_model(nn.Linear(4, 1))
    with pytest.raises(CheckpointError, match=r"Missing key in checkpoint state_dict: counter\.seen"):
        ctx.restore(model=model, counter=Counter())


def test_report_without_restore_is_a_typed_error(generations):
    ctx = generations().context("fresh")
    model = ctx.prepare_model(nn.Linear(4, 1))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RestoreRequiredError, match=r"ctx.report\(\) before ctx.restore\(\)"):
        ctx.report(loss=1.0)
    # A loop that returns without restoring what it prepared cannot end as a finish either.
    with pytest.raises(RestoreRequiredError, match="train_loop returned"):
        ctx._finish()


def test_prepared_objects_must_all_reach_restore_by_name(generations):
    ctx = generations().context("fresh")
    a = ctx.prepare_model(nn.Linear(4, 1))
    b = ctx.prepare_model(nn.Linear(4, 1))
    with pytest.raises(StateError, match="2 models were prepared: name each one"):
        ctx.restore()
    with pytest.raises(StateError, match=r"model #1 \(in the order prepared\) were prepared but not handed"):
        ctx.restore(model=a)
    with pytest.raises(StateError, match="same object"):
        ctx.restore(model=a, other=a, b=b)
    with pytest.raises(StateError, match="neither a module, an optimizer"):
        ctx.restore(model=a, b=b, steps=3)
    assert ctx.restore(model=a, teacher=b) == 0


def test_report_and_log_metrics_reach_the_step_records(generations):
    ctx = generations().context("fresh")
    model = ctx.prepare_model(nn.Linear(4, 1))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.25))
    ctx.restore()
    ctx.report(loss=torch.tensor(1.5), accuracy=0.75, grad_norm=torch.tensor(3.0), note="text")
    ctx.log(val_loss=0.5, val_accuracy=torch.tensor(0.9))
    records = ctx._worker.outbox.drain()
    step, logged = records
    assert (step.kind, step.step, step.loss) == ("step", 1, 1.5)
    assert step.metrics == {"accuracy": 0.75, "grad_norm": 3.0, "lr": 0.25}
    assert (logged.kind, logged.step, logged.loss) == ("log", 1, None)
    assert logged.metrics == pytest.approx({"val_loss": 0.5, "val_accuracy": 0.9})
    assert ctx.step == 1 and optimizer is not None   # the log counted no step
    with pytest.raises(StateError, match="metrics.jsonl's own"):
        ctx.report(loss=1.0, step=3)
    with pytest.raises(StateError, match="tensor of 4 elements"):
        ctx.log(val=torch.ones(4))


def test_torchrun_variables_follow_the_generations_placement(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    infos = [WorkerInfo(1, "node-a", "x", "ip"), WorkerInfo(2, "node-b", "y", "ip"), WorkerInfo(3, "node-a", "z", "ip")]
    places = placement(infos)
    assert places == [{"local_rank": 0, "local_world_size": 2, "node_rank": 0},
                      {"local_rank": 0, "local_world_size": 1, "node_rank": 1},
                      {"local_rank": 1, "local_world_size": 2, "node_rank": 0}]
    plan = GenerationPlan(generation=4, rank=2, world_size=3, master_addr="10.0.0.1", master_port=29500,
                          restore=RestorePlan("fresh"), timeout_s=60, **places[2])
    _set_torchrun_environment(plan)
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                       "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_a_loop_that_returns_before_total_steps_stopped_early():
    assert run_status(True, 100, 100) == "finished"
    assert run_status(True, 40, 100) == "stopped_early"
    assert run_status(False, 40, 100) == "failed"


def test_fsdp_models_and_their_optimizers_restore_from_a_checkpoint(generations):
    run = generations(strategy="fsdp")

    def build(ctx, seed):
        torch.manual_seed(seed)
        model = ctx.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
        opt = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        ctx.restore(model=model, optimizer=opt, sched=sched)
        return model, opt, sched

    ctx = run.context("fresh")
    model, opt, sched = build(ctx, 1)
    for _ in range(2):
        model(torch.randn(8, 4)).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ctx.report(loss=0.0)
    ctx.save_checkpoint(wait=True)
    want = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    ctx = run.context("checkpoint")
    model2, opt2, sched2 = build(ctx, 2)
    assert ctx.step == 2 and sched2.last_epoch == 2 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert all(torch.equal(v.full_tensor(), want[k]) for k, v in model2.state_dict().items())
    assert ctx._state.state_dict()["optimizer"]["state"]   # Adam moments came back, keyed by name


def loop_with_dist_and_config(ctx):
    # `dist` plus a `.config` attribute made cloudpickle look for torch.distributed.config, which
    # torch keeps in sys.modules as an object that does not pickle.
    return dist.get_world_size(), ctx.config


def test_a_loop_using_dist_and_ctx_config_pickles_for_the_workers(tmp_path):
    import ray.cloudpickle
    import torch.distributed.config  # noqa: F401  (the stand-in module that broke the pickling)

    from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig
    from elastic.trainer import _ship_user_module_by_value
    _ship_user_module_by_value(loop_with_dist_and_config)    # as fit() does: this file is not installed
    trainer = ElasticTrainer(loop_with_dist_and_config, scaling=ScalingConfig(min_workers=1, max_workers=1),
                             checkpoint=CheckpointConfig(storage=str(tmp_path)), total_steps=1,
                             train_loop_config={"a": 1})
    loop, config = ray.cloudpickle.loads(trainer._pickled_user_code())
    assert config == {"a": 1} and loop.__code__.co_names == loop_with_dist_and_config.__code__.co_names


@pytest.mark.parametrize("patch", ["accumulation", "fp16"])
def test_a_fresh_optimizers_state_has_every_key_despite_the_frameworks_step_patches(one_rank_group, patch):
    # DCP fills an empty optimizer state with a zero-lr step() before saving or loading; the
    # framework's patched step() (a no-op on a non-final micro-step; fp16's scaler, which refuses
    # a step without ctx.backward) must not see it, or a load would skip the Adam moments (or fail).
    from elastic._worker.accumulation import Accumulation, wrap_optimizer
    from elastic._worker.precision import Precision
    from elastic._worker.train_state import Progress, TrainState
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    precision = Precision("fp32", "ddp", torch.device("cpu"), None)
    if patch == "accumulation":
        wrap_optimizer(optimizer, Accumulation(steps=3))        # micro-step 0 of 3: not final
    else:
        precision = Precision("fp16", "ddp", torch.device("cpu"), torch.amp.GradScaler("cpu"))
        precision.prepare_optimizer(optimizer)
    state = TrainState({"model": model, "optimizer": optimizer}, progress=Progress(), precision=precision)
    template = state.state_dict()["optimizer"]["state"]
    assert set(template) == {"model.weight", "model.bias"} and "exp_avg" in template["model.weight"]
    assert "step" in optimizer.__dict__                          # the patch is back in place


@pytest.mark.parametrize("action", ["fail", "ignore"])
def test_a_nonfinite_loss_fails_or_trains_on_and_is_never_committed(generations, action):
    from checkpointing import CheckpointManager
    from elastic import NonFiniteLossError
    run = generations(checkpoint_every=1, on_nonfinite_loss=action)
    ctx = run.context("fresh")
    model = ctx.prepare_model(nn.Linear(4, 1))
    ctx.restore()
    ctx.report(loss=1.0)                                  # step 1: committed
    if action == "fail":
        with pytest.raises(NonFiniteLossError, match="the loss of step 2 is nan"):
            ctx.report(loss=float("nan"))
    else:
        ctx.report(loss=torch.tensor(float("inf")))      # step 2: trains on, not committed
        ctx.report(loss=0.5)                              # step 3: committed
    run.worker.checkpoints.manager.wait()
    committed = [c.step for c in CheckpointManager(run.spec.checkpoint.storage).committed()]
    assert committed == ([1] if action == "fail" else [1, 3])
    assert model is not None


def test_a_commit_before_leaving_that_fails_is_raised_not_left_unseen(generations, monkeypatch):
    from checkpointing import CheckpointError
    run = generations()
    ctx = run.context("fresh")
    ctx.prepare_model(nn.Linear(4, 1))
    ctx.restore()
    ctx.report(loss=1.0)
    manager = run.worker.checkpoints.open(run.spec)
    monkeypatch.setattr(manager, "save", lambda *a, **k: None)    # the save never commits
    ctx._preempted.set()
    with pytest.raises(CheckpointError, match="taken before the group changes, was not committed"):
        ctx.report(loss=1.0)


def test_the_frameworks_state_is_json_in_the_manifest_not_pickled_in_dcp(generations):
    # Reliability review F3: checkpoints are data. The framework's own progress travels as JSON in
    # COMMITTED; Result.checkpoint's URL exports directly.
    from checkpointing import CheckpointManager, export_model_state
    run = generations()
    ctx = run.context("fresh")
    model = ctx.prepare_model(nn.Linear(4, 1))
    ctx.restore()
    ctx.report(loss=1.0)
    ctx.save_checkpoint(wait=True)
    (info,) = CheckpointManager(run.spec.checkpoint.storage).committed()
    extra = info.meta["extra"]
    assert extra["step"] == 1 and extra["world_size"] == 1 and json.loads(extra["state_kinds"]) == {"model": "module"}
    import pickle
    with open(os.path.join(info.path, info.data_dir, ".metadata"), "rb") as f:
        metadata = pickle.load(f)                 # DCP's own format (the trust boundary the README names)
    assert not any(key.startswith("extra") for key in metadata.state_dict_metadata)
    exported = export_model_state(f"{run.spec.checkpoint.storage}/checkpoints/step_00000001")
    assert all(torch.equal(exported[k], v) for k, v in model.module.state_dict().items())


def test_a_checkpoint_of_the_earlier_runtime_resumes(generations):
    # Before the state contract: keys model / optim / extra, the framework's progress pickled in DCP.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from checkpointing import CheckpointManager
    run = generations()
    torch.manual_seed(3)
    old_model = nn.Linear(4, 2)
    old_opt = torch.optim.AdamW(old_model.parameters(), lr=0.1)
    old_model(torch.randn(3, 4)).sum().backward()
    old_opt.step()
    model_sd, optim_sd = get_state_dict(old_model, old_opt)
    manager = CheckpointManager(run.spec.checkpoint.storage, async_save=False)
    manager.save(7, {"model": model_sd, "optim": optim_sd,
                     "extra": {"step": 7, "samples_seen": 56, "data_order": "ab" * 32, "world_size": 1}},
                 generation=0)
    manager.close()
    ctx = run.context("checkpoint")
    model = ctx.prepare_model(nn.Linear(4, 2))
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    assert ctx.restore(model=model, optimizer=optimizer) == 7 and ctx.samples_seen == 56
    assert all(torch.equal(a, b) for a, b in zip(model.module.state_dict().values(),
                                                 old_model.state_dict().values(), strict=True))
    assert ctx._worker.progress.data_order.hexdigest() == "ab" * 32   # a digest saved without a tail
    assert optimizer.state_dict()["state"][0]["step"] == old_opt.state_dict()["state"][0]["step"]


def test_a_save_has_the_held_poll_answer_with_the_steps_up_to_the_saved_one(generations):
    # Before the save's commit can land, so that a group lost right after a commit does not take
    # the records of committed steps with it (chaos smoke: 62 metrics lines lost that way).
    ctx = generations().context("fresh")
    model = ctx.prepare_model(nn.Linear(4, 1))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.25))
    ctx.restore()
    ctx.report(loss=torch.tensor(1.5))
    ctx._worker.outbox.news.clear()
    ctx.report(loss=torch.tensor(1.25))
    assert not ctx._worker.outbox.news.is_set()          # an ordinary step is no news
    ctx.save_checkpoint(wait=True)
    assert ctx._worker.outbox.news.is_set()
    assert [r.step for r in ctx._worker.outbox.drain()] == [1, 2]


def test_answers_the_controller_never_got_are_sent_again_and_received_ones_never():
    from elastic._protocol import StepRecord
    from elastic._worker.state import ANSWERS_KEPT, Outbox

    def record(step):
        return StepRecord(step=step, loss=1.0, world_size=1, time=0.0, samples_seen=step, global_batch=1)
    outbox = Outbox()
    outbox.put(record(1))
    assert outbox.answer(acked=0) == (1, [record(1)])
    outbox.put(record(2))
    assert outbox.answer(acked=1) == (2, [record(2)])              # answer 1 arrived: not again
    outbox.put(record(3))
    # Answer 2 was lost (a node agent died holding it): the next poll still acknowledges 1.
    assert outbox.answer(acked=1) == (3, [record(2), record(3)])
    assert outbox.answer(acked=3) == (4, [])
    outbox.put(record(4))
    outbox.drop_after(3)                                           # a failure lost step 4
    assert outbox.answer(acked=3) == (5, [])
    assert outbox.answer() == (6, [])                              # no acknowledgement: nothing kept
    last = 10 + 2 * ANSWERS_KEPT
    for step in range(10, last):                   # never acknowledged: the newest ANSWERS_KEPT answers kept
        outbox.put(record(step))
        outbox.answer(acked=6)
    # The answer after them (no new record) sends again the ANSWERS_KEPT - 1 kept besides itself.
    assert [r.step for r in outbox.answer(acked=6)[1]] == list(range(last - ANSWERS_KEPT + 1, last))


def _failing_save_at(monkeypatch, failing_step: int) -> None:
    """Every save of `failing_step` fails in storage (a transient 503), the others commit."""
    from checkpointing import StorageError, _save
    real = _save.run_save

    def run_save(job):
        if job.step == failing_step:
            raise StorageError(f"503 SlowDown writing step {job.step}", url=job.storage.url)
        return real(job)
    monkeypatch.setattr(_save, "run_save", run_save)


def test_a_leave_at_a_scheduled_checkpoint_step_checks_that_its_save_committed(generations, monkeypatch):
    """R3-2: the step the group leaves from is also a scheduled checkpoint step: its save is issued
    by the schedule, and the commit check before leaving must still see that it failed."""
    from checkpointing import CheckpointError
    run = generations(checkpoint_every=4)
    ctx = run.context("fresh")
    ctx.prepare_model(nn.Linear(4, 1))
    ctx.restore()
    for _ in range(3):
        ctx.report(loss=1.0)
    _failing_save_at(monkeypatch, 4)
    ctx._preempted.set()                       # a notice to every rank (world 1): leave with a commit
    with pytest.raises(CheckpointError, match="step 4, taken before the group changes, was not committed"):
        ctx.report(loss=1.0)


def test_a_checkpoint_plan_whose_checkpoint_vanished_is_a_storage_error_not_a_start_over(generations):
    """R3-1: the controller planned a restore of step 3; the checkpoint is gone by the time the
    ranks load. Starting over from step 0 silently would throw the run's progress away."""
    from checkpointing import StorageError
    run = generations()
    ctx = run.context("checkpoint", step=3)
    ctx.prepare_model(nn.Linear(4, 1))
    with pytest.raises(StorageError, match="checkpoint of step 3 .* is no longer committed"):
        ctx.restore()
    ctx = run.context("checkpoint")           # nothing planned from a listing: a fresh start, as before
    ctx.prepare_model(nn.Linear(4, 1))
    assert ctx.restore() == 0


def test_a_nonfinite_loss_whose_exchange_the_broken_group_abandoned_is_reported(generations):
    """R3-3: the group breaks before the step's exchange is collected; abandon() still checks its
    loss and hands the error back for the worker to report, and the step is never committed."""
    from elastic import NonFiniteLossError
    run = generations(checkpoint_every=None)
    ctx = run.context("fresh")
    ctx.prepare_model(nn.Linear(4, 1))
    ctx.restore()
    ctx.report(loss=1.0)
    ctx.report(loss=float("nan"))              # its exchange is collected at the next report...
    error = ctx._abandon()                     # ... which never comes: the group broke
    assert isinstance(error, NonFiniteLossError) and "the loss of step 2 is nan" in str(error)
    assert run.worker.checkpoints.nonfinite_step == 2
    ignoring = generations(on_nonfinite_loss="ignore")
    ctx = ignoring.context("fresh")
    ctx.prepare_model(nn.Linear(4, 1))
    ctx.restore()
    ctx.report(loss=float("nan"))
    assert ctx._abandon() is None              # "ignore" trains on


def test_an_fsdp_group_leaving_at_the_final_step_commits_it(generations):
    """R3-9: no copies are taken at the final step, so a group leaving from it (a rescale) does
    not keep that step in memory: it commits it instead of restoring older copies."""
    from elastic._worker.step_boundary import StepOutcome
    run = generations(strategy="fsdp", in_memory_every=100, total_steps=3)
    ctx = run.context("fresh")
    ctx.prepare_model(nn.Linear(4, 1))
    ctx.restore()
    assert not run.worker.warm.capable          # FSDP: no rank holds a full replica
    rescale = StepOutcome(stop=True, preempted=0, commit=False)
    ctx.report(loss=1.0)
    ctx.report(loss=1.0)
    assert ctx._keeper.stays_in_memory(rescale)       # step 2: copies of the step the group leaves from
    ctx.report(loss=1.0)
    assert ctx.step == 3 and not ctx._keeper.stays_in_memory(rescale)

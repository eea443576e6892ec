"""Every object a loop hands to ctx.restore survives a kill and a resume at another world size:
two models, two optimizers, a LambdaLR, an EMA and a user counter (a GAN-like job)."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic import (
    Callback,
    CheckpointConfig,
    ElasticTrainer,
    FailureConfig,
    LRScalingConfig,
    ScalingConfig,
    TensorBoardCallback,
)
from elastic._determinism import state_sha256
from support import SignalAtStep, read_json

pytestmark = [pytest.mark.integration]

BASE_LR = 0.05


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 30) * 0.99 ** step


class Counter:
    def __init__(self):
        self.samples = 0

    def state_dict(self):
        return {"samples": self.samples}

    def load_state_dict(self, state):
        self.samples = int(state["samples"])


def gan_loop(ctx):
    """A generator and a critic, each with its optimizer, a LambdaLR on the generator's, an EMA of
    the generator and a counter; rank 0 writes every object's hash at the end."""
    cfg = ctx.config
    # The torchrun variables describe this generation's group (code written for torchrun reads them).
    env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    assert env == {"RANK": ctx.rank, "WORLD_SIZE": ctx.world_size, "LOCAL_RANK": ctx.local_rank,
                   "LOCAL_WORLD_SIZE": ctx.local_world_size, "GROUP_RANK": ctx.node_rank}, (env, ctx.generation)
    assert ctx.local_world_size == ctx.world_size and ctx.local_rank == ctx.rank   # one node here
    assert dist.get_world_size() == ctx.world_size   # the group the framework formed
    torch.manual_seed(0)
    gen = ctx.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)))
    critic = ctx.prepare_model(nn.Linear(8, 1))
    opt_g = ctx.prepare_optimizer(torch.optim.AdamW(gen.parameters(), lr=BASE_LR))
    # One scheduler built after prepare_optimizer (the guide's order), one before (issue 34: under
    # accumulation the first crashed and the second stepped once per micro-batch).
    raw_c = torch.optim.SGD(critic.parameters(), lr=BASE_LR, momentum=0.9)
    sched_c = torch.optim.lr_scheduler.LambdaLR(raw_c, warmup)
    opt_c = ctx.prepare_optimizer(raw_c)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_g, warmup)
    ema = torch.optim.swa_utils.AveragedModel(gen.module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    counter = Counter()
    data = [torch.randn(8, generator=torch.Generator().manual_seed(i)) for i in range(4096)]
    loader = ctx.prepare_data(data, batch_size=4)
    ctx.restore(model=gen, optimizer=opt_g, critic=critic, opt_c=opt_c, sched=sched, sched_c=sched_c, ema=ema,
                counter=counter)
    for batch in loader:
        lr = opt_g.param_groups[0]["lr"]
        critic(gen(batch)).mean().backward()
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in critic.parameters()])
        opt_g.step()
        opt_c.step()
        opt_g.zero_grad()
        opt_c.zero_grad()
        sched.step()
        sched_c.step()
        ema.update_parameters(gen.module)
        counter.samples += len(batch) * ctx.world_size
        ctx.report(loss=critic(batch).pow(2).mean().detach(), lr=lr, critic_bias=critic.module.bias.detach(),
                   grad_norm=grad_norm)
        if ctx.step % 20 == 0:
            with torch.no_grad():   # the unwrapped modules: a forward outside DDP's training steps
                ctx.log(val_score=float(critic.module(gen.module(batch)).mean()))
        if ctx.step == cfg.get("stop_at"):
            return
    if ctx.rank == 0:
        hashes = {name: state_sha256(_flat(obj.state_dict()))
                  for name, obj in {"gen": gen.module, "critic": critic.module, "opt_g": opt_g, "opt_c": opt_c,
                                    "ema": ema}.items()}
        hashes.update({name: {k: v for k, v in s.state_dict().items() if k != "lr_lambdas"}
                       for name, s in (("sched", sched), ("sched_c", sched_c))},
                      counter=counter.samples, step=ctx.step,
                      optimizer_steps=int(opt_g.state_dict()["state"][0]["step"]))
        with open(cfg["out"], "w") as f:
            json.dump(hashes, f)


def _flat(tree, prefix=""):
    """A nested state dict as {dotted key: value}, for state_sha256."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}{i}.").items()}
    return {prefix: tree}


class Seen(Callback):
    """What the driver-side hooks were given."""

    def __init__(self):
        self.steps, self.logs, self.recoveries, self.ended = [], [], [], []

    def on_step(self, step_info):
        self.steps.append(step_info["step"])

    def on_log(self, log_info):
        self.logs.append(log_info["step"])

    def on_recovery(self, recovery):
        self.recoveries.append(recovery)

    def on_end(self, result):
        self.ended.append(result.status)


def fit(run_dir, out, *, workers, steps, fault=None, spare_workers=0, every=None, stop_at=None, ok=True,
        callbacks=(), lr=None):
    config = {"out": out, "stop_at": stop_at, **(fault.hold_config() if fault is not None else {})}
    if fault is not None:
        fault.start()
    result = ElasticTrainer(
        gan_loop, train_loop_config=config, total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=workers[0], max_workers=workers[1], startup_wait_s=120,
                              spare_workers=spare_workers),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=every),
        failure=FailureConfig(heartbeat_timeout_s=10.0, max_failures=3, rendezvous_timeout_s=60.0),
        callbacks=list(callbacks), lr=lr).fit()
    if fault is not None:
        fault.join(timeout=5)
        assert fault.fired(), f"the fault never fired (run ended at step {result.final_step})"
    assert result.ok == ok, result.error_traceback
    if not os.path.exists(out):
        return result, None
    with open(out) as f:
        return result, json.load(f)


@pytest.mark.timeout(300)
def test_kill_with_a_spare_ends_bitwise_equal_in_every_object(ray_session, tmp_path):
    _, clean = fit(str(tmp_path / "clean"), str(tmp_path / "clean.json"), workers=(3, 3), steps=80)
    faulty_dir = str(tmp_path / "faulty")
    fault = SignalAtStep(faulty_dir, at_step=30, sig=signal.SIGKILL, rank=1, when=lambda status: status["spares"])
    seen = Seen()
    result, faulty = fit(faulty_dir, str(tmp_path / "faulty.json"), workers=(3, 3), steps=80, fault=fault,
                         spare_workers=1, callbacks=[seen, TensorBoardCallback(str(tmp_path / "tb"))])
    (recovery,) = result.summary["recoveries"]
    # Restored at the kill's step with no checkpoint on storage: every object came from a survivor's
    # memory (a loaded machine may also replace a survivor slow to leave the collective: "cold").
    assert recovery["cause"] == "worker_died" and recovery["step"] == 30 and recovery["lost_steps"] == 0, recovery
    assert faulty == clean
    assert clean["sched"]["last_epoch"] == 80 and clean["counter"] == 80 * 12 and clean["step"] == 80
    lines = [json.loads(line) for line in open(os.path.join(faulty_dir, "metrics.jsonl"))]
    steps = [m for m in lines if "kind" not in m]
    assert [m["step"] for m in steps] == list(range(1, 81))
    assert all("critic_bias" in m and m["grad_norm"] > 0 for m in steps)
    assert [m["step"] for m in lines if m.get("kind") == "log"] == [20, 40, 60, 80]
    # The driver's callbacks saw every kept step, the recovery before its first redone step, the end.
    assert seen.steps[-50:] == list(range(31, 81)) and sorted(set(seen.steps)) == list(range(1, 81))
    assert [r["cause"] for r in seen.recoveries] == ["worker_died"] and seen.ended == ["finished"]
    assert seen.logs == [20, 40, 60, 80]
    assert result.metrics.last["val_score"] == [m for m in lines if "val_score" in m][-1]["val_score"]
    assert [s for s, _ in result.metrics.history["grad_norm"]] == list(range(1, 81))
    assert result.checkpoint.endswith("checkpoints/step_00000080")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


@pytest.mark.timeout(300)
def test_under_accumulation_through_a_kill_each_scheduler_steps_once_per_optimizer_step(ray_session, tmp_path):
    """constant_global_batch: 2 micro-batches a step at 3 workers, 3 at 2 after the kill. The loop
    steps both schedulers in its body, which runs per micro-batch: each must advance once per
    optimizer step, built before prepare_optimizer or after (issue 34, Done-means)."""
    run_dir, steps = str(tmp_path / "run"), 40
    fault = SignalAtStep(run_dir, at_step=15, sig=signal.SIGKILL, rank=1)
    result, state = fit(run_dir, str(tmp_path / "out.json"), workers=(2, 3), steps=steps, fault=fault,
                        lr=LRScalingConfig(base_world_size=6, mode="constant_global_batch"))
    assert [r["cause"] for r in result.summary["recoveries"]][:1] == ["worker_died"]
    assert state["step"] == steps and state["optimizer_steps"] == steps
    assert state["sched"]["last_epoch"] == steps and state["sched_c"]["last_epoch"] == steps
    assert state["counter"] == steps * 6 * 4                 # the global batch at every world size


@pytest.mark.timeout(300)
def test_resume_at_another_world_size_continues_the_scheduler(ray_session, tmp_path):
    run_dir = str(tmp_path / "run")
    first, _ = fit(run_dir, str(tmp_path / "a.json"), workers=(2, 2), steps=40, every=20)
    assert first.summary["checkpoints"] == [20, 40]
    second, state = fit(run_dir, str(tmp_path / "b.json"), workers=(3, 3), steps=70)
    assert second.summary["resumed_from"] == 40 and state["sched"]["last_epoch"] == 70
    # The counter went on from the first run's samples, at the new global batch.
    assert state["counter"] == 40 * 8 + 30 * 12
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in lines if m.get("kind") == "log"] == [20, 40, 60]
    lines = [m for m in lines if "kind" not in m]
    assert [m["step"] for m in lines] == list(range(1, 71))
    # Step k ran with the LambdaLR's LR of k-1 steps taken, across the resume.
    assert [m["lr"] for m in lines] == pytest.approx([BASE_LR * warmup(k - 1) for k in range(1, 71)], rel=1e-12)
    assert read_json(run_dir, "summary.json")["world_size_history"][-1] == [40, 3]


@pytest.mark.timeout(120)
def test_a_loop_that_returns_early_ends_stopped_early_not_finished(ray_session, tmp_path):
    result, _ = fit(str(tmp_path / "run"), str(tmp_path / "out.json"), workers=(2, 2), steps=30, stop_at=12, ok=False)
    assert result.status == "stopped_early" and result.final_step == 12 and result.error is None
    summary = read_json(str(tmp_path / "run"), "summary.json")
    assert summary["status"] == "stopped_early" and summary["checkpoints"] == [12]

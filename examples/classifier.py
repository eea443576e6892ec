"""A classifier job ported from Ray Train (or torchrun) to elastic, with every piece a real job has.

    python examples/classifier.py --storage runs/classifier --workers 2:2 --steps 300

A typical `TorchTrainer` job (see README, *Porting from Ray Train and torchrun*), on a task that
needs no download: a two-layer MLP learns which of 4 classes a point belongs to, each class a
mixture of Gaussian blobs in 16 dimensions, drawn from a fixed seed in this script. What it
shows, beside the model and data that a port does not change:

- every stateful object goes through `ctx.restore(...)` by name: the DDP model, AdamW, a
  `LambdaLR` warmup-then-cosine schedule and an EMA of the weights
  (`torch.optim.swa_utils.AveragedModel`); all of them survive a rescale, a kill and a resume;
- `ctx.report(loss=..., accuracy=..., lr=...)`: training metrics, rank means, one line per step
  in `<storage>/metrics.jsonl`;
- validation every `--val-every` steps and at the last step: each rank scores its shard of the
  validation set, the sums are all-reduced, and `ctx.log(val_loss=..., val_accuracy=...,
  ema_val_accuracy=...)` records them at that step without counting one;
- `ctx.prepare_data(..., num_workers=N)`: DataLoader worker processes load batches ahead;
- a driver-side `elastic.Callback` that prints each validation and recovery;
- `Result.ok`, `Result.metrics.last` and `Result.checkpoint`; then
  `elastic export STORAGE --out model.pt` gives the weights to plain torch (see `load_exported`).

Exit code 0 when the run finished, 1 when it failed or stopped early, 2 on a configuration error.
Running it again with the same `--storage` resumes (a larger `--steps` stretches the cosine
from there: the schedule reads `ctx.total_steps`). `--hold-at STEP:FILE` sets the framework's
fault gate (elastic/_worker/fault_gate.py): every rank waits after STEP until FILE exists, so a
test can inject a fault at an exact step; the loop below knows nothing of it.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset

from elastic import Callback, CheckpointConfig, ConfigError, ElasticTrainer, FailureConfig, ScalingConfig
from elastic._worker.fault_gate import HOLD_AT_KEY, HoldAt

# ---- the user's model and data: unchanged by a port --------------------------------------------
DIM, CLASSES, BLOBS_PER_CLASS, HIDDEN = 16, 4, 3, 64
N_TRAIN, N_VAL = 8192, 1024
DATA_SEED = 1234          # the task; --seed changes initial weights and data order, not the task
BASE_LR, WARMUP_STEPS, EMA_DECAY = 3e-3, 20, 0.95


class Blobs(Dataset):
    """`n` points of the fixed task: each class is BLOBS_PER_CLASS Gaussian blobs (unit noise
    around centres drawn from DATA_SEED), so the classes are not linearly separable. The split's
    `seed` picks which points; every process that builds it gets the same tensors."""

    def __init__(self, n: int, seed: int):
        centres = torch.randn(CLASSES * BLOBS_PER_CLASS, DIM, generator=torch.Generator().manual_seed(DATA_SEED)) * 2.0
        g = torch.Generator().manual_seed(seed)
        blob = torch.randint(0, len(centres), (n,), generator=g)
        self.x = centres[blob] + torch.randn(n, DIM, generator=g)
        self.y = blob % CLASSES

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def train_set() -> Blobs:
    return Blobs(N_TRAIN, seed=DATA_SEED + 1)


def validation_set() -> Blobs:
    return Blobs(N_VAL, seed=DATA_SEED + 2)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def build_ema(model: nn.Module) -> AveragedModel:
    """The EMA of `model`'s weights (a copy that `update_parameters` moves towards the model)."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))


def lr_factor(step: int, total_steps: int) -> float:
    """The LambdaLR factor after `step` optimizer steps: linear warmup, then cosine to 0.1."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model: nn.Module, data: Blobs, rank: int = 0, world_size: int = 1) -> tuple[float, float]:
    """(mean loss, accuracy) of `model` on `data`. With world_size > 1 each rank scores every
    world_size-th point from `rank` and the sums are all-reduced (a collective: every rank calls
    it); with 1, plain torch on the whole set."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    x, y = data.x[rank::world_size].to(device), data.y[rank::world_size].to(device)
    logits = model(x)
    sums = torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(-1) == y).sum().float(),
                        torch.tensor(float(len(y)), device=device)]).double()
    if world_size > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


# ---- the training loop: runs on every rank, re-entered after every rescale ---------------------
def train_loop(ctx) -> None:
    """`ctx.config`: batch_size, val_every, loader_workers."""
    cfg = ctx.config
    net = build_model()
    model = ctx.prepare_model(net)            # DDP: `net` is the module it wraps, now on ctx.device
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, ctx.total_steps))
    ema = build_ema(net)                      # not trained across ranks: no prepare_model
    loader = ctx.prepare_data(train_set(), batch_size=cfg["batch_size"], num_workers=cfg["loader_workers"])
    val = validation_set()
    # In place of get_checkpoint() / torch.load / load_state_dict x 4 / start_epoch: whatever the
    # newest state is (a survivor's memory or a committed checkpoint), every object gets its part.
    ctx.restore(model=model, optimizer=optimizer, scheduler=scheduler, ema=ema)
    for x, y in loader:                       # this rank's batches, from ctx.step to total_steps
        x, y = x.to(ctx.device), y.to(ctx.device)
        lr = scheduler.get_last_lr()[0]       # the LR this step runs with
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        ema.update_parameters(net)
        ctx.report(loss=loss, accuracy=(logits.argmax(-1) == y).float().mean(), lr=lr)
        # After report: ctx.step counts this step. Collectives are allowed here.
        if ctx.step % cfg["val_every"] == 0 or ctx.step == ctx.total_steps:
            val_loss, val_accuracy = evaluate(model, val, ctx.rank, ctx.world_size)
            _, ema_accuracy = evaluate(ema.module, val, ctx.rank, ctx.world_size)
            ctx.log(val_loss=val_loss, val_accuracy=val_accuracy, ema_val_accuracy=ema_accuracy)


# ---- after the run: the exported weights in plain torch ----------------------------------------
def load_exported(state: dict) -> tuple[nn.Module, AveragedModel]:
    """The model and its EMA from `elastic export`'s file (`torch.load(path, weights_only=True)`)
    or `checkpointing.export_model_state(...)`: `{"model": state_dict, "ema": state_dict}`, since
    the loop handed two modules to ctx.restore."""
    model = build_model()
    model.load_state_dict(state["model"])
    ema = build_ema(build_model())
    ema.load_state_dict(state["ema"])
    return model, ema


# ---- the driver ---------------------------------------------------------------------------------
class PrintProgress(Callback):
    """Driver-side: one line per validation and per recovery."""

    def on_log(self, log_info: dict) -> None:
        print(f"step {log_info['step']}: val_loss {log_info['val_loss']:.4f}  val_accuracy "
              f"{log_info['val_accuracy']:.4f}  ema_val_accuracy {log_info['ema_val_accuracy']:.4f}", flush=True)

    def on_recovery(self, recovery: dict) -> None:
        print(f"recovered from {recovery['cause']} ({recovery['rung']}): world {recovery['from_world']} -> "
              f"{recovery['to_world']}, going on from step {recovery['step']}", flush=True)


def parse_workers(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers must be MIN:MAX or N, got {text!r}") from None


def parse_hold_at(text: str) -> HoldAt:
    try:
        return HoldAt.parse(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--storage", required=True, help="run directory: local path, file:// or s3://bucket/prefix")
    p.add_argument("--workers", type=parse_workers, default="2:2", help="MIN:MAX workers (or N)")
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps of the run")
    p.add_argument("--checkpoint-every", type=int, default=100, help="commit a checkpoint every K steps")
    p.add_argument("--val-every", type=int, default=50, help="validate every K steps (and at the last step)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    p.add_argument("--loader-workers", type=int, default=2, help="DataLoader worker processes per worker")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order, per-step randomness")
    p.add_argument("--quiet", action="store_true", help="no line per validation and recovery")
    p.add_argument("--hold-at", type=parse_hold_at, metavar="STEP:FILE",
                   help="fault injection (tests): every rank waits after step STEP until FILE exists")
    return p.parse_args(argv)


def build_trainer(args: argparse.Namespace) -> ElasticTrainer:
    """The trainer the flags ask for; invalid values raise ConfigError."""
    low, high = args.workers
    return ElasticTrainer(
        train_loop,
        train_loop_config={"batch_size": args.batch_size, "val_every": args.val_every,
                           "loader_workers": args.loader_workers, HOLD_AT_KEY: args.hold_at},
        # The DataLoader's processes run inside each worker's CPU reservation.
        scaling=ScalingConfig(min_workers=low, max_workers=high),
        checkpoint=CheckpointConfig(storage=args.storage, every_n_steps=args.checkpoint_every, keep=3),
        failure=FailureConfig(max_failures=5),
        total_steps=args.steps, seed=args.seed,
        callbacks=None if args.quiet else [PrintProgress()])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trainer = build_trainer(args)
    except ConfigError as error:
        print(f"configuration error: {error}", file=sys.stderr)
        return 2
    if not os.environ.get("RAY_ADDRESS"):
        import ray
        # A Ray of its own, with a logical CPU per worker even on a small machine.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.workers[1]), include_dashboard=False)
    result = trainer.fit()                   # returns, never raises for a failed run: check ok
    if not result.ok:
        print(f"run {result.status} at step {result.final_step}: {type(result.error).__name__}: {result.error}",
              file=sys.stderr)
        if result.error_traceback:
            print(result.error_traceback, file=sys.stderr)
        return 1
    print(f"finished at step {result.final_step}: val_accuracy {result.metrics.last.get('val_accuracy')}, "
          f"ema_val_accuracy {result.metrics.last.get('ema_val_accuracy')}")
    print(f"checkpoint: {result.checkpoint}")
    print(f"weights for plain torch: elastic export {args.storage} --out model.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())

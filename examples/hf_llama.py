"""A Hugging Face `transformers` Llama, trained elastically under FSDP2 in bf16, exported back to HF.

    python examples/hf_llama.py --storage runs/llama --workers 2:2 --steps 200
    elastic export runs/llama --format hf --out llama-hf     # then LlamaForCausalLM.from_pretrained("llama-hf")

An unmodified `LlamaForCausalLM` built from a `LlamaConfig` (tiny by default, no download; pass
`--config` with any Llama config.json to train that shape from scratch), on a task that needs no
download either: sequences of a fixed first-order Markov "language" over a small vocabulary, so
the loss falls from ln(vocab) towards the chain's entropy. What it shows:

- `ctx.prepare_model(model)` with `ScalingConfig(strategy="fsdp", precision="bf16")`: FSDP2 makes
  each decoder layer (`model.model.layers`, a ModuleList) a shard unit, then the root, and
  computes in bf16 with fp32 master weights;
- `--tp T`: tensor parallelism inside each replica (torch's ColwiseParallel / RowwiseParallel on
  the attention and MLP projections, the plan torchtitan uses for Llama), FSDP over the replicas;
- AdamW with a warmup-then-cosine `LambdaLR`, restored with the model by name (`ctx.restore`);
- `ctx.report(loss=..., lr=...)` per step and `ctx.log(val_loss=...)` every `--val-every` steps;
- the model's `config.json` written to `<storage>/hf/config.json` before training, so that
  `elastic export STORAGE --format hf --out DIR` writes a directory `from_pretrained` reads.

Exit code 0 when the run finished (or was stopped on request), 1 when it failed, 2 on a
configuration error. Running it again with the same `--storage` resumes. `--hold-at STEP:FILE`
is the framework's fault gate (tests): every rank waits after STEP until FILE exists.

Needs `pip install elastic-train[hf]` (transformers, safetensors).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from checkpointing import HF_CONFIG
from checkpointing.storage import Storage
from elastic import CheckpointConfig, ConfigError, ElasticTrainer, FailureConfig, ScalingConfig
from elastic._worker.fault_gate import HOLD_AT_KEY, HoldAt

# ---- the user's model and data ------------------------------------------------------------------
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
SEQ_LEN, N_TRAIN, N_VAL = 32, 4096, 256
DATA_SEED, SUCCESSORS = 4321, 3         # each token is followed by one of 3 tokens: entropy ~ ln 3
BASE_LR, WARMUP_STEPS = 3e-3, 20


def model_config(overrides: dict | None = None):
    from transformers import LlamaConfig
    return LlamaConfig(**{**TINY, **(overrides or {})})


class MarkovTokens(Dataset):
    """`n` sequences of SEQ_LEN + 1 tokens from a fixed Markov chain over `vocab` tokens (its
    transitions drawn from DATA_SEED); the split's `seed` picks the sequences. Every process that
    builds it gets the same tensors."""

    def __init__(self, n: int, seed: int, vocab: int):
        g = torch.Generator().manual_seed(DATA_SEED)
        successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.empty(n, SEQ_LEN + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(1, SEQ_LEN + 1):
            pick = torch.randint(0, SUCCESSORS, (n,), generator=g)
            tokens[:, t] = successors[tokens[:, t - 1], pick]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def train_set(vocab: int) -> MarkovTokens:
    return MarkovTokens(N_TRAIN, DATA_SEED + 1, vocab)


def validation_set(vocab: int) -> MarkovTokens:
    return MarkovTokens(N_VAL, DATA_SEED + 2, vocab)


def lr_factor(step: int, total_steps: int) -> float:
    """The LambdaLR factor after `step` optimizer steps: linear warmup, then cosine to 0.1."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss, HF's own: `labels` shifted inside the model."""
    return model(input_ids=tokens, labels=tokens).loss


def llama_tp_plan(model: nn.Module, tp_mesh) -> None:
    """Megatron-style TP on each decoder layer: q/k/v and gate/up split by output features, o and
    down by input features, so each layer needs one all-reduce per block. HF's attention reshapes
    with -1 heads, so it runs on the local heads unchanged (heads and KV heads divisible by T)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)


@torch.no_grad()
def evaluate(model: nn.Module, data: MarkovTokens, rank: int = 0, world_size: int = 1) -> float:
    """Mean next-token loss on `data`. With world_size > 1 each rank scores every world_size-th
    sequence from `rank` and the sums are all-reduced over every rank (a collective; under TP the
    ranks of a replica score the same sequences, which scales both sums alike)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = data.tokens[rank::world_size].to(device)
    sums = torch.stack([lm_loss(model, tokens).double() * len(tokens), torch.tensor(float(len(tokens)))])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    return (sums[0] / sums[1]).item()


# ---- the training loop: runs on every rank, re-entered after every rescale ----------------------
def train_loop(ctx) -> None:
    """`ctx.config`: batch_size, val_every, model (LlamaConfig overrides)."""
    from transformers import LlamaForCausalLM
    cfg = ctx.config
    config = model_config(cfg["model"])
    model = ctx.prepare_model(LlamaForCausalLM(config), parallelize=llama_tp_plan)
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, ctx.total_steps))
    loader = ctx.prepare_data(train_set(config.vocab_size), batch_size=cfg["batch_size"])
    val = validation_set(config.vocab_size)
    ctx.restore(model=model, optimizer=optimizer, scheduler=scheduler)
    for tokens in loader:
        lr = scheduler.get_last_lr()[0]
        loss = lm_loss(model, tokens.to(ctx.device))
        loss.backward()
        ctx.clip_grad_norm_(1.0)           # torch's own fails under FSDP x TP (gradients on two meshes)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        ctx.report(loss=loss, lr=lr)
        if ctx.step % cfg["val_every"] == 0 or ctx.step == ctx.total_steps:
            ctx.log(val_loss=evaluate(model, val, ctx.dp_rank, ctx.dp_size))


# ---- the driver -----------------------------------------------------------------------------------
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
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps of the run")
    p.add_argument("--checkpoint-every", type=int, default=50, help="commit a checkpoint every K steps")
    p.add_argument("--val-every", type=int, default=50, help="validate every K steps (and at the last step)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a Llama config.json to train from scratch (default: a tiny one)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="FSDP2's compute precision")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order, per-step randomness")
    p.add_argument("--hold-at", type=parse_hold_at, metavar="STEP:FILE",
                   help="fault injection (tests): every rank waits after step STEP until FILE exists")
    return p.parse_args(argv)


def model_overrides(args: argparse.Namespace) -> dict:
    if args.config is None:
        return {}
    with open(args.config) as f:
        return {key: value for key, value in json.load(f).items() if not key.startswith("_")}


def build_trainer(args: argparse.Namespace) -> ElasticTrainer:
    """The trainer the flags ask for; invalid values raise ConfigError."""
    low, high = args.workers
    return ElasticTrainer(
        train_loop,
        train_loop_config={"batch_size": args.batch_size, "val_every": args.val_every,
                           "model": model_overrides(args), HOLD_AT_KEY: args.hold_at},
        scaling=ScalingConfig(min_workers=low, max_workers=high, strategy="fsdp", precision=args.precision,
                              tensor_parallel_size=args.tp),
        checkpoint=CheckpointConfig(storage=args.storage, every_n_steps=args.checkpoint_every, keep=3),
        failure=FailureConfig(max_failures=5),
        total_steps=args.steps, seed=args.seed)


def write_model_config(args: argparse.Namespace) -> None:
    """The model's config.json beside its checkpoints, where `elastic export --format hf` reads it."""
    storage = Storage(args.storage)
    storage.write_atomic(storage.path(HF_CONFIG), model_config(model_overrides(args)).to_json_string().encode())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trainer = build_trainer(args)
    except ConfigError as error:
        print(f"configuration error: {error}", file=sys.stderr)
        return 2
    write_model_config(args)
    if not os.environ.get("RAY_ADDRESS"):
        import ray
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.workers[1]), include_dashboard=False)
    result = trainer.fit()
    if not result.ok:
        print(f"run {result.status} at step {result.final_step}: {type(result.error).__name__}: {result.error}",
              file=sys.stderr)
        return 1
    print(f"{result.status} at step {result.final_step}: val_loss {result.metrics.last.get('val_loss')}")
    print(f"for transformers: elastic export {args.storage} --format hf --out DIR; "
          f"LlamaForCausalLM.from_pretrained(DIR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

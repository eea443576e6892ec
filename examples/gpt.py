"""A small GPT-style model, a synthetic token dataset with learnable structure (in memory, or written
as a Parquet corpus), and the train loop used by examples/pretrain.py, the tests and the benchmarks."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

MODEL_SIZES = {
    # name: (d_model, n_layers, n_heads, seq_len, vocab)
    "tiny": (32, 2, 2, 16, 64),        # tests: ~30k parameters
    "small": (192, 4, 4, 64, 512),     # make run: ~2M parameters
    "base": (256, 6, 8, 128, 1024),    # ~5M parameters
}
MLP_RATIO = 4       # the MLP's hidden width is MLP_RATIO x d_model


@dataclass(frozen=True)
class GPTConfig:
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 64
    vocab: int = 512

    @classmethod
    def named(cls, size: str) -> GPTConfig:
        d, layers, heads, seq, vocab = MODEL_SIZES[size]
        return cls(d_model=d, n_layers=layers, n_heads=heads, seq_len=seq, vocab=vocab)


class Attention(nn.Module):
    """Causal self-attention with separate q, k and v projections, so that a TP plan can shard
    each by columns (whole heads per rank) and `proj` by rows (parallelize_gpt).

    The number of heads is read from the local q's width (`view(b, t, -1, head_dim)`): n_heads
    on an unsharded model, n_heads / T on a rank whose projections hold 1/T of the columns.

    Parameter names: the block's fused `qkv` (d -> 3d) became `attn.q`, `attn.k` and `attn.v`
    (its rows 0:d, d:2d and 2d:3d), and `proj` became `attn.proj`. A checkpoint written before
    that split does not load by name; its `blocks.N.qkv.weight` / `.bias` split in three along
    dim 0 give the new tensors, unchanged otherwise."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        # Initialised from one fused (d -> 3d) draw, as the fused qkv projection this replaced
        # was (skip_init: q, k and v draw nothing of their own), so a seed gives the same initial
        # model, and run, as before the split.
        fused = nn.Linear(d, 3 * d)
        self.q, self.k, self.v = (nn.utils.skip_init(nn.Linear, d, d) for _ in range(3))
        with torch.no_grad():
            for i, linear in enumerate((self.q, self.k, self.v)):
                linear.weight.copy_(fused.weight[i * d:(i + 1) * d])
                linear.bias.copy_(fused.bias[i * d:(i + 1) * d])
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z(x).view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, MLP_RATIO * cfg.d_model), nn.GELU(),
                                 nn.Linear(MLP_RATIO * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """`activation_checkpointing`: each block recomputes its activations in backward
    (torch.utils.checkpoint) instead of keeping them: less memory for about one more forward."""

    def __init__(self, cfg: GPTConfig, *, activation_checkpointing: bool = False):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds some of the units (elastic's prepare_pipeline sets the others to
        # None): a stage after the first gets the previous stage's activations, not token ids.
        x = idx if self.tok is None else self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks if self.blocks is not None else ():
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return x if self.head is None else self.head(x)


def pipeline_split_points(cfg: GPTConfig, stages: int) -> list[str]:
    """Where `stages` pipeline stages begin after the first: the blocks cut as evenly as they go
    (the embeddings ride with the first stage, ln_f and the head with the last). ConfigError
    unless every stage gets a block."""
    from elastic.errors import ConfigError
    if stages > cfg.n_layers:
        raise ConfigError(f"GPTConfig.n_layers={cfg.n_layers} blocks cannot give each of {stages} pipeline stages "
                          f"(pipeline_parallel_size x stages per rank) a block; lower pretrain.py --pp, use a "
                          f"schedule with one stage per rank, or a model with more layers (--model-size)")
    return [f"blocks.{k * cfg.n_layers // stages}" for k in range(1, stages)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, the mean over the batch's positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def check_tensor_parallel(cfg: GPTConfig, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise ConfigError, naming the field and the fix, unless `cfg` splits over `tp`
    tensor-parallel ranks as parallelize_gpt splits it. Cheap and torch-free: the driver calls it
    before any worker starts, so a bad tensor_parallel_size fails in seconds, not in every rank."""
    from elastic.errors import ConfigError
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"GPTConfig.d_model={cfg.d_model} is not a multiple of n_heads={cfg.n_heads}: every head "
                          f"has d_model / n_heads channels; choose d_model and n_heads so that it divides")
    if cfg.n_heads % tp:
        fits = [t for t in range(1, cfg.n_heads + 1) if cfg.n_heads % t == 0]
        raise ConfigError(f"GPTConfig.n_heads={cfg.n_heads} is not divisible by tensor_parallel_size={tp}: each "
                          f"tensor-parallel rank computes n_heads / {tp} whole heads; set tensor_parallel_size "
                          f"(pretrain.py --tp) to one of {fits}, or use a model whose n_heads is a multiple of {tp}")
    # Whole heads per rank make d_model (the columns of q, k, v and the rows of proj) and the
    # MLP's hidden width (MLP_RATIO x d_model) multiples of tp as well: nothing more to check there.
    if sequence_parallel and cfg.seq_len % tp:
        raise ConfigError(f"GPTConfig.seq_len={cfg.seq_len} is not divisible by tensor_parallel_size={tp}: sequence "
                          f"parallelism gives each rank seq_len / {tp} positions between the blocks; turn "
                          f"sequence_parallel off (pretrain.py: leave out --sequence-parallel) or use a seq_len "
                          f"that is a multiple of {tp}")


def parallelize_gpt(model: GPT, tp_mesh, *, sequence_parallel: bool = False) -> GPT:
    """Split `model` in place over the ranks of `tp_mesh` (a 1-D DeviceMesh) by Megatron-style
    tensor parallelism; the `parallelize=` of `ctx.prepare_model`, which wraps the
    data-parallel dimension afterwards.

    In every block the attention's q, k and v are split by columns (each rank holds whole heads)
    and its output projection by rows; the MLP's up projection by columns and its down
    projection by rows: two all-reduces per block forward, and two in backward. With
    `sequence_parallel` the residual stream between blocks is split along the sequence (each
    rank holds seq_len / T positions), and the LayerNorms run on that slice: the all-reduces
    become all-gathers (into attention and MLP) and reduce-scatters (out of them), and
    activations outside attention and MLP take 1/T of the memory (as torchtitan's `apply_tp`).

    The embeddings and the LM head stay whole (plain tensors) on every rank: the vocabulary need
    not divide by T, and the loop's loss reads whole logits. With `sequence_parallel` the final
    LayerNorm runs on each rank's positions too and its output is gathered before the head; the
    LayerNorms' weights are replicated DTensors whose gradients are partial sums over the ranks
    (`full_tensor()`, or any DTensor op such as the optimizer's, adds them up).

    Parameter names do not change: a state dict of the unsharded model loads into this one by
    name (torch.distributed.checkpoint, or set_model_state_dict with full_state_dict=True)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    check_tensor_parallel(model.cfg, tp_mesh.size(), sequence_parallel=sequence_parallel)
    # The layout of the residual stream between blocks: split along the sequence, or whole.
    stream = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel:
        parallelize_module(model, tp_mesh, {
            # The embeddings' whole output becomes this rank's slice of positions (no
            # communication; an all-gather of the gradient in backward).
            "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            "ln_f": SequenceParallel(),
            "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True),
        })
    for block in model.blocks if model.blocks is not None else ():     # a pipeline stage: its own blocks
        plan = {
            # The input becomes one replicated DTensor that q, k and v share: their input gradients
            # add up as one partial sum, reduced once (not once per projection).
            "attn": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=stream),
            "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan |= {"ln1": SequenceParallel(), "ln2": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)
    return model


class SyntheticTokens(torch.utils.data.Dataset):
    """Sequences x[t+1] = (a*x[t] + b) mod vocab with a per-sample rule (a, b): a model that reads the
    first tokens can infer the rule, so the loss falls well below log(vocab). Sample i is a pure
    function of (seed, i)."""

    def __init__(self, n_samples: int, seq_len: int, vocab: int, seed: int = 0):
        self.n, self.seq_len, self.vocab, self.seed = n_samples, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        a = int(torch.randint(0, 4, (1,), generator=g)) * 2 + 1
        b = int(torch.randint(1, 8, (1,), generator=g))
        x = torch.empty(self.seq_len + 1, dtype=torch.long)
        x[0] = int(torch.randint(0, self.vocab, (1,), generator=g))
        for t in range(self.seq_len):
            x[t + 1] = (a * x[t] + b) % self.vocab
        return x


def synthetic_shard(rows: int, seq_len: int, vocab: int, seed: int, shard: int) -> np.ndarray:
    """`rows` sequences of seq_len + 1 tokens with the same per-sample rule as SyntheticTokens
    (vectorised, so a corpus of many thousand samples is written in well under a second)."""
    rng = np.random.default_rng([seed, shard])
    a = rng.integers(0, 4, rows) * 2 + 1
    b = rng.integers(1, 8, rows)
    x = np.empty((rows, seq_len + 1), dtype=np.int64)
    x[:, 0] = rng.integers(0, vocab, rows)
    for t in range(seq_len):
        x[:, t + 1] = (a * x[:, t] + b) % vocab
    return x


def write_synthetic_corpus(url: str, seq_len: int, vocab: int, *, shards: int = 8, rows_per_shard: int = 1024,
                           seed: int = 0, storage_options: dict | None = None) -> dict:
    """Write a synthetic corpus of `shards` Parquet shards under `url` (CORPUS.json last).

    One row group per shard: a new worker reads the whole (small) corpus in a few requests, and
    the dataset's cache holds all of it."""
    from elastic import write_token_shards
    return write_token_shards(url, (synthetic_shard(rows_per_shard, seq_len, vocab, seed, s) for s in range(shards)),
                              row_group_size=rows_per_shard, storage_options=storage_options,
                              extra={"generator": "examples/gpt.py synthetic", "vocab": vocab, "seed": seed})


def ensure_synthetic_corpus(url: str, seq_len: int, vocab: int, seed: int = 0) -> bool:
    """Write the corpus unless `url` already holds a finished one; True if it was written now.

    A folder without the CORPUS.json marker is a write that did not finish: it is removed and
    written again (the content is a pure function of the arguments)."""
    from checkpointing.storage import Storage
    from elastic import read_corpus_marker
    if read_corpus_marker(url) is not None:
        return False
    store = Storage(url)
    store.rm(store.root)
    write_synthetic_corpus(url, seq_len, vocab, seed=seed)
    return True


_DATASETS: dict[tuple[str, int], object] = {}


def _parquet_tokens(url: str, seq_len: int):
    # Kept across generations: a survivor of a rescale re-enters train_loop in the same process
    # and keeps its index and row-group cache instead of reading the corpus again. (A plain dict,
    # not functools.lru_cache: the loop's module travels to the workers by value, and an
    # lru_cache wrapper would be pickled by reference to a module the workers cannot import.)
    from elastic import ParquetTokens
    key = (url, seq_len)
    if key not in _DATASETS:
        _DATASETS.clear()
        _DATASETS[key] = ParquetTokens(url, seq_len)
    return _DATASETS[key]


def make_dataset(cfg: dict, model_cfg: GPTConfig, seed: int):
    """The Parquet corpus at cfg["data"] if given, else the in-memory synthetic tokens."""
    if cfg.get("data"):
        return _parquet_tokens(cfg["data"], model_cfg.seq_len)
    return SyntheticTokens(cfg.get("n_samples", 100_000), model_cfg.seq_len, model_cfg.vocab, seed=seed)


def train_loop(ctx) -> None:
    """The example's loop; `ctx.config` may hold model_size, batch_size, lr, optimizer, n_samples,
    activation_checkpointing, data (URL of a Parquet token corpus), loader_workers (DataLoader worker
    processes) and sequence_parallel (with tensor parallelism); with pipeline parallelism
    pp_schedule and microbatches. Precision comes from ScalingConfig through ctx.autocast/backward,
    the tensor- and pipeline-parallel degrees from ScalingConfig through ctx.tp_size and ctx.pp_size."""
    cfg = dict(ctx.config or {})
    model_cfg = GPTConfig.named(cfg.get("model_size", "small"))
    model = GPT(model_cfg, activation_checkpointing=bool(cfg.get("activation_checkpointing")))
    plan = functools.partial(parallelize_gpt, sequence_parallel=bool(cfg.get("sequence_parallel")))
    if ctx.pp_size > 1:
        _pipeline_loop(ctx, cfg, model, model_cfg, plan if ctx.tp_size > 1 else None)
        return
    if ctx.tp_size > 1:
        model = ctx.prepare_model(model, parallelize=plan)
    else:
        model = ctx.prepare_model(model)
    optimizer = _optimizer(ctx, cfg, model.parameters())
    data = make_dataset(cfg, model_cfg, ctx.seed)
    loader = ctx.prepare_data(data, batch_size=cfg.get("batch_size", 8), num_workers=cfg.get("loader_workers", 0))
    ctx.restore(model=model, optimizer=optimizer)
    for batch in loader:
        batch = batch.to(ctx.device)
        with ctx.autocast():
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        ctx.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.report(loss=loss, lr=optimizer.param_groups[0]["lr"])


def _optimizer(ctx, cfg: dict, params):
    # "sgd" (momentum 0.9): an update proportional to the gradient, for tests that compare models.
    opt_class = {"adamw": torch.optim.AdamW, "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)}
    return ctx.prepare_optimizer(opt_class[cfg.get("optimizer", "adamw")](params, lr=cfg.get("lr", 3e-3)))


def _pipeline_loop(ctx, cfg: dict, model: GPT, model_cfg: GPTConfig, plan) -> None:
    """The loop under pipeline parallelism (ScalingConfig.pipeline_parallel_size > 1): the
    schedule runs forward and backward over the batch's micro-batches; the rest is the same loop.
    Parameter names are the whole model's, so a checkpoint moves to and from the loop above."""
    schedule = cfg.get("pp_schedule", "1f1b")
    per_rank = 2 if schedule == "interleaved1f1b" else 1
    pipeline = ctx.prepare_pipeline(model, split_points=pipeline_split_points(model_cfg, ctx.pp_size * per_rank),
                                    loss_fn=lm_loss, microbatches=cfg.get("microbatches", ctx.pp_size),
                                    schedule=schedule, stages_per_rank=per_rank, parallelize=plan)
    optimizer = _optimizer(ctx, cfg, pipeline.parameters())
    data = make_dataset(cfg, model_cfg, ctx.seed)
    loader = ctx.prepare_data(data, batch_size=cfg.get("batch_size", 8), num_workers=cfg.get("loader_workers", 0))
    ctx.restore(model=pipeline, optimizer=optimizer)
    for batch in loader:
        batch = batch.to(ctx.device)
        loss = pipeline.step(batch[:, :-1], batch[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.report(loss=loss, lr=optimizer.param_groups[0]["lr"])


def parameter_count(cfg: GPTConfig) -> int:
    return sum(p.numel() for p in GPT(cfg).parameters())


if __name__ == "__main__":
    for name in MODEL_SIZES:
        print(name, parameter_count(GPTConfig.named(name)), "parameters; log(vocab) =",
              round(math.log(GPTConfig.named(name).vocab), 2))

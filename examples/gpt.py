"""A small GPT-style model, a synthetic token dataset with learnable structure (in memory, or written
as a Parquet corpus), and the train loop used by examples/pretrain.py, the tests and the benchmarks."""
from __future__ import annotations

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


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
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
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


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
    activation_checkpointing, data (URL of a Parquet token corpus) and loader_workers (DataLoader worker
    processes). Precision comes from ScalingConfig through ctx.autocast/backward."""
    cfg = dict(ctx.config or {})
    model_cfg = GPTConfig.named(cfg.get("model_size", "small"))
    model = ctx.prepare_model(GPT(model_cfg, activation_checkpointing=bool(cfg.get("activation_checkpointing"))))
    # "sgd" (momentum 0.9): an update proportional to the gradient, for tests that compare models.
    opt_class = {"adamw": torch.optim.AdamW, "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)}
    optimizer = ctx.prepare_optimizer(
        opt_class[cfg.get("optimizer", "adamw")](model.parameters(), lr=cfg.get("lr", 3e-3)))
    data = make_dataset(cfg, model_cfg, ctx.seed)
    loader = ctx.prepare_data(data, batch_size=cfg.get("batch_size", 8), num_workers=cfg.get("loader_workers", 0))
    ctx.restore(model=model, optimizer=optimizer)
    for batch in loader:
        batch = batch.to(ctx.device)
        with ctx.autocast():
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        ctx.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.report(loss=loss, lr=optimizer.param_groups[0]["lr"])


def parameter_count(cfg: GPTConfig) -> int:
    return sum(p.numel() for p in GPT(cfg).parameters())


if __name__ == "__main__":
    for name in MODEL_SIZES:
        print(name, parameter_count(GPTConfig.named(name)), "parameters; log(vocab) =",
              round(math.log(GPTConfig.named(name).vocab), 2))

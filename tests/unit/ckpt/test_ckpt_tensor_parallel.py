"""Checkpoints of tensor-parallel models (TP inside data-parallel replicas), on gloo ranks.

A tiny model (two pre-norm MLP blocks: LayerNorm, up, down) trained two AdamW steps as TP 2 x
DP 2 in each strategy, with DTensor parameters on a 2-D mesh:
  - "DDP x TP": mesh (dp_replicate, tp), parallelize_module on mesh["tp"], then replicate_with_fsdp
    on mesh["dp_replicate"]: placements (Replicate(), Shard(0)), (Replicate(), Shard(1)),
    (Replicate(), Replicate()), and (Replicate(),) on the 1-D dp mesh for the LayerNorms;
  - "FSDP x TP": mesh (dp_shard, tp), parallelize_module, then fully_shard on mesh["dp_shard"]:
    (_StridedShard(0, sf=2), Shard(0)), (Shard(0), Shard(1)), (Shard(0), Replicate()), (Shard(0),).
The state is built as elastic's TrainState builds it (get_model_state_dict, and
get_optimizer_state_dict over a ModuleDict of the modules) and saved with CheckpointManager (async:
the staged host copy is what DCP writes) to a file:// directory; then loaded with load_latest and
set_model_state_dict / set_optimizer_state_dict at other layouts: TP 2 -> 1 (DP 2 under
fully_shard and replicate, 1 rank plain), TP 1 -> 2 (plain DDP and fully_shard at DP 2 into
TP 2 x DP 1), and DDP x TP <-> FSDP x TP. Every parameter and AdamW state tensor (full_tensor())
must equal the saved run's exactly, and one more step on the same batch must give the saved run's
next parameters within fp tolerance. The TP checkpoints also export (`elastic export`) to one
file that plain torch.load loads into the plain model with load_state_dict(strict=True).

Rank processes: torch.multiprocessing's spawn context, one spawn per world size running every
operation of that size in order; rank 0's store binds a port the OS picks. A rank that fails
writes its traceback and the others are killed at once; none is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback

import pytest
import torch
from torch import nn

from support import wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

DIM, HIDDEN, BATCH = 8, 16, 8
TRAIN_STEPS = 2          # AdamW steps before the save
NEXT = 100               # the batch of the step after a save / a load
KINDS = json.dumps({"model": "module", "optimizer": "optimizer"})
TP_PLAN_NAMES = [f"b{i}.{name}" for i in range(2) for name in ("up", "down")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b0 = Block()
        self.b1 = Block()

    def forward(self, x):
        return self.b1(self.b0(x))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


# ---- one rank's side ------------------------------------------------------------------------------
class Layout:
    """strategy: "ddp" (replicate_with_fsdp on the dp mesh), "fsdp" (fully_shard), "torch_ddp"
    (torch's DistributedDataParallel, plain tensors: the state of the unwrapped module), "plain"
    (one rank, no wrapper)."""

    def __init__(self, strategy: str, dp: int, tp: int) -> None:
        self.strategy, self.dp, self.tp = strategy, dp, tp

    def __repr__(self) -> str:
        return f"{self.strategy}:dp{self.dp}xtp{self.tp}"


def _build(layout: Layout, seed: int):
    """(model, forward module, dp rank) at `layout`; every layout starts from the same full
    parameters for the same seed."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(seed)
    model = Net()
    forward: nn.Module = model
    dp_dim = "dp_shard" if layout.strategy == "fsdp" else "dp_replicate"
    dp_mesh = None
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=(dp_dim, "tp"))
        parallelize_module(model, mesh["tp"], {name: ColwiseParallel() if name.endswith("up") else RowwiseParallel()
                                               for name in TP_PLAN_NAMES})
        dp_mesh = mesh[dp_dim]
    elif layout.strategy in ("ddp", "fsdp"):
        dp_mesh = init_device_mesh("cpu", (layout.dp,), mesh_dim_names=(dp_dim,))
    if layout.strategy == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        replicate(model, mesh=dp_mesh)
    elif layout.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=dp_mesh)
    elif layout.strategy == "torch_ddp":
        forward = nn.parallel.DistributedDataParallel(model)
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else (
        torch.distributed.get_rank() if layout.strategy == "torch_ddp" else 0)
    return model, forward, dp_rank


class _Rank:
    """One layout's model and optimizer on this rank, the state as elastic's TrainState has it."""

    def __init__(self, layout: Layout, seed: int) -> None:
        self.layout = layout
        self.model, self.forward, self.dp_rank = _build(layout, seed)
        self.container = nn.ModuleDict({"model": self.model})
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.02, weight_decay=0.1)

    def step(self, step: int) -> None:
        x, y = batch(step)
        n = BATCH // self.layout.dp
        rows = slice(self.dp_rank * n, (self.dp_rank + 1) * n)
        nn.functional.mse_loss(self.forward(x[rows]), y[rows]).backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        return {"model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.container, self.opt)}

    def load(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.container, self.opt, state["optimizer"])

    def snapshot(self) -> dict:
        """Full tensors of every parameter and optimizer state value, by name (a collective)."""
        from torch.distributed.tensor import DTensor

        def full(t):
            t = t.full_tensor() if isinstance(t, DTensor) else t
            return t.detach().clone() if isinstance(t, torch.Tensor) else torch.tensor(t)
        state = self.state()
        out = {f"param {k}": full(v) for k, v in state["model"].items()}
        for fqn, per_param in state["optimizer"]["state"].items():
            out.update({f"optim {fqn}.{k}": full(v) for k, v in per_param.items()})
        return out

    def params(self) -> dict:
        return {k: v for k, v in self.snapshot().items() if k.startswith("param ")}


def _manager(url: str):
    from checkpointing import CheckpointManager
    return CheckpointManager(url, keep=None, async_save=True, collective_timeout_s=60)


def _save(layout: Layout, url: str) -> dict:
    """Train TRAIN_STEPS steps at `layout`, saving after each (the later saves reuse the staged
    buffers and DCP's cached plans); returns the last save's state and the next step's params."""
    r = _Rank(layout, seed=0)
    mgr = _manager(url)
    meta = {"extra": {"state_kinds": KINDS, "world_size": torch.distributed.get_world_size()}}
    for s in range(TRAIN_STEPS):
        r.step(s)
        saved = r.snapshot()
        mgr.save(s + 1, r.state(), generation=0, meta=meta)
    r.step(NEXT)  # in-place updates while the upload may still run: the staged copy is saved
    assert mgr.wait() is not None, mgr.last_error
    mgr.close()
    return {"state": saved, "next": r.params()}


def _load(layout: Layout, url: str) -> dict:
    """A fresh (differently initialised) model at `layout`, loaded from `url`, then one step."""
    r = _Rank(layout, seed=1)
    state = r.state()
    mgr = _manager(url)
    result = mgr.load_latest(state)
    mgr.close()
    assert result is not None and result.step == TRAIN_STEPS, result
    r.load(state)
    loaded = r.snapshot()
    r.step(NEXT)
    return {"state": loaded, "next": r.params()}


def _unaddressable(url: str) -> dict:
    """A 1-D mesh of two ranks, a tensor of 8 under _StridedShard(0, sf=2): rank 0 holds global
    rows {0, 1, 4, 5}, rank 1 {2, 3, 6, 7}, not blocks. Load a plain checkpoint into it, and save it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    mesh = init_device_mesh("cpu", (2,))
    placements = [_StridedShard(0, split_factor=2)]
    mgr = _manager(f"{url}/plain")
    mgr.save(1, {"t": torch.arange(8.0)}, generation=0)
    assert mgr.wait() is not None, mgr.last_error
    target = distribute_tensor(torch.zeros(8), mesh, placements)
    try:
        mgr.load_latest({"t": target})
        load_error = ""
    except Exception as e:  # noqa: BLE001 - reported to the test process
        load_error = f"{type(e).__name__}: {e}"
    mgr.close()
    mgr = _manager(f"{url}/strided")
    mgr.save(1, {"t": distribute_tensor(torch.arange(8.0), mesh, placements)}, generation=0)
    committed = mgr.wait()
    mgr.close()
    return {"load_error": load_error, "loaded": target.full_tensor(), "save_committed": committed is not None,
            "save_error": f"{type(mgr.last_error).__name__}: {mgr.last_error}"}


_OPS = {"save": _save, "load": _load, "unaddressable": lambda layout, url: _unaddressable(url)}


def _rank_main(rank: int, world: int, ports, ops: list, out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
            for _ in range(world - 1):
                ports.put(store.port)
        else:
            store = dist.TCPStore("127.0.0.1", ports.get(timeout=60), world, False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            for op, layout, url, label in ops:
                result = _OPS[op](layout, url)
                if rank == 0:
                    torch.save(result, os.path.join(out_dir, f"{label}.pt"))
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error-rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _run_ranks(world: int, ops: list, out_dir, timeout_s: float = 75.0) -> None:
    """`ops` on `world` spawned ranks; a failed rank fails the test with its traceback at once."""
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    ports = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, ports, ops, str(out_dir)), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        # Until every rank ended or one failed; past the deadline the ranks left are killed below.
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not any(p.is_alive() for p in procs)
                     or any(p.exitcode not in (None, 0) for p in procs), timeout_s, "the ranks to end")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    errors = sorted(out_dir.glob("error-rank*.txt"))
    codes = [p.exitcode for p in procs]
    assert not errors and codes == [0] * world, (
        f"ranks exited {codes}\n" + "\n".join(f"{e.name}:\n{e.read_text()}" for e in errors))


# ---- the test process's side ----------------------------------------------------------------------
def _result(out_dir, label: str) -> dict:
    return torch.load(out_dir / f"{label}.pt", weights_only=True)


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: not the saved values: {differ}"


def _assert_close_params(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{what}: {k}: {m}")


def _load_in_process(url: str) -> dict:
    """One rank (a world of one in this process): the plain model."""
    r = _Rank(Layout("plain", 1, 1), seed=1)
    state = r.state()
    mgr = _manager(url)
    result = mgr.load_latest(state)
    mgr.close()
    assert result is not None and (result.step, result.world_size) == (TRAIN_STEPS, 4)
    r.load(state)
    loaded = r.snapshot()
    r.step(NEXT)
    return {"state": loaded, "next": r.params()}


def test_tp2_x_dp2_checkpoints_load_at_other_layouts_and_export(one_rank_group, tmp_path):
    ckpt = {s: f"file://{tmp_path}/run-{s}" for s in ("ddp", "fsdp")}
    tp2 = {s: Layout(s, 2, 2) for s in ("ddp", "fsdp")}
    other = {"ddp": "fsdp", "fsdp": "ddp"}
    _run_ranks(4, [("save", tp2["ddp"], ckpt["ddp"], "saved-ddp"),
                   ("save", tp2["fsdp"], ckpt["fsdp"], "saved-fsdp"),
                   # DDP x TP <-> FSDP x TP
                   ("load", tp2["fsdp"], ckpt["ddp"], "ddp->fsdp:dp2xtp2"),
                   ("load", tp2["ddp"], ckpt["fsdp"], "fsdp->ddp:dp2xtp2")], tmp_path)
    # TP 2 -> 1 at DP 2, under each strategy
    _run_ranks(2, [("load", Layout(strategy, 2, 1), ckpt[src], f"{src}->{strategy}:dp2xtp1")
                   for src in ("ddp", "fsdp") for strategy in ("ddp", "fsdp")], tmp_path)
    saved = {s: _result(tmp_path, f"saved-{s}") for s in ("ddp", "fsdp")}
    # Both strategies trained the same model on the same batches.
    _assert_close_params(saved["ddp"]["next"], saved["fsdp"]["next"], "DDP x TP vs FSDP x TP")
    for src in ("ddp", "fsdp"):
        loads = {f"{src}->{other[src]}:dp2xtp2": _result(tmp_path, f"{src}->{other[src]}:dp2xtp2")}
        for strategy in ("ddp", "fsdp"):
            loads[f"{src}->{strategy}:dp2xtp1"] = _result(tmp_path, f"{src}->{strategy}:dp2xtp1")
        loads[f"{src}->plain:1 rank"] = _load_in_process(ckpt[src])   # TP 2 -> 1 on one rank
        for what, got in loads.items():
            _assert_same_state(got["state"], saved[src]["state"], what)
            _assert_close_params(got["next"], saved[src]["next"], what)

    # Export: one unsharded file that plain torch loads into the plain model, strictly.
    from checkpointing import export
    from elastic.__main__ import main
    out = tmp_path / "fsdp.pt"
    assert main(["export", ckpt["fsdp"], "--out", str(out)]) == 0
    result = export(ckpt["ddp"], tmp_path / "ddp.pt")
    assert (result.step, result.world_size, result.modules) == (TRAIN_STEPS, 4, ["model"])
    for path, src in ((out, "fsdp"), (tmp_path / "ddp.pt", "ddp")):
        sd = torch.load(path, weights_only=True)
        assert all(type(t) is torch.Tensor for t in sd.values())
        plain = Net()
        plain.load_state_dict(sd, strict=True)
        want = {k.removeprefix("param "): v for k, v in saved[src]["state"].items() if k.startswith("param ")}
        _assert_same_state(dict(plain.state_dict()), want, f"export of {src}")


def test_dp2_checkpoints_load_at_tp2(tmp_path):
    """TP 1 -> 2: plain DDP (plain tensors) and fully_shard at DP 2, loaded at TP 2 x DP 1 in
    both TP strategies."""
    ckpt = {s: f"file://{tmp_path}/run-{s}" for s in ("torch_ddp", "fsdp")}
    ops = [("save", Layout(s, 2, 1), ckpt[s], f"saved-{s}") for s in ckpt]
    ops += [("load", Layout(strategy, 1, 2), ckpt[src], f"{src}->{strategy}:dp1xtp2")
            for src in ckpt for strategy in ("ddp", "fsdp")]
    _run_ranks(2, ops, tmp_path)
    for src in ckpt:
        saved = _result(tmp_path, f"saved-{src}")
        for strategy in ("ddp", "fsdp"):
            what = f"{src}->{strategy}:dp1xtp2"
            got = _result(tmp_path, what)
            _assert_same_state(got["state"], saved["state"], what)
            _assert_close_params(got["next"], saved["next"], what)


def test_a_layout_dcp_cannot_address_is_refused_not_loaded_wrong(tmp_path):
    """DCP (torch 2.13) addresses a rank's DTensor shard as one block (first global offset, local
    shape). Into a _StridedShard whose shards are not blocks, DCP's load put rows 0-3 where
    {0, 1, 4, 5} / {2, 3, 6, 7} belong, silently: load_latest now refuses it on every rank, and
    a failed save names the DTensor (DCP itself says only "overlapping chunks")."""
    _run_ranks(2, [("unaddressable", None, f"file://{tmp_path}/run", "unaddressable")], tmp_path)
    got = _result(tmp_path, "unaddressable")
    assert "refusing to load step 1" in got["load_error"] and "t (_StridedShard(dim=0, sf=2),)" in got["load_error"]
    assert torch.equal(got["loaded"], torch.zeros(8))  # untouched, not filled wrong
    assert not got["save_committed"]
    assert "overlapping chunks" in got["save_error"] and "layout DCP cannot address" in got["save_error"]

"""The example GPT's tensor-parallel plan (examples/gpt.py: parallelize_gpt, check_tensor_parallel):
on 2 gloo ranks the split model computes the unsharded model's loss and gradients, with and
without sequence parallelism, and loads the unsharded model's state dict by name; the check
refuses models that do not split, naming the field and the fix; the loop hands the plan to
prepare_model only under tensor parallelism."""
from __future__ import annotations

import functools
import json
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import gpt
from elastic.errors import ConfigError

TP = 2
TOLERANCE = 1e-5
RANK_TIMEOUT_S = 60.0
# 4 heads, so that each of the 2 ranks computes 2 (a per-rank head count of 1 would hide a
# view that mixes heads up); small enough for a 2-core machine.
CFG = gpt.GPTConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, vocab=64)
# name: (sequence_parallel, activation_checkpointing). One pair of rank processes runs them all:
# their start (importing torch twice on 2 cores) costs more than the comparisons.
VARIANTS = {"tp": (False, False), "tp+sequence_parallel+activation_checkpointing": (True, True)}


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _compare(sequence_parallel: bool, activation_checkpointing: bool) -> dict:
    """This rank's view of the TP model against the unsharded one (each rank builds the latter
    whole: the same seed gives the same model and batch everywhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    reference = gpt.GPT(CFG, activation_checkpointing=activation_checkpointing)
    # Another seed, then the reference's weights loaded by name: the plain model's state dict
    # must load into the split one (and the comparison below fails if it did not).
    torch.manual_seed(1)
    split = gpt.GPT(CFG, activation_checkpointing=activation_checkpointing)
    gpt.parallelize_gpt(split, init_device_mesh("cpu", (TP,)), sequence_parallel=sequence_parallel)
    set_model_state_dict(split, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    batch = torch.randint(0, CFG.vocab, (4, CFG.seq_len + 1), generator=torch.Generator().manual_seed(2))

    reference_loss, split_loss = _loss(reference, batch), _loss(split, batch)
    reference_loss.backward()
    split_loss.backward()

    grads = dict(reference.named_parameters())
    diffs, sharded = {}, {}
    for name, param in split.named_parameters():
        assert param.grad is not None, f"{name}: no gradient"
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        diffs[name] = (grad - grads[name].grad).abs().max().item()
        if isinstance(param, DTensor):
            sharded[name] = list(param.to_local().shape)
    return {"losses": [reference_loss.item(), split_loss.item()], "diffs": diffs, "sharded": sharded,
            "names": [list(reference.state_dict()), list(split.state_dict())]}


def _rank(rank: int, port: int, out_dir: str) -> None:
    """One rank: its result, or the traceback of its failure, goes to rank<r>.json (the test
    reads it; an exit code alone would say nothing of what differed)."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=TP, timeout=timedelta(seconds=30))
        try:
            result = {name: _compare(*options) for name, options in VARIANTS.items()}
        finally:
            dist.destroy_process_group()
    except BaseException:       # noqa: BLE001 - any failure is the test's to report
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run_ranks(out_dir: Path) -> list[dict]:
    """TP rank processes (spawned: a fork of a process that has run torch ops is unsafe), their
    results per rank; none is left running, whatever happens."""
    # The store's server lives here on a port the OS picks: no port chosen free beforehand that
    # another test could take before it is bound.
    store = dist.TCPStore("127.0.0.1", 0, world_size=TP + 1, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    procs = [context.Process(target=_rank, args=(rank, store.port, str(out_dir)), daemon=True)
             for rank in range(TP)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + RANK_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        assert not any(p.is_alive() for p in procs), f"a rank ran past {RANK_TIMEOUT_S} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        del store
    results = []
    for rank, p in enumerate(procs):
        path = out_dir / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result (exit code {p.exitcode})"
        result = json.loads(path.read_text())
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
        results.append(result)
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_split_model_has_the_unsharded_loss_and_gradients(tmp_path):
    d, hidden = CFG.d_model, gpt.MLP_RATIO * CFG.d_model
    for rank, results in enumerate(_run_ranks(tmp_path)):
        assert set(results) == set(VARIANTS)
        for variant, result in results.items():
            where = f"{variant}, rank {rank}"
            sequence_parallel = VARIANTS[variant][0]
            reference_names, split_names = result["names"]
            assert split_names == reference_names, f"{where}: parameter names differ from the unsharded model's"
            # q, k, v and the MLP's up projection hold half of the output features on each rank,
            # proj and the MLP's down projection half of the input features.
            sharded = result["sharded"]
            for layer in range(CFG.n_layers):
                prefix = f"blocks.{layer}."
                assert sharded[prefix + "attn.q.weight"] == [d // TP, d], where
                assert sharded[prefix + "attn.v.bias"] == [d // TP], where
                assert sharded[prefix + "attn.proj.weight"] == [d, d // TP], where
                assert sharded[prefix + "mlp.0.weight"] == [hidden // TP, d], where
                assert sharded[prefix + "mlp.2.weight"] == [d, hidden // TP], where
                # Sequence parallelism makes the norms (replicated) DTensors, else they stay plain.
                assert (prefix + "ln1.weight" in sharded) == sequence_parallel, where
            reference_loss, split_loss = result["losses"]
            assert abs(split_loss - reference_loss) <= TOLERANCE, f"{where}: loss {split_loss} != {reference_loss}"
            assert len(result["diffs"]) == len(reference_names)
            worst = {name: diff for name, diff in result["diffs"].items() if not diff <= TOLERANCE}
            assert not worst, f"{where}: gradients differ from the unsharded model's by more than {TOLERANCE}: {worst}"


def test_check_tensor_parallel_names_the_field_and_the_fix():
    gpt.check_tensor_parallel(CFG, 1)
    gpt.check_tensor_parallel(CFG, 4, sequence_parallel=True)
    for size in gpt.MODEL_SIZES:        # every named size splits over its head count
        named = gpt.GPTConfig.named(size)
        gpt.check_tensor_parallel(named, named.n_heads, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"n_heads=4 is not divisible by tensor_parallel_size=3.*\[1, 2, 4\]"):
        gpt.check_tensor_parallel(CFG, 3)
    with pytest.raises(ConfigError, match=r"n_heads=2 .*--tp"):
        gpt.check_tensor_parallel(gpt.GPTConfig.named("tiny"), 4)
    with pytest.raises(ConfigError, match="d_model=30 is not a multiple of n_heads=4"):
        gpt.check_tensor_parallel(gpt.GPTConfig(d_model=30, n_heads=4), 2)
    odd_sequence = gpt.GPTConfig(d_model=32, n_heads=4, seq_len=18)
    gpt.check_tensor_parallel(odd_sequence, 4)      # only sequence parallelism splits the sequence
    with pytest.raises(ConfigError, match="seq_len=18 is not divisible by tensor_parallel_size=4.*--sequence-parallel"):
        gpt.check_tensor_parallel(odd_sequence, 4, sequence_parallel=True)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="tensor_parallel_size must be an int >= 1"):
            gpt.check_tensor_parallel(CFG, bad)


def test_split_projections_start_as_the_fused_qkv_did():
    """q, k and v are rows of one fused (d -> 3d) draw, as the fused qkv projection they replaced
    was, and draw nothing else: a seed gives the model it gave before the split."""
    torch.manual_seed(0)
    attention = gpt.Attention(CFG)
    after_split = torch.rand(3)
    torch.manual_seed(0)
    fused = nn.Linear(CFG.d_model, 3 * CFG.d_model)
    proj = nn.Linear(CFG.d_model, CFG.d_model)
    assert torch.equal(torch.cat([attention.q.weight, attention.k.weight, attention.v.weight]), fused.weight)
    assert torch.equal(torch.cat([attention.q.bias, attention.k.bias, attention.v.bias]), fused.bias)
    assert torch.equal(attention.proj.weight, proj.weight)
    assert torch.equal(after_split, torch.rand(3))


class _Stop(Exception):
    pass


class _LoopContext:
    """What train_loop reads of the context up to prepare_model, which records its arguments and
    stops the loop."""

    def __init__(self, config: dict, **attributes):
        self.config = config
        self.pp_size = 1
        self.__dict__.update(attributes)
        self.calls: list[dict] = []

    def prepare_model(self, model, **options):
        self.calls.append(options)
        raise _Stop

    def prepare_pipeline(self, model, **options):
        self.calls.append(options)
        raise _Stop


@pytest.mark.parametrize(("attributes", "expected"), [
    ({"tp_size": 1}, {}),
    ({"tp_size": 2}, {"sequence_parallel": False}),
    ({"tp_size": 2, "sp": True}, {"sequence_parallel": True}),
])
def test_loop_passes_the_plan_only_under_tensor_parallelism(attributes, expected):
    attributes = dict(attributes)
    config = {"model_size": "tiny", "sequence_parallel": attributes.pop("sp", False)}
    ctx = _LoopContext(config, **attributes)
    with pytest.raises(_Stop):
        gpt.train_loop(ctx)
    (options,) = ctx.calls
    if not expected:
        assert options == {}
    else:
        plan = options["parallelize"]
        assert isinstance(plan, functools.partial) and plan.func is gpt.parallelize_gpt
        assert plan.keywords == expected


@pytest.mark.parametrize(("tp_size", "schedule", "points"), [
    (1, "1f1b", ["blocks.1"]),
    (2, "gpipe", ["blocks.1"]),
])
def test_loop_under_pipeline_parallelism_splits_the_blocks_and_passes_the_plan_only_under_tp(tp_size, schedule,
                                                                                             points):
    ctx = _LoopContext({"model_size": "tiny", "pp_schedule": schedule, "microbatches": 4}, tp_size=tp_size, pp_size=2)
    with pytest.raises(_Stop):
        gpt.train_loop(ctx)
    (options,) = ctx.calls
    assert options["split_points"] == points and options["schedule"] == schedule
    assert options["microbatches"] == 4 and options["loss_fn"] is gpt.lm_loss
    assert (options["parallelize"] is None) == (tp_size == 1)


def test_the_split_gives_every_stage_a_block_or_refuses():
    cfg = gpt.GPTConfig.named("base")           # 6 blocks
    assert gpt.pipeline_split_points(cfg, 3) == ["blocks.2", "blocks.4"]
    assert gpt.pipeline_split_points(cfg, 4) == ["blocks.1", "blocks.3", "blocks.4"]
    with pytest.raises(ConfigError, match=r"n_layers=6 blocks cannot give each of 7 pipeline stages"):
        gpt.pipeline_split_points(cfg, 7)

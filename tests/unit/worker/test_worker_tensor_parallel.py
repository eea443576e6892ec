"""Tensor parallelism inside data-parallel replicas, on real TrainContexts of 4 gloo processes
(no Ray): the layout a rank sees, data by DP rank, DDP x TP, FSDP x TP and HSDP against one
process training the unsharded model on the global batch, and the warm rung moving each shard
from a survivor of the same position (TP rank; under HSDP, place in a shard group)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "ckpt"))
import tp_ranks

from ckpt_ranks import run_ranks


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def _check_against_reference(results: list[dict], dp: int = 2, tp: int = 2) -> None:
    ref = tp_ranks.reference(tp_ranks.STEPS, dp=dp)
    assert min(ref["norms"]) > tp_ranks.MAX_NORM        # every step clipped
    for rank, result in enumerate(results):
        # ctx.clip_grad_norm_: the unsharded model's global norm on every rank (under FSDP x TP
        # the gradients live on two meshes: the LayerNorm's on the DP mesh, the TP layers' on both).
        assert _close(result["norms"], ref["norms"]), f"rank {rank}: {result['norms']} vs {ref['norms']}"
        assert result["place"]["dp_rank"] == rank // tp and result["place"]["tp_rank"] == rank % tp
        assert result["place"]["dp_size"] == dp and result["place"]["tp_size"] == tp
        # Parameters to 1e-4: a layout sums each gradient in another order than one process does
        # (HSDP: a reduce-scatter in the shard group, then an all-reduce across the groups), and
        # AdamW's first steps move a parameter by about lr whatever its gradient's size, so a
        # last-bit difference in a near-zero gradient grows to 1.2e-5 after 3 steps at lr 0.04 on
        # this machine's CPU (HSDP; 4e-8 for DDP and FSDP x TP). A wrong shard, scale or step
        # moves parameters by about lr.
        for name, values in ref["params"].items():
            assert _close(result["params"][name], values, tol=1e-4), \
                f"rank {rank}: {name} differs from the unsharded run"
        # A replica's ranks read the same batches; the replicas read different ones.
        assert result["seen"] == results[rank - rank % tp]["seen"]
        # The LR rule scales with the data-parallel degree (dp replicas / base 1), not the world.
        assert result["lr"] == pytest.approx(1e-2 * dp)
        assert result["samples"] == tp_ranks.STEPS * tp_ranks.BATCH * dp
    assert results[0]["seen"] != results[tp]["seen"]
    # The step's loss is the mean over the replicas, as the unsharded loss of the global batch.
    per_replica = [results[d * tp]["losses"] for d in range(dp)]
    replica_means = [sum(step) / dp for step in zip(*per_replica, strict=True)]
    assert _close(replica_means, ref["losses"])
    # metrics.jsonl's loss: the mean over the replicas (each replica once, whatever its TP degree).
    assert results[0]["records"], "no step record was kept"
    for step, loss in results[0]["records"]:
        assert loss == pytest.approx(replica_means[step - 1], rel=1e-6), f"step {step}"


# The three layouts run in turn on one start of 4 gloo processes (a start is most of each run's
# time on 2 cores): DDP x TP, FSDP x TP (2-D), and HSDP at T = 1 (two shard groups of 2).
LAYOUTS = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"},
           "hsdp": {"strategy": "hsdp", "tp": 1, "shard": 2}}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_each_layout_trains_as_the_unsharded_model_and_a_new_unit_restores_warm_per_position():
    per_rank = run_ranks("tp_ranks:each_layout", 4, timeout=280, cases=list(LAYOUTS.values()))
    ddp, fsdp, hsdp = ([per_rank[rank][i] for rank in range(4)] for i in range(len(LAYOUTS)))

    assert ddp[0]["place"]["mesh"] == ["dp_replicate", "tp"]
    _check_against_reference(ddp)
    for rank, result in enumerate(ddp):
        assert result["restored"] == tp_ranks.STEPS
        # Each rank holds, after the restore, exactly the shard its TP rank's survivor held.
        assert result["after"] == ddp[rank % 2]["before"], f"ddp: rank {rank} got another shard"
        # ... and the group trains on as one model.
        assert result["next_params"] == ddp[0]["next_params"]
        assert result["next_losses"] == ddp[rank - rank % 2]["next_losses"]
    assert ddp[0]["before"] != ddp[1]["before"]      # the TP ranks hold different shards

    assert fsdp[0]["place"]["mesh"] == ["dp_shard", "tp"]
    _check_against_reference(fsdp)

    # HSDP: FSDP2 shards within a shard group, replicates across them.
    assert hsdp[0]["place"]["mesh"] == ["dp_replicate", "dp_shard", "tp"]
    _check_against_reference(hsdp, dp=4, tp=1)
    for rank, result in enumerate(hsdp):
        assert result["restored"] == tp_ranks.STEPS
        # Each rank of the new shard group holds the shard its position's survivor held.
        assert result["after"] == hsdp[rank % 2]["before"], f"hsdp: rank {rank} got another shard"
        assert result["next_params"] == hsdp[0]["next_params"]
    assert hsdp[0]["before"] != hsdp[1]["before"]      # a group's ranks hold different shards
    assert hsdp[0]["before"] == hsdp[2]["before"]      # the shard groups hold the same shards

"""The main job on S3 end to end: checkpoints and a Parquet corpus on S3, a worker killed, then a
resume as a separate run at another world size. The resumed run keeps every step once,
retains its newest checkpoints, counts consumption in global samples, and has consumed exactly
the samples of a fault-free single run, in the same order (its hash computed from the loader's
order function). Both runs load with two DataLoader worker processes per rank (--loader-workers 2):
batches fetched ahead of the kill are not counted, and the recovery and the resume read on from the
step they restore.

The same corpus through Ray Data (ray.data.read_parquet passed to ctx.prepare_data): a kill and a
resume at another world size, each rank recording the ids it trained on; over the steps the runs
kept, every id was read exactly once, in the loader's order, from one materialization per run."""
from __future__ import annotations

import glob
import json
import os
import pickle
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import gpt
from elastic import (
    CheckpointConfig,
    DatasetError,
    ElasticTrainer,
    FailureConfig,
    ParquetTokens,
    ScalingConfig,
    write_token_shards,
)
from elastic._run_names import NAMESPACE
from elastic._worker.loader import ElasticLoader
from elastic.local_ray import LocalRay
from support import SignalAtStep, read_json, wait_for
from test_runtime import expected_data_order

pytestmark = [pytest.mark.integration]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = 3 * 100          # fewer samples than the runs consume: they go through several epochs


def main_job(storage: str, env: dict, *args: str) -> dict:
    command = [sys.executable, "examples/pretrain.py", "--storage", storage, "--model-size", "tiny",
               "--batch-size", "8", "--quiet", *args]
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | env
    try:
        done = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=240)
    finally:
        LocalRay(storage).stop()        # the run's own Ray outlives a driver killed by the timeout
    output = done.stdout + done.stderr
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # Issue 17: no DDP warning in a run's output. The bucket layout bitwise recovery needs is fixed
    # without find_unused_parameters (elastic._worker.wrap._fix_bucket_layout); DDP's warning came
    # from C++ on each rank's stderr, which Ray forwards to the driver: greped here.
    for marker in ("find_unused_parameters", "reducer.cpp", "DistributedDataParallel"):
        assert marker not in output, [line for line in output.splitlines() if marker in line][:3]
    return read_json(storage, "summary.json")


def s3_lines(url: str, name: str) -> list[dict]:
    from checkpointing.storage import Storage
    storage = Storage(url)
    return [json.loads(line) for line in storage.read_bytes(storage.path(name)).decode().splitlines()]


@pytest.mark.timeout(540)
def test_kill_then_resume_on_s3_at_another_world_size_consumes_what_a_clean_run_does(s3_env, tmp_path):
    corpus = f"s3://{s3_env['bucket']}/corpus"
    gpt.write_synthetic_corpus(corpus, seq_len=16, vocab=64, shards=3, rows_per_shard=100)
    assert len(ParquetTokens(corpus, 16)) == ROWS
    env, data = s3_env["env"], ("--data", corpus, "--checkpoint-every", "10", "--loader-workers", "2")

    run = f"s3://{s3_env['bucket']}/pretrain"
    fault = SignalAtStep(run, at_step=10, sig=signal.SIGKILL, rank=1, gate=str(tmp_path / "released"))
    fault.start()
    first = main_job(run, env, *data, "--workers", "2:2", "--steps", "50", "--hold-at", f"10:{fault.gate}")
    fault.join(timeout=5)
    assert fault.fired(), f"the fault never fired (run ended at step {first['final_step']})"
    assert [r["cause"] for r in first["recoveries"]] == ["worker_died"] and first["final_step"] == 50
    second = main_job(run, env, *data, "--workers", "3:3", "--steps", "70")
    assert second["status"] == "finished" and second["resumed_from"] == 50 and second["final_step"] == 70
    assert second["world_size_history"] == [[50, 3]]
    assert second["checkpoints"] == [50, 60, 70]                  # keep=3 retention
    from checkpointing.storage import Storage
    assert not Storage(run).exists(Storage(run).path("corpus"))      # --data given: nothing generated
    metrics = s3_lines(run, "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 71))       # none repeated, none skipped
    assert {m["world_size"] for m in metrics if m["step"] <= 50} == {2}
    assert {m["world_size"] for m in metrics if m["step"] > 50} == {3}
    # Consumption is counted in global samples: 50 steps x 2 x 8, then 20 steps x 3 x 8.
    assert metrics[49]["samples_seen"] == 800 and metrics[-1]["samples_seen"] == 800 + 480

    # The same 1280 samples as 80 clean steps x 2 x 8, the first 1280 positions of the global
    # order. Its hash is computed here from the loader's order function, the one a clean run
    # follows (test_runtime.py checks a clean run against it): a third, fault-free job would add
    # a minute and no check.
    assert second["samples_consumed"] == 1280
    assert second["data_order_sha256"] == expected_data_order(1280, n_samples=ROWS)


@pytest.mark.timeout(60)
def test_dataset_on_s3_reads_lazily_pickles_and_lists_fresh(s3_env):
    url = f"s3://{s3_env['bucket']}/tokens"
    write_token_shards(url, [np.full((5, 5), k) for k in range(2)], row_group_size=2)
    ds = ParquetTokens(url + "/", 4)
    assert len(ds) == 10 and ds.cache_info()["reads"] == 0
    copy = pickle.loads(pickle.dumps(ds))
    assert [int(copy[i][0]) for i in range(10)] == [0] * 5 + [1] * 5
    assert copy.cache_info()["reads"] == 6                 # 3 row groups per shard, each read once
    write_token_shards(url, [np.full((5, 5), k) for k in range(3)], row_group_size=2)
    assert len(ParquetTokens(url, 4)) == 15                # a new listing, not a cached one
    with pytest.raises(DatasetError, match=r"s3://.*shard-00000.parquet.*seq_len=8 needs 9"):
        ParquetTokens(url, 8)


RAY_ROWS, RAY_SEQ, RAY_BATCH = 400, 4, 4


def ray_data_loop(ctx):
    """A linear model on the Ray Data rows of the corpus at config["corpus"] (row r: tokens all r).
    Each rank appends, per batch, the ids it trains on and the data source it read them from to a
    file of its process under config["record"]."""
    import ray.data
    cfg = ctx.config
    model = ctx.prepare_model(torch.nn.Linear(RAY_SEQ + 1, 1))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2))
    loader = ctx.prepare_data(ray.data.read_parquet(cfg["corpus"], file_extensions=["parquet"]), batch_size=RAY_BATCH)
    ctx.restore(model=model, optimizer=optimizer)
    source = loader._dataset._source._actor_id.hex()        # the run's data source (a test's peek)
    path = os.path.join(cfg["record"], f"{os.getpid()}.jsonl")
    for batch in loader:
        tokens = batch["tokens"]
        with open(path, "a") as f:
            f.write(json.dumps({"run": cfg["run"], "generation": ctx.generation, "step": ctx.step,
                                "rank": ctx.dp_rank, "ids": tokens[:, 0].tolist(), "source": source}) + "\n")
        loss = model(tokens.float() / RAY_ROWS).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.report(loss=loss)


def ray_data_fit(run_dir: str, config: dict, workers: int, steps: int):
    return ElasticTrainer(ray_data_loop, train_loop_config=config, total_steps=steps, seed=0,
                          scaling=ScalingConfig(min_workers=workers, max_workers=workers, startup_wait_s=120),
                          checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=10),
                          failure=FailureConfig(max_failures=3, rendezvous_timeout_s=60.0)).fit()


def data_sources_alive() -> list[str]:
    import ray
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == NAMESPACE and ".data" in a.get("name", "")]


@pytest.mark.timeout(300)
def test_ray_data_through_a_kill_and_a_resume_reads_each_id_exactly_once(ray_session, run_dir, tmp_path):
    # 400 rows, more than the runs read (30 steps x 2 x 4, then 10 x 3 x 4: 360): one epoch, so
    # "exactly once" is literal.
    corpus, record = str(tmp_path / "corpus"), tmp_path / "record"
    record.mkdir()
    write_token_shards(corpus, [np.arange(k * 100, (k + 1) * 100)[:, None].repeat(RAY_SEQ + 1, axis=1)
                                for k in range(RAY_ROWS // 100)], row_group_size=25)
    config = {"corpus": corpus, "record": str(record)}
    fault = SignalAtStep(run_dir, at_step=10, sig=signal.SIGKILL, rank=1)
    fault.start()
    first = ray_data_fit(run_dir, config | {"run": "first"} | fault.hold_config(), workers=2, steps=30)
    fault.join(timeout=5)
    assert fault.fired() and first.ok, first.error_traceback
    assert [r["cause"] for r in first.summary["recoveries"]] == ["worker_died"]
    second = ray_data_fit(run_dir, config | {"run": "second"}, workers=3, steps=40)
    assert second.ok and second.summary["resumed_from"] == 30 and second.final_step == 40, second.error_traceback
    # Removed when each run ended: no data source outlives its run.
    wait_for(lambda: not data_sources_alive(), 30, "the runs' data sources to be removed")

    records = [json.loads(line) for name in glob.glob(str(record / "*.jsonl")) for line in open(name)]
    # One materialization per run, shared by every rank, generation and replacement.
    sources = {run: {r["source"] for r in records if r["run"] == run} for run in ("first", "second")}
    assert all(len(found) == 1 for found in sources.values()) and sources["first"] != sources["second"]
    assert {r["generation"] for r in records if r["run"] == "first"} != {0}    # a recovery happened in between
    # A step attempted again after a failure is kept in its last attempt: the newest run and generation.
    kept = {}
    for r in sorted(records, key=lambda r: (r["run"] == "second", r["generation"])):
        kept[(r["step"], r["rank"])] = r["ids"]
    ids = [i for step in range(40) for rank in range(2 if step < 30 else 3) for i in kept[(step, rank)]]
    assert len(ids) == 360 and len(set(ids)) == 360            # every id exactly once over the kept steps
    # ... in the loader's order over the rows, which Ray Data materialized in the corpus's order.
    order = ElasticLoader(SimpleNamespace(seed=0, dp_size=1, total_steps=1), range(RAY_ROWS), batch_size=1)
    assert ids == order._dataset_indices(0, 360)
    assert second.summary["samples_consumed"] == 360
    assert second.summary["data_order_sha256"] == expected_data_order(360, n_samples=RAY_ROWS)

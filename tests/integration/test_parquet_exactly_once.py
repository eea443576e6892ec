"""The main job on S3 end to end: checkpoints and a Parquet corpus on S3, a worker killed, then a
resume as a separate run at another world size. The resumed run keeps every step once,
retains its newest checkpoints, counts consumption in global samples, and has consumed exactly
the samples of a fault-free single run, in the same order (its hash computed from the loader's
order function). Both runs load with two DataLoader worker processes per rank (--loader-workers 2):
batches fetched ahead of the kill are not counted, and the recovery and the resume read on from the
step they restore."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest

import gpt
from elastic import DatasetError, ParquetTokens, write_token_shards
from elastic.local_ray import LocalRay
from support import SignalAtStep, read_json
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

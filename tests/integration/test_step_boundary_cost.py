"""Issue 17: a run's output carries no DDP warning. The bucket layout that bitwise recovery
needs is fixed without `find_unused_parameters=True` (elastic._worker.wrap._fix_bucket_layout),
so DDP neither searches for unused parameters every step nor warns that it does (its warning
comes from C++ on each rank's stderr, which Ray forwards to the driver's output: greped here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_run_prints_no_ddp_warning(tmp_path):
    storage = str(tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "examples/pretrain.py", "--storage", storage, "--workers", "3:3", "--steps", "12",
         "--checkpoint-every", "6", "--model-size", "tiny"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    with open(os.path.join(storage, "summary.json")) as f:
        assert json.load(f)["final_step"] == 12
    for marker in ("find_unused_parameters", "reducer.cpp", "DistributedDataParallel"):
        assert marker not in output, [line for line in output.splitlines() if marker in line][:3]

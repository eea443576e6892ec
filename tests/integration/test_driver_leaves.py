"""The main job's driver SIGKILLed mid-run on the local Ray it started (issue 32): the run goes on
without it, a second `pretrain.py` with the same storage attaches and exits with the run's
status, and nothing of the run's Ray is left once it ended (elastic.local_ray).

The run's Ray is its own (not the suite's shared one): found by the storage, as the second driver
finds it. Whatever happens, the test ends by killing every process marked as that Ray's.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from elastic.local_ray import LocalRay, processes
from support import pid_alive, read_json, wait_for

# Exclusive, like the other tests that start a Ray of their own: a second cluster's processes
# beside the shared one's would load the parallel pass's timing-sensitive tests on 2 cores.
pytestmark = [pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, HOLD = 800, 10      # long enough that the run is still going when the second driver comes


def _driver(storage: str, release: str, log_path: str) -> subprocess.Popen:
    command = [sys.executable, "examples/pretrain.py", "--storage", storage, "--model-size", "tiny",
               "--batch-size", "8", "--workers", "2", "--steps", str(STEPS), "--checkpoint-every", "100",
               "--hold-at", f"{HOLD}:{release}", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def _log(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-4000:]


def test_a_killed_drivers_run_goes_on_and_a_second_driver_attaches_and_exits_with_its_status(tmp_path):
    storage, release, log = str(tmp_path / "run"), str(tmp_path / "release"), str(tmp_path / "drivers.log")
    local = LocalRay(storage)
    first = second = None
    try:
        first = _driver(storage, release, log)
        wait_for(lambda: (read_json(storage, "status.json") or {}).get("step", 0) >= HOLD, 150,
                 "the run to reach its hold step")
        status = read_json(storage, "status.json") or {}
        workers = sorted(w["pid"] for w in status["workers"])
        first.send_signal(signal.SIGKILL)          # the driver alone, not its process group
        first.wait(timeout=30)
        assert local.address() is not None, "the run's Ray died with its driver"
        open(release, "w").close()
        # The run trains on with no driver at all.
        wait_for(lambda: (read_json(storage, "status.json") or {}).get("step", 0) >= HOLD + 20, 90,
                 f"the run to train on without its driver:\n{_log(log)}")
        assert read_json(storage, "summary.json") is None, "the run ended with its driver"

        second = _driver(storage, release, log)
        assert second.wait(timeout=150) == 0, _log(log)
        assert "following it to its end" in _log(log)
        summary = read_json(storage, "summary.json") or {}
        assert summary["status"] == "finished" and summary["final_step"] == STEPS, summary
        assert summary["recoveries"] == [], summary["recoveries"]     # no worker was lost or restarted
        assert all(not pid_alive(pid) for pid in workers), "the run's workers outlived it"
        # The second driver stopped the run's Ray once the run ended.
        assert local.address() is None
        assert processes(str(local.dir)) == []
    finally:
        for driver in (first, second):
            if driver is not None and driver.poll() is None:
                driver.kill()
                driver.wait(timeout=30)
        local.stop()
        shutil.rmtree(local.dir, ignore_errors=True)

"""Kill the writer between its shard writes and the commit: nothing loadable under that step."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from checkpointing import CheckpointManager, latest_committed
from checkpointing import manifest as mf
from ckpt_conformance import assert_state, blank_state
from ckpt_ranks import HERE, REPO, SUITE

pytestmark = pytest.mark.integration


@pytest.fixture(params=["file", "s3"])
def crash_url(request, tmp_path):
    if request.param == "file":
        return str(tmp_path / "run")
    return request.getfixturevalue("s3_url")


@pytest.mark.timeout(60)
def test_killed_writer_leaves_previous_checkpoint_loadable(crash_url, tmp_path):
    marker = tmp_path / "marker"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), str(SUITE)])
    proc = subprocess.Popen([sys.executable, str(HERE / "ckpt_crash_writer.py"), crash_url, str(marker)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 45
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "writer never reached the commit point"
            time.sleep(0.05)  # polling interval of the deadline loop
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()

    mgr = CheckpointManager(crash_url)
    assert mgr.storage.find(mf.step_path(mgr.storage, 2)), "step 2 shards should be on storage"
    assert mf.read_manifest(mgr.storage, 2) is None
    assert latest_committed(crash_url).step == 1
    state = blank_state()
    assert mgr.load_latest(state).step == 1
    assert_state(state, 1)
    mgr.gc()
    assert mf.list_steps(mgr.storage) == [1]

"""Cutting an NCCL group the way the worker does (GroupMembership.cut: `_abort_process_group`
and the group's sockets shut down) returns at once, leaves no group behind, and the same process
forms the next generation's group and checkpoints over it. One GPU, one rank: what needs two
ranks (a peer blocked in a collective released by the cut) is covered with gloo in
tests/unit/worker/test_group_sockets.py; NCCL does not put two ranks on one device."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

GONE = {"initialized": False, "registered": False, "groups_left": 0, "default_collective": "ValueError"}


def test_aborting_a_one_rank_nccl_group_destroys_it_without_hanging_and_a_new_one_forms(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, os.path.join(HERE, "nccl_abort_program.py"), str(tmp_path / "ckpt")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as hung:
        # TimeoutExpired holds bytes whatever text= said.
        out = b"".join(x for x in (hung.stdout, hung.stderr) if x).decode(errors="replace")
        pytest.fail(f"the abort or the re-formed group hung: {out[-6000:]}")
    assert done.returncode == 0, done.stderr[-6000:]
    findings = json.loads(done.stdout.strip().splitlines()[-1])
    assert findings["cut_returned"] and findings["cut_s"] < 30, findings
    assert findings["after_cut"] == GONE, findings
    assert findings["after_leave_abort"] == GONE, findings
    assert findings["reformed"] == {"all_reduce": [2.0, 2.0, 2.0], "loaded_step": 1, "equal": True, "step": 1}, findings

"""A worker imports what a generation's start needs while it is still a spare (worker._preload):
a replacement joining a group must not make every rank wait on its imports inside the re-form's
first collectives (DistributedDataParallel's constructor imported torch._dynamo on its first call
in a process: 0.5 s on this machine, every warm recovery with a spare)."""
from __future__ import annotations

import json

import pytest

from support import fresh_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


# In a fresh interpreter: what a rank's first DDP wrap and first step import after the preload.
_FIRST_STEP = """
import json, sys
import torch, torch.distributed as dist
from elastic._worker.worker import _preload
_preload()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = set(sys.modules)
from torch.nn.parallel import DistributedDataParallel
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 8)).square().mean().backward()
optimizer.step()
dist.destroy_process_group()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_a_spares_first_ddp_wrap_and_step_import_nothing():
    out = fresh_python(_FIRST_STEP, timeout_s=100)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    imported = json.loads(out.stdout.decode().strip().splitlines()[-1])
    # Autograd's record_function probes for CUPTI on first use: a module of a few lines (under a
    # millisecond), private to torch's profiler, so not worth a preload that could break on upgrade.
    assert [m for m in imported if m.split(".")[0] == "torch" and m != "torch.profiler._cupti_monitor"] == []

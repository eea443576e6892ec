"""`python -m checkpointing list|verify|gc` (in process through cli.main, and once as a module)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from checkpointing import CheckpointManager
from checkpointing.cli import main
from ckpt_conformance import flip_byte, make_state


@pytest.fixture
def run3(file_url):
    mgr = CheckpointManager(file_url, async_save=False, keep=None)
    for step in (1, 2, 3):
        mgr.save(step, make_state(step), generation=0)
    mgr.set_generation(0)
    return mgr


@pytest.mark.timeout(30)
def test_list_and_verify(run3, capsys):
    assert main(["list", run3.url]) == 0
    out = capsys.readouterr().out
    assert "FENCE generation: 0" in out and out.count("committed") == 3
    assert main(["verify", run3.url]) == 0
    assert capsys.readouterr().out.count(" OK ") == 3
    flip_byte(run3, 3)
    assert main(["verify", run3.url]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "sha256" in out
    assert main(["verify", run3.url, "--step", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"][0]["ok"] is True


@pytest.mark.timeout(30)
def test_gc_keeps_newest_verified_and_spares_newer_partials(run3, capsys):
    flip_byte(run3, 3)
    with run3.storage.open_write(run3.storage.path("checkpoints/step_00000009/g000000/x")) as f:
        f.write(b"partial")
    assert main(["gc", run3.url, "--keep", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kept"] == [2, 3]  # 3 is newest but corrupt: 2 is kept as the last good one
    assert [c.step for c in run3.committed()] == [2, 3]
    from checkpointing import manifest as mf
    assert 9 in mf.list_steps(run3.storage)  # may be a save in progress: spared by default
    assert main(["gc", run3.url, "--include-newer"]) == 0
    assert 9 not in mf.list_steps(run3.storage)


@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_module_entry_point_and_errors(file_url):
    proc = subprocess.run([sys.executable, "-m", "checkpointing", "list", file_url],
                          capture_output=True, text=True, timeout=25)
    assert proc.returncode == 0 and "no checkpoints" in proc.stdout
    assert main(["gc", file_url, "--keep", "0"]) == 2
    assert main(["verify", file_url, "--step", "5"]) == 2

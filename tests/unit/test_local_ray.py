"""elastic.local_ray without a Ray: how a run's own Ray is named, found and swept. Its processes
are stood in for by sleeping processes with the marker in their environment (and, for an agent
that only names its raylet, RAY_RAYLET_PID); the real `ray start` is in
tests/integration/test_driver_leaves.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastic import local_ray
from elastic.local_ray import MARKER, RECORD, LocalRay, processes, stop_marked, storage_key
from support import pid_alive, wait_for

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not local_ray.supported(), reason="the sweep reads /proc (Linux)")]


def _sleeper(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env={**os.environ, **env})


def test_one_storage_names_one_directory_whatever_the_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage_key("runs/a") == str(tmp_path / "runs" / "a")
    assert storage_key("s3://bucket/a") == "s3://bucket/a"
    assert LocalRay("runs/a", root=tmp_path).dir == LocalRay(str(tmp_path / "runs" / "a"), root=tmp_path).dir
    assert LocalRay("runs/a", root=tmp_path).dir != LocalRay("runs/b", root=tmp_path).dir


def test_a_record_whose_ray_is_gone_is_not_an_address_and_is_forgotten(tmp_path):
    local = LocalRay(str(tmp_path / "run"), root=tmp_path / "rays")
    assert local.address() is None
    local.dir.mkdir(parents=True)
    (local.dir / RECORD).write_text(json.dumps({"address": "127.0.0.1:1"}))
    assert local.address() is None             # no gcs_server carries its marker
    assert not (local.dir / RECORD).exists()


def test_stop_kills_every_marked_process_and_the_agents_of_its_raylets_and_nothing_else(tmp_path):
    local = LocalRay(str(tmp_path / "run"), root=tmp_path / "rays")
    other = LocalRay(str(tmp_path / "other"), root=tmp_path / "rays")
    marked = [_sleeper({MARKER: str(local.dir)}) for _ in range(2)]
    agent = _sleeper({"RAY_RAYLET_PID": str(marked[0].pid)})     # names only its raylet
    # An agent whose environment its process title overwrote: known by its log open in the dir.
    local.dir.mkdir(parents=True)
    titled = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'a'); time.sleep(120)",
                               str(local.dir / "agent.log")], env={})
    bystanders = [_sleeper({MARKER: str(other.dir)}), _sleeper({})]
    try:
        wait_for(lambda: len(processes(str(local.dir))) == 4, 10, "the stand-ins to start")
        assert local.stop() == 4
        for p in (*marked, agent, titled):
            assert p.wait(timeout=10) == -9
        assert all(p.poll() is None for p in bystanders)
        assert processes(str(local.dir)) == []
    finally:
        for p in (*marked, agent, titled, *bystanders):
            p.kill()
            p.wait(timeout=10)


def test_a_process_of_the_ray_stops_it_with_itself_last(tmp_path):
    """The run's controller, when no driver collected the run's end (stop_own_ray)."""
    marker = str(tmp_path / "ray")
    os.makedirs(marker)
    open(os.path.join(marker, RECORD), "w").close()
    sibling = _sleeper({MARKER: marker})
    stopper = subprocess.run([sys.executable, "-c", "from elastic.local_ray import stop_own_ray; stop_own_ray()"],
                             env={**os.environ, MARKER: marker}, timeout=30)
    assert stopper.returncode == 0
    assert sibling.wait(timeout=10) == -9
    assert not os.path.exists(os.path.join(marker, RECORD))


def test_outside_a_local_ray_there_is_nothing_to_stop(monkeypatch):
    monkeypatch.delenv(MARKER, raising=False)
    assert local_ray.stop_own_ray() is False
    assert stop_marked("/nowhere/at/all") == 0
    assert pid_alive(os.getpid())

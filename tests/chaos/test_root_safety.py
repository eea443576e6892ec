"""Chaos run as root must not open the machine up or break other people's things (review F19):
token auth on every namespaced cluster, a subnet no route covers, a heal that touches one
campaign unless told "all", and no reference storage deleted without --overwrite.

None of these needs root: the `ip` command is faked where the test would otherwise change the
machine's network.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re

import pytest

from chaos import netns
from chaos.__main__ import main
from chaos.job import JobSpec
from chaos.reference import MARKER, _identity, check_reference_storage, reference_url
from chaos.runner import RunOptions, run
from chaos.scenarios import Scenario
from chaos.schedule import fixed

pytestmark = pytest.mark.timeout(60)

ROUTES = """default via 192.0.2.1 dev eth0
10.213.5.0/24 dev chx01234b proto kernel scope link src 10.213.5.1
local 10.213.6.1 dev chx09999b table local proto kernel scope host src 10.213.6.1
broadcast 10.213.7.255 dev wg0 table local proto kernel scope link src 10.213.7.1
192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2
unreachable 10.213.8.0/22
"""


def test_a_subnet_with_a_route_is_never_used():
    taken = [n for n in range(1, 251) if netns.route_overlaps(ROUTES, ipaddress.ip_network(f"10.213.{n}.0/24"))]
    assert taken == [5, 6, 7, 8, 9, 10, 11]               # the /22 covers 8..11; default counts for none
    assert netns.free_subnet(ROUTES, preferred=5) == 12
    assert netns.free_subnet(ROUTES, preferred=3) == 3
    assert netns.free_subnet(ROUTES, preferred=250) == 250
    with pytest.raises(RuntimeError, match="10.0.0.0/8 via 192.0.2.9"):
        netns.free_subnet(ROUTES + "10.0.0.0/8 via 192.0.2.9 dev eth0\n", preferred=5)


def test_every_namespaced_cluster_uses_token_auth_with_a_token_of_its_own(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")            # asked for: ignored
    monkeypatch.setenv("RAY_AUTH_TOKEN", "someone-elses")
    a, b = netns.NetnsCluster(2), netns.NetnsCluster(2)
    a.subnet = b.subnet = 9
    assert a.token != b.token and re.fullmatch(r"[0-9a-f]{64}", a.token)
    for env in (a.env(), a._node_env()):
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == a.token
    assert a.env()["RAY_ADDRESS"] == "10.213.9.2:6379" and a.cidr == "10.213.9.0/24"
    assert a.heal_command == f"python -m chaos heal --id {a.id}"


class FakeIp:
    """`ip` with two campaigns' namespaces and links on the machine; records what is deleted."""

    def __init__(self):
        self.namespaces = ["chx01234h (id: 0)", "chx01234n0 (id: 1)", "chx05678h", "chxprobe42", "someone"]
        self.links = ["1: lo: <LOOPBACK>", "5: chx01234b: <BROADCAST>", "6: chx01234n0v@if2: <BROADCAST>",
                      "7: chx05678b: <BROADCAST>", "8: eth0: <BROADCAST>"]
        self.deleted: list[str] = []

    def __call__(self, *args, check=True):
        out = ""
        if args[:2] == ("netns", "list"):
            out = "\n".join(self.namespaces)
        elif args[:3] == ("-o", "link", "show"):
            out = "\n".join(self.links)
        elif args[:2] in (("netns", "del"), ("link", "del")):
            self.deleted.append(args[2])
        return type("Done", (), {"stdout": out, "stderr": "", "returncode": 0})()


@pytest.fixture
def fake_ip(monkeypatch, tmp_path):
    fake = FakeIp()
    monkeypatch.setattr(netns, "_ip", fake)
    monkeypatch.setattr(netns, "ETC_NETNS", str(tmp_path / "etc-netns"))
    return fake


def test_heal_removes_one_campaign_unless_all_is_asked_for(fake_ip, capsys):
    assert netns.leftover_ids() == ["01234", "05678"]
    assert main(["heal"]) == 2                                   # lists, removes nothing
    assert json.loads(capsys.readouterr().out) == {"campaigns": ["01234", "05678"]} and not fake_ip.deleted
    assert main(["heal", "--id", "0123"]) == 2 and not fake_ip.deleted
    with pytest.raises(ValueError):
        netns.cleanup_leftovers("chx")
    assert main(["heal", "--id", "01234"]) == 0
    assert fake_ip.deleted == ["chx01234h", "chx01234n0", "chx01234b", "chx01234n0v"]
    fake_ip.deleted.clear()
    assert main(["heal", "--id", "all"]) == 0
    assert fake_ip.deleted == ["chx01234h", "chx01234n0", "chx05678h", "chxprobe42", "chx01234b", "chx01234n0v",
                               "chx05678b"]


def reference_spec(tmp_path) -> JobSpec:
    return JobSpec(storage=str(tmp_path / "run"), steps=10, script=os.path.abspath(__file__))


def test_the_reference_storage_is_only_cleared_with_overwrite(tmp_path):
    spec = reference_spec(tmp_path)
    ref = reference_url(spec.storage)
    check_reference_storage(spec, "auto", None, overwrite=False)         # nothing there
    os.makedirs(ref)
    with open(os.path.join(ref, "precious.txt"), "w") as f:
        f.write("someone's run")
    with pytest.raises(SystemExit, match="--overwrite"):
        check_reference_storage(spec, "auto", None, overwrite=False)
    check_reference_storage(spec, "auto", None, overwrite=True)
    check_reference_storage(spec, "none", None, overwrite=False)          # not used: not touched
    # A finished reference of this very job is reused, never cleared; another job's is refused.
    with open(os.path.join(ref, "summary.json"), "w") as f:
        json.dump({"status": "finished"}, f)
    with open(os.path.join(ref, MARKER), "w") as f:
        json.dump(_identity(spec), f)
    check_reference_storage(spec, "auto", None, overwrite=False)
    with pytest.raises(SystemExit, match="older chaos reference"):
        check_reference_storage(spec.replace(steps=20), "auto", None, overwrite=False)


def test_a_run_refuses_to_start_over_a_foreign_reference_storage(tmp_path):
    ref = str(tmp_path / "run") + "-reference"
    os.makedirs(ref)
    with open(os.path.join(ref, "precious.txt"), "w") as f:
        f.write("someone's run")
    sc = Scenario(name="fake", description="", build=lambda sc, seed: fixed([]), steps=10, workers="1:1")
    with pytest.raises(SystemExit, match="--overwrite"):
        run(RunOptions(scenario=sc, seed=0, storage=str(tmp_path / "run"), out_dir=str(tmp_path / "out"),
                       script=os.path.abspath(__file__)))
    assert os.path.exists(os.path.join(ref, "precious.txt"))
    assert not [e for e in map(json.loads, open(tmp_path / "out" / "history.jsonl")) if e["type"] == "job_start"]


@pytest.mark.timeout(240)
def test_a_cluster_started_with_its_auth_env_admits_its_token_only(tmp_path):
    """`ray start` and `ray.init` as the namespaced cluster runs them, on loopback: a driver with
    the cluster's token joins, one with another token is refused. Not `exclusive`: nothing here is
    timed but the generous waits for the head and the drivers; its own port and temp dir."""
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile

    from chaos.services import free_port, wait_until
    auth = netns.NetnsCluster(1).auth_env()
    port, log_path = free_port(), tmp_path / "head.log"
    short = tempfile.mkdtemp(prefix="chxt", dir="/tmp")     # Ray's socket paths must stay short
    # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: on SIGTERM `ray start --block` otherwise drains
    # its node for up to 30 s before it stops its processes, and the teardown below waited out
    # 20 s of that on every run before its SIGKILL.
    env = dict(os.environ, **auth, RAY_TMPDIR=short, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "wb") as log:
        head = subprocess.Popen([netns._ray_bin(), "start", "--head", "--block", "--disable-usage-stats",
                                 f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
                                 "--node-ip-address=127.0.0.1", f"--temp-dir={short}/ray",
                                 "--object-store-memory=80000000"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: head.poll() is None and "Ray runtime started" in log_path.read_text(), 120, "the head")
        join = (f"import ray; ray.init(address='127.0.0.1:{port}'); "
                f"print('joined', ray.cluster_resources()); ray.shutdown()")
        ok = subprocess.run([sys.executable, "-c", join], env=env, capture_output=True, text=True, timeout=90)
        assert ok.returncode == 0 and "joined" in ok.stdout, ok.stderr[-2000:]
        # A refused driver retries its GCS connection once a second, 20 times by default, and is
        # refused each time: 3 tries say the same (RAY_gcs_server_port_wait_time_s sets the count).
        wrong = subprocess.run([sys.executable, "-c", join],
                               env=dict(env, RAY_AUTH_TOKEN="0" * 64, RAY_gcs_server_port_wait_time_s="3"),
                               capture_output=True, text=True, timeout=90)
        assert wrong.returncode != 0 and "joined" not in wrong.stdout
        assert "InvalidAuthToken" in wrong.stderr or "uthenticat" in wrong.stderr, wrong.stderr[-2000:]
    finally:
        # Its whole session (gcs, raylet, monitor); never `ray stop`, which stops every Ray here.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=20)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        shutil.rmtree(short, ignore_errors=True)

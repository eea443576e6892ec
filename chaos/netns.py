"""A Ray cluster whose nodes live in their own network namespaces, so links can be cut.

    host:  bridge chx<id>b, 10.213.N.1/24 (the runner, the S3 proxy)
    head:  netns chx<id>h, 10.213.N.2: GCS, the job's driver and controller (never cut)
    node k: netns chx<id>nK, 10.213.N.(10+K), one CPU, joined with `ray start --block`

A node's link is its veth pair to the bridge; `cut` sets the host end down (every packet to
and from that node is lost, as with a failed switch port) and `reconnect` sets it up again.
Killing a node kills every process in its namespace. Node processes share the machine's pid
namespace, so the pids in status.json are signalled as usual.

Needs root, iproute2, veth and bridge support; `netns_unsupported_reason()` says what is
missing. Every name starts with "chx<id>" (the cluster's five-digit id), so
`python -m chaos heal --id ID` removes what a killed runner left behind, and only that;
`--id all` removes every campaign's (concurrent ones included).

Run as root, a cluster must not be a door into root: the GCS listens on the bridge, which
every local user can reach. So every cluster runs with Ray's token authentication
(RAY_AUTH_MODE=token), with a fresh random token of its own (256 bits, as `ray get-auth-token
--generate` makes) handed to its nodes and its job in RAY_AUTH_TOKEN: an environment only root
can read. And its /24 is one no route of the machine covers (`ip route`): a subnet that shadowed
a real network would cut the machine off from it for the campaign's length.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys

from chaos.services import wait_until

log = logging.getLogger("chaos.netns")

PREFIX = "chx"
ID_RE = re.compile(r"^\d{5}$")
NAME_ID_RE = re.compile(r"^chx(\d{5})(?!\d)")   # the campaign id in a namespace, link or bridge name
SUBNET_BASE = "10.213"                            # campaigns use 10.213.N.0/24, N in 1..250
ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "anycast", "blackhole", "unreachable", "prohibit",
               "throw", "nat"}
RAY_PORT = 6379
ETC_NETNS = "/etc/netns"     # per-namespace files that `ip netns exec` mounts over /etc
OBJECT_STORE_BYTES = 128 * 1024 * 1024


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unsupported_reason() -> str | None:
    """None when namespaced clusters can be built here, else why not."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"{PREFIX}probe{os.getpid() % 10000}"
    try:
        for args in (("netns", "add", probe), ("link", "add", probe + "b", "type", "bridge")):
            result = _ip(*args, check=False)
            if result.returncode != 0:
                return f"`ip {' '.join(args)}` failed: {result.stderr.strip()}"
        return None
    finally:
        _ip("link", "del", probe + "b", check=False)
        _ip("netns", "del", probe, check=False)


def auth_token() -> str:
    """A fresh cluster token: 256 random bits in hex, as Ray's own generator makes them."""
    return secrets.token_hex(32)


def route_overlaps(routes: str, subnet: ipaddress.IPv4Network) -> list[str]:
    """The lines of `ip -4 route show table all` whose destination overlaps `subnet` (a default
    route does not count: it is what any more specific route is meant to override)."""
    found = []
    for line in routes.splitlines():
        tokens = line.split()
        if tokens and tokens[0] in ROUTE_TYPES:
            tokens = tokens[1:]
        if not tokens or tokens[0] == "default":
            continue
        try:
            destination = ipaddress.ip_network(tokens[0], strict=False)
        except ValueError:
            continue
        if destination.version == 4 and destination.overlaps(subnet):
            found.append(line.strip())
    return found


def free_subnet(routes: str, preferred: int) -> int:
    """N of the first 10.213.N.0/24 (from `preferred`, round 1..250) that no route overlaps;
    RuntimeError naming what is in the way when there is none."""
    blocking: list[str] = []
    for k in range(250):
        n = 1 + (preferred - 1 + k) % 250
        found = route_overlaps(routes, ipaddress.IPv4Network(f"{SUBNET_BASE}.{n}.0/24"))
        if not found:
            return n
        blocking.extend(line for line in found if line not in blocking)
    raise RuntimeError(f"every {SUBNET_BASE}.N.0/24 has a route on this machine ({'; '.join(blocking[:3])}): a "
                       f"namespaced cluster there would shadow it; remove the route(s) or run without namespaces")


def _routes() -> str:
    return _ip("-4", "route", "show", "table", "all").stdout


def _ray_bin() -> str:
    candidate = os.path.join(os.path.dirname(sys.executable), "ray")
    return candidate if os.path.exists(candidate) else "ray"


class NetnsCluster:
    supports_partition = True

    def __init__(self, nodes: int, log_dir: str | None = None):
        self.n_nodes = nodes
        self.id = f"{os.getpid() % 100000:05d}"
        self.subnet: int | None = None          # N of 10.213.N.0/24, claimed by start()
        self.bridge = f"{PREFIX}{self.id}b"
        self.head_ns = f"{PREFIX}{self.id}h"
        self._procs: dict[str, subprocess.Popen] = {}     # namespace -> its `ray start --block`
        self._removed: set[str] = set()
        self._next = 0
        self.log_dir = log_dir or f"/tmp/{PREFIX}{self.id}-logs"      # `ray start` output per node
        self.token = auth_token()
        if os.environ.get("RAY_AUTH_MODE", "token") != "token":
            log.warning("RAY_AUTH_MODE=%s ignored: a namespaced cluster always uses token authentication",
                        os.environ["RAY_AUTH_MODE"])

    @property
    def host_ip(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.1"

    @property
    def head_ip(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.2"

    @property
    def cidr(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.0/24"

    @property
    def heal_command(self) -> str:
        return f"python -m chaos heal --id {self.id}"

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> NetnsCluster:
        os.makedirs(self.log_dir, exist_ok=True)
        self.subnet = free_subnet(_routes(), preferred=1 + os.getpid() % 250)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        # Packets from the namespaces to anywhere but the bridge's subnet stop at the host, even
        # where the machine forwards IP between its other interfaces.
        forwarding = f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding"
        if os.path.exists(forwarding):
            with open(forwarding, "w") as f:
                f.write("0")
        self._make_ns(self.head_ns, self.head_ip, "h")
        # Its own temp dir: in the default /tmp/ray the head would leave its address in
        # ray_current_cluster, where a plain `ray.init()` on this machine would look for a cluster.
        self._ray(self.head_ns, ["--head", f"--node-ip-address={self.head_ip}", f"--port={RAY_PORT}",
                                 "--num-cpus=0", "--include-dashboard=false", f"--temp-dir=/tmp/{self.head_ns}"])
        self._wait_started(self.head_ns)
        # Started together: most of a node's start is spent waiting, not computing.
        for ns in [self._add_node() for _ in range(self.n_nodes)]:
            self._wait_started(ns)
        return self

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{RAY_PORT}"

    def auth_env(self) -> dict[str, str]:
        """Token authentication with this cluster's token, for every process that joins it.
        RAY_AUTH_TOKEN comes first in Ray's token lookup, before RAY_AUTH_TOKEN_PATH and
        ~/.ray/auth_token, so a token the operator has elsewhere cannot get in the way."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self.address, **self.auth_env()}

    def exec_prefix(self) -> list[str]:
        """The job's driver runs in the head's namespace, next to the GCS it joins."""
        return ["ip", "netns", "exec", self.head_ns]

    def node_ids(self) -> list[str]:
        return [ns for ns, p in self._procs.items() if ns != self.head_ns and ns not in self._removed]

    def node_of(self, worker: dict) -> str | None:
        result = _ip("netns", "identify", str(worker["pid"]), check=False)
        name = result.stdout.strip()
        return name if name in self.node_ids() else None

    def add_node(self) -> str:
        ns = self._add_node()
        self._wait_started(ns)
        return ns

    def _add_node(self) -> str:
        k = self._next
        self._next += 1
        ns = f"{PREFIX}{self.id}n{k}"
        ip = f"{SUBNET_BASE}.{self.subnet}.{10 + k}"
        self._make_ns(ns, ip, f"n{k}")
        self._ray(ns, [f"--address={self.address}", f"--node-ip-address={ip}", "--num-cpus=1",
                       f"--temp-dir=/tmp/{ns}"])
        return ns

    def remove_node(self, ns: str) -> None:
        """The machine dies: every process in the namespace at once, then its link."""
        self._kill_ns(ns)
        self._removed.add(ns)
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", self._veth(ns), check=False)

    def cut(self, ns: str) -> None:
        _ip("link", "set", self._veth(ns), "down")

    def reconnect(self, ns: str) -> str:
        _ip("link", "set", self._veth(ns), "up", check=False)
        return ns

    def maintain(self) -> list[str]:
        """Replace nodes whose Ray died on its own (a node declared dead during a long cut shuts
        itself down when it comes back): the autoscaler's job, so capacity stays constant."""
        replaced = []
        for ns in self.node_ids():
            if self._procs[ns].poll() is not None:
                log.info("node %s died; replacing it", ns)
                self.remove_node(ns)
                replaced.append(self.add_node())
        return replaced

    def shutdown(self) -> None:
        for ns in list(self._procs):
            if ns != self.head_ns:
                self._kill_ns(ns)
        if self.head_ns in self._procs:
            self._kill_ns(self.head_ns)
        for ns in self._procs:
            _ip("netns", "del", ns, check=False)
            # The pair goes with its namespace, but only once the kernel has reaped it.
            _ip("link", "del", self._veth(ns), check=False)
        _ip("link", "del", self.bridge, check=False)
        for ns in self._procs:
            shutil.rmtree(f"/tmp/{ns}", ignore_errors=True)        # the node's --temp-dir
            shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
        self._procs.clear()
        # What a start that failed half-way made before its `ray start` was recorded.
        cleanup_leftovers(self.id)

    # ---- helpers -----------------------------------------------------------------------------
    def _veth(self, ns: str) -> str:
        return ns + "v"          # host end of the node's veth pair (names stay under 16 chars)

    def _make_ns(self, ns: str, ip: str, tag: str) -> None:
        veth, peer = ns + "v", ns + "p"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        for args in (("link", "set", "lo", "up"), ("link", "set", peer, "name", "eth0"),
                     ("addr", "add", f"{ip}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                     ("route", "add", "default", "via", self.host_ip)):   # Ray finds its IP by this route
            _ip("-n", ns, *args)
        # `ip netns exec` mounts this over /etc/resolv.conf: gloo looks up its peers' names, and
        # the machine's DNS server is not reachable from here; a query would wait out its
        # timeout (seconds per connection) and would leave the namespace. This one fails at once.
        os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
        with open(os.path.join(ETC_NETNS, ns, "resolv.conf"), "w") as f:
            f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def _ray(self, ns: str, args: list[str]) -> None:
        log_path = os.path.join(self.log_dir, f"{ns}.log")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, _ray_bin(), "start", "--block",
                                     "--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}", *args],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=self._node_env())
        self._procs[ns] = proc

    def _wait_started(self, ns: str) -> None:
        proc, log_path = self._procs[ns], os.path.join(self.log_dir, f"{ns}.log")

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"`ray start` in {ns} exited with {proc.returncode}; see {log_path}")
            with open(log_path, errors="replace") as f:
                return "Ray runtime started" in f.read()
        wait_until(started, 120, f"Ray to start in namespace {ns}", interval_s=0.2)

    def _node_env(self) -> dict[str, str]:
        # gloo picks its interface from the hostname, which resolves to 127.0.0.1: unreachable
        # from another namespace. Workers inherit this from their raylet.
        return dict(os.environ, **self.auth_env(), GLOO_SOCKET_IFNAME="eth0")

    def _kill_ns(self, ns: str) -> None:
        result = _ip("netns", "pids", ns, check=False)
        for pid in (int(p) for p in result.stdout.split() if p.strip().isdigit()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = self._procs.get(ns)
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("`ray start` of %s did not exit", ns)


def _names() -> tuple[list[str], list[str]]:
    """Names of the machine's network namespaces and links."""
    namespaces = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = []
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        if ":" in line:
            links.append(line.split(":")[1].strip().split("@")[0])
    return namespaces, links


def leftover_ids() -> list[str]:
    """Ids of the campaigns whose namespaces or links are on this machine (running or left by
    a killed runner)."""
    namespaces, links = _names()
    etc = os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []
    return sorted({m.group(1) for name in namespaces + links + etc if (m := NAME_ID_RE.match(name))})


def _owned(name: str, campaign: str) -> bool:
    if campaign == "all":
        return name.startswith(PREFIX)
    m = NAME_ID_RE.match(name)
    return m is not None and m.group(1) == campaign


def cleanup_leftovers(campaign: str) -> dict:
    """Remove the namespaces (killing their processes), links and bridges of one campaign, by
    its five-digit id, or of every campaign with "all" (concurrent ones included: opt-in)."""
    if campaign != "all" and not ID_RE.match(campaign):
        raise ValueError(f"campaign id {campaign!r}: five digits (see `python -m chaos heal`), or 'all'")
    removed: dict[str, list[str]] = {"namespaces": [], "links": []}
    namespaces, _ = _names()
    for ns in namespaces:
        if _owned(ns, campaign):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
            removed["namespaces"].append(ns)
    for name in os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []:
        if _owned(name, campaign):
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
    try:
        os.rmdir(ETC_NETNS)        # only when empty: other users of `ip netns` keep theirs
    except OSError:
        pass
    _, links = _names()
    for name in links:
        if _owned(name, campaign):
            _ip("link", "del", name, check=False)
            removed["links"].append(name)
    return removed

"""A local Ray of a run's own, that outlives the driver which started it.

`ray.init()` with no address starts a Ray that fate-shares with the driver: kill the driver and
the run goes with it. A run that must outlive its driver (issue 32: a killed `pretrain.py` whose
run goes on, and a second one that attaches to it) needs a Ray that the next driver can find.
`LocalRay(storage)` is that Ray: started by `ray start --head` (its processes are nobody's
children once it returns), recorded under `<root>/<hash of the storage URL>/`, so the next driver
with the same storage finds it on this machine, and stopped by whoever sees the run end:

- the driver that followed the run to its end (`examples/pretrain.py`, or `fit()` when it
  started the Ray itself);
- otherwise the run's controller, once it gave up waiting for a driver to collect the outcome
  (`stop_own_ray`, from elastic._controller.actor).

Every process of such a Ray (the GCS, the raylet, Ray's agents, and the workers the raylet
starts) carries `ELASTIC_LOCAL_RAY=<its directory>` in its environment, which is how `stop()`
finds all of them, on any process group. The processes stay in the starting driver's process
group, so Ctrl-C in a terminal (SIGINT to the foreground group), or a supervisor that kills the
driver's group, still takes the run down with the driver, as before; SIGKILL of the driver's
process alone does not.

Linux only (the sweep reads /proc); elsewhere `supported()` is False and callers fall back to a
Ray that ends with its driver.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic._credentials import mask_url
from elastic.errors import ElasticError

log = logging.getLogger(__name__)

MARKER = "ELASTIC_LOCAL_RAY"        # in the environment of every process of a LocalRay
RECORD = "ray.json"                 # in a LocalRay's directory: its address, written once it is up
START_TIMEOUT_S = 120.0             # `ray start` on a loaded 2-core machine took 4.5 s
STOP_TIMEOUT_S = 20.0


class LocalRayError(ElasticError):
    """A run's local Ray could not be started (what `ray start` printed is in the message)."""


def supported() -> bool:
    """Whether this machine can keep a LocalRay: its processes are found through /proc."""
    return sys.platform.startswith("linux") and os.path.isdir("/proc")


def default_root() -> Path:
    """Short and per user: Ray's socket paths live under it, and must stay under 108 bytes."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return Path(base) / f"elastic-ray-{os.getuid()}"


def storage_key(storage: str) -> str:
    """The storage URL as one run names it everywhere: a local path made absolute."""
    return storage if "://" in storage else os.path.abspath(storage)


class LocalRay:
    """The local Ray of the run on `storage`, on this machine (see the module)."""

    def __init__(self, storage: str, root: Path | None = None):
        self.storage = storage_key(storage)
        digest = hashlib.sha256(self.storage.encode()).hexdigest()[:12]
        self.dir = (root or default_root()) / digest

    def address(self) -> str | None:
        """The GCS address of this storage's Ray when it is up, else None (a record whose Ray is
        gone is removed)."""
        record = self._live_record()
        return None if record is None else str(record["address"])

    def connect(self, *, num_cpus: int | None = None, num_gpus: int | None = None) -> tuple[str, bool]:
        """The address of this storage's Ray, starting one when none is up; and whether this call
        started it. Prepares this process's token authentication for it either way."""
        record = self._live_record()
        if record is not None:
            self._use_auth_mode(record.get("auth_mode"))
            return str(record["address"]), False
        return self.start(num_cpus=num_cpus, num_gpus=num_gpus), True

    def _live_record(self) -> dict | None:
        """This storage's Ray's record when its GCS is up (one that outlived its Ray is removed)."""
        record = self._record()
        if record is None:
            return None
        if not any(name == "gcs_server" for _, name in processes(str(self.dir))):
            self._forget()
            return None
        return record

    def start(self, *, num_cpus: int | None = None, num_gpus: int | None = None) -> str:
        """Start a new Ray for this storage (after stopping any left over); its GCS address."""
        self.stop()
        # The logs of this storage's earlier Ray go: the newest run's are kept, as Ray keeps
        # session_latest.
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        quiet_local_ray_auth()          # the mode Ray picks, spelled out: the drivers need the same
        port = _free_port()
        # Ray's CLI through this interpreter: the `ray` script need not be on PATH or beside it.
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                   f"--temp-dir={self.dir}", "--include-dashboard=false", "--disable-usage-stats"]
        if num_cpus is not None:
            command.append(f"--num-cpus={num_cpus}")
        if num_gpus is not None:
            command.append(f"--num-gpus={num_gpus}")
        env = {**os.environ, MARKER: str(self.dir)}
        env.pop("RAY_ADDRESS", None)
        began = time.time()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as error:
            self.stop()
            raise LocalRayError(f"`ray start` for the run on {mask_url(self.storage)} did not return within "
                                f"{START_TIMEOUT_S:.0f}s; its logs are under {self.dir}") from error
        if done.returncode != 0:
            self.stop()
            raise LocalRayError(f"`ray start` for the run on {mask_url(self.storage)} failed (exit "
                                f"{done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}")
        address = f"127.0.0.1:{port}"
        record = {"address": address, "storage": mask_url(self.storage), "started_at": began,
                  "started_by": os.getpid(), "auth_mode": os.environ.get("RAY_AUTH_MODE")}
        tmp = self.dir / f".{RECORD}.{os.getpid()}"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.dir / RECORD)
        log.info("started a local Ray for the run on %s at %s in %.1fs (it outlives this driver; the run's "
                 "end stops it)", mask_url(self.storage), address, time.time() - began)
        return address

    def stop(self) -> int:
        """Kill every process of this storage's Ray (this one's aside); the number killed."""
        killed = stop_marked(str(self.dir))
        self._forget()
        return killed

    def _record(self) -> dict | None:
        try:
            return json.loads((self.dir / RECORD).read_text())
        except (OSError, ValueError):
            return None

    def _forget(self) -> None:
        try:
            (self.dir / RECORD).unlink()
        except FileNotFoundError:
            pass

    @staticmethod
    def _use_auth_mode(mode: str | None) -> None:
        """The token mode the Ray was started with (`mode`), for this driver's `ray.init` (a
        driver with another mode is refused by the GCS)."""
        if mode and "RAY_AUTH_MODE" not in os.environ:
            if mode == "token":
                quiet_local_ray_auth()
            else:
                os.environ["RAY_AUTH_MODE"] = mode


def processes(marker: str, seen: set[int] | None = None, variable: str = MARKER) -> list[tuple[int, str]]:
    """(pid, name) of this user's processes of the Ray marked `marker`: those whose environment
    has `variable`=`marker` (everything `ray start` spawned, and the workers), and the agents of
    its raylets, which some Ray versions start with an environment that names only their raylet
    (RAY_RAYLET_PID). `seen` keeps every marked pid across calls, so an agent whose raylet has
    gone is still known."""
    wanted = f"{variable}={marker}".encode()
    # An agent whose environment Ray's process title overwrote names nothing: it is known by the
    # files it holds open under the marked Ray's directory (its logs; for another marker nothing
    # is open under it). One walk of /proc finds all three kinds.
    prefix = marker.rstrip("/") + "/"
    seen = set() if seen is None else seen
    marked, by_raylet, holding = [], {}, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:     # gone meanwhile, or another user's
            continue
        if wanted in environ:
            marked.append(pid)
            continue
        raylet = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"RAY_RAYLET_PID=")), b"")
        if raylet.isdigit():
            by_raylet[pid] = int(raylet)
        if pid != os.getpid() and _holds_file_under(pid, prefix):
            holding.append(pid)
    seen.update(marked)
    agents = [p for p, raylet in by_raylet.items() if raylet in seen]
    agents += [pid for pid in holding if pid not in agents]
    found = []
    for pid in marked + agents:
        try:
            with open(f"/proc/{pid}/comm") as f:
                found.append((pid, f.read().strip()))
        except OSError:
            continue
    return found


def _holds_file_under(pid: int, prefix: str) -> bool:
    """Whether process `pid` has a file open whose path starts with `prefix`."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:     # gone meanwhile, or another user's
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
        except OSError:
            continue
    return False


def stop_marked(marker: str) -> int:
    """SIGKILL every process of the Ray marked `marker` but this one, until none is left
    (STOP_TIMEOUT_S); the number killed."""
    killed: set[int] = set()
    seen: set[int] = set()
    deadline = time.time() + STOP_TIMEOUT_S
    while True:
        left = [pid for pid, _ in processes(marker, seen) if pid != os.getpid()]
        if not left:
            return len(killed)
        if time.time() > deadline:
            log.warning("processes of the local Ray %s outlived SIGKILL: %s", marker, left)
            return len(killed)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def stop_own_ray() -> bool:
    """From a process of a LocalRay (the run's controller, when no driver collected its end):
    stop that Ray, this process last. False when this process is not in one."""
    marker = os.environ.get(MARKER)
    if not marker or not supported():
        return False
    log.warning("the run ended with no driver to collect it: stopping its local Ray")
    stop_marked(marker)
    try:
        Path(marker, RECORD).unlink()
    except OSError:
        pass
    os._exit(0)


def quiet_local_ray_auth() -> None:
    """Before `ray.init` starts a new local Ray: spell out the token authentication Ray turns on
    for it anyway, which silences the notice Ray logs on every start ("Token authentication is
    enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out", Ray's
    authentication_token_setup.enable_token_auth_by_default; it warns only when RAY_AUTH_MODE is
    unset). The notice is noise on a Ray that this process starts and stops, and "disabled" would
    open that Ray to anyone on the network, so the mode becomes the one Ray picks: "token" (with
    ~/.ray/auth_token, which Ray creates when missing). A mode set by the user is left alone. Only
    for a Ray started here: one being joined needs the mode it was started with.

    Through Ray's own `_enable_token_auth` (what enable_token_auth_by_default calls before its
    warning): besides RAY_AUTH_MODE it refreshes the config that importing Ray cached, which still
    says "disabled" when only the variable changes (ray.init then fails with AuthenticationError).
    Private API: without it the notice stays, nothing else changes."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:
        return
    _enable_token_auth()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

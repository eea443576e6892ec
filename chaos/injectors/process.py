"""Faults on worker processes by signal: kill (SIGKILL), preempt (SIGTERM), hang (SIGSTOP until
the heal's SIGCONT) and slow (SIGSTOP/SIGCONT duty cycles until the heal); and by request file
(the job's --bitflip-requests): a flipped parameter bit (bitflip) or a wrong gradient (bad_gradient)."""
from __future__ import annotations

import os
import random
import signal
import threading

from chaos.faults import BadGradient, BitFlip, Fault, Hang, KillController, KillDriver, KillWorker, Preempt, Slow
from chaos.injectors import Active, Injector, Skip
from chaos.procs import Proc

# The word before a request's seed that asks for a wrong gradient: elastic._worker.fault_gate's
# GRADIENT_REQUEST, which the worker reads (chaos imports nothing of the runtime's).
GRADIENT_REQUEST = "gradient"


def _detail(workers: list[dict], procs: list[Proc], sent: list[bool]) -> dict:
    return {"ranks": [w["rank"] for w in workers], "pids": [p.pid for p in procs],
            "nodes": sorted({w.get("node_id") for w in workers if w.get("node_id")}),
            "signalled": sum(sent)}


class _OneSignal(Injector):
    sig = signal.SIGKILL

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, (KillWorker, Preempt))
        workers = self.targets(fault.target, rng)
        procs = self.procs(workers)
        sent = [p.signal(self.sig) for p in procs]
        return Active(fault, _detail(workers, procs, sent))


class KillWorkerInjector(_OneSignal):
    """Nothing to heal: the runtime replaces the worker; that is what is under test."""

    kind = "kill_worker"
    sig = signal.SIGKILL


class KillAllWorkersInjector(_OneSignal):
    """Every worker at once. Nothing to heal: the runtime restores from its nodes' keepers."""

    kind = "kill_all_workers"
    sig = signal.SIGKILL


class KillControllerInjector(Injector):
    """SIGKILL to the controller's process, only while status.json says the run is running (the
    runtime adopts its workers from that state; a controller lost in the middle of a re-form
    restarts them from storage). Nothing to heal: Ray restarts the controller. The detail keeps
    the workers' pids, which the invariant finds alive in the replacement's status."""

    kind = "kill_controller"

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, KillController)
        status = self.env.view.status() or {}
        controller = status.get("controller") or {}
        if status.get("state") != "running" or not controller.get("pid"):
            raise Skip(f"the run is {status.get('state')!r}, not running under a named controller")
        proc = Proc.of_worker(controller["pid"])
        if proc is None:
            raise Skip(f"pid {controller['pid']} is no live Ray process")
        sent = proc.signal(signal.SIGKILL)
        return Active(fault, {"pid": proc.pid, "signalled": int(sent), "restarts_before": controller.get("restarts"),
                              "worker_pids": sorted(w["pid"] for w in status.get("workers") or [])})


class KillDriverInjector(Injector):
    """SIGKILL to the job's driver process alone, only while status.json says the run is running
    under a run id. The campaign sees the driver gone (Env.drivers_killed) and starts the job
    again; nothing to heal. The detail keeps the run id, which the run must still have at its
    end (it went on: the second driver attached instead of starting a run of its own)."""

    kind = "kill_driver"

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, KillDriver)
        status = self.env.view.status() or {}
        pid = self.env.driver_pid()
        if status.get("state") != "running" or not status.get("run_id"):
            raise Skip(f"the run is {status.get('state')!r}, not running under a run id")
        if pid is None:
            raise Skip("no live driver process")
        try:
            os.kill(pid, signal.SIGKILL)
            sent = True
        except ProcessLookupError:
            sent = False
        if sent:
            self.env.drivers_killed.append(pid)
        return Active(fault, {"pid": pid, "signalled": int(sent), "run_id": status["run_id"],
                              "step": status.get("step")})


class PreemptInjector(_OneSignal):
    """SIGTERM is a notice: the worker commits and leaves on its own; nothing to heal."""

    kind = "preempt"
    sig = signal.SIGTERM


class BitFlipInjector(Injector):
    """A request file per target worker, named after its pid, in the job's --bitflip-requests
    directory: the worker claims it at its next step boundary and flips a bit the file's seed
    picks (elastic._worker.fault_gate.BitFlipRequests). Nothing to heal: the runtime must find
    it and roll back."""

    kind = "bitflip"
    fault_type: type[Fault] = BitFlip
    request = ""          # what the request says before its seed (a bit flip: nothing)

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, self.fault_type)
        directory = getattr(self.env.job_spec, "bitflip_requests", None)
        if not directory:
            raise Skip("the job was started without --bitflip-requests")
        workers = self.targets(fault.target, rng)  # type: ignore[attr-defined]
        for w in workers:
            path = os.path.join(directory, f"pid-{w['pid']}")
            with open(path + ".tmp", "w") as f:
                f.write(f"{self.request} {rng.getrandbits(64)}".strip())
            os.replace(path + ".tmp", path)      # whole, or not there: the worker reads it once
        return Active(fault, {"ranks": [w["rank"] for w in workers], "pids": [w["pid"] for w in workers],
                              "requests": directory})


class BadGradientInjector(BitFlipInjector):
    """The same request, asking for a wrong gradient (GRADIENT_REQUEST): the worker's backward
    computes it from its next step boundary on, until its generation ends."""

    kind = "bad_gradient"
    fault_type = BadGradient
    request = GRADIENT_REQUEST


class HangInjector(Injector):
    kind = "hang"

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, Hang)
        workers = self.targets(fault.target, rng)
        procs = self.procs(workers)
        sent = [p.signal(signal.SIGSTOP) for p in procs]
        return Active(fault, _detail(workers, procs, sent), state=procs)

    def heal(self, active: Active) -> dict:
        # The runtime has usually killed a hung worker by now; SIGCONT only the survivors.
        resumed = [p.pid for p in active.state if p.signal(signal.SIGCONT)]
        return {"resumed": resumed}


class SlowInjector(Injector):
    """Steals CPU: the target is stopped `stopped_share` of every `period_s` until healed.
    Each stop is far shorter than a heartbeat timeout, so this is a straggler, not a hang."""

    kind = "slow"

    def invoke(self, fault: Fault, rng: random.Random) -> Active:
        assert isinstance(fault, Slow)
        workers = self.targets(fault.target, rng)
        procs = self.procs(workers)
        stop = threading.Event()
        cycles = {"n": 0}
        stopped_s = fault.period_s * fault.stopped_share
        running_s = fault.period_s - stopped_s

        def duty_cycle() -> None:
            # The waits here are the fault itself (time stolen from the process), not
            # synchronisation: Event.wait returns at once when the heal sets `stop`.
            while not stop.is_set():
                for p in procs:
                    p.signal(signal.SIGSTOP)
                stop.wait(stopped_s)
                for p in procs:
                    p.signal(signal.SIGCONT)
                cycles["n"] += 1
                stop.wait(running_s)

        thread = threading.Thread(target=duty_cycle, name=f"chaos-slow-{procs[0].pid}", daemon=True)
        thread.start()
        detail = _detail(workers, procs, [True] * len(procs))
        detail.update(stopped_share=fault.stopped_share, period_s=fault.period_s)
        return Active(fault, detail, state=(stop, thread, procs, cycles))

    def heal(self, active: Active) -> dict:
        stop, thread, procs, cycles = active.state
        stop.set()
        thread.join(timeout=5)
        for p in procs:
            p.signal(signal.SIGCONT)
        return {"cycles": cycles["n"]}

"""A controller over the unit tests' fakes (fakes.py), and the moves the tests make on it: the
shared harness of the controller's tests (no Ray, a fake clock)."""
from fakes import FakeCheckpoints, FakeGroup, FakeRecorder

from elastic._controller.controller import Controller
from elastic._controller.states import RunState
from elastic._protocol import WorkerPhase
from elastic.config import FailureConfig, ScalingConfig
from support import FakeClock


def make(min_workers=2, max_workers=3, capacity=3, max_failures=3, latest=None, fence=None, startup_wait_s=10.0,
         spare_workers=0, step_timeout_s="auto", recorder=None, failure=None, checkpoints=None, unix_wall=False,
         **kwargs):
    """A controller over the fakes. `failure`: a FailureConfig instead of the one built from the
    arguments; `checkpoints`: instead of FakeCheckpoints(latest, fence); `unix_wall`: its wall
    clock is unix seconds that move with the fake clock."""
    clock, group = FakeClock(), FakeGroup(capacity)
    transitions = []
    if unix_wall:
        kwargs["wall_clock"] = lambda: 1.7e9 + clock()
    controller = Controller(
        group, recorder or FakeRecorder(), checkpoints or FakeCheckpoints(latest, fence),
        scaling=ScalingConfig(min_workers=min_workers, max_workers=max_workers, startup_wait_s=startup_wait_s,
                              spare_workers=spare_workers),
        failure=failure or FailureConfig(max_failures=max_failures, heartbeat_timeout_s=5.0, collective_timeout_s=30.0,
                                         rendezvous_timeout_s=60.0, step_timeout_s=step_timeout_s),
        total_steps=100, clock=clock, callbacks=(lambda old, new, why: transitions.append((old, new)),), **kwargs)
    return controller, group, clock, transitions


def start(controller, group):
    controller.tick()   # scheduling: places workers
    controller.tick()   # all ready -> starting -> running
    assert controller.state.state == RunState.RUNNING
    return controller.state.members


def interrupt(group, wids, generation, step):
    for wid in wids:
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=generation, step=step,
                         error_type="RuntimeError", error_message="gloo: Connection reset by peer")


def stop_requested(controller, group, reason="maintenance"):
    """A running generation of 3 that completed 7 steps, then `elastic stop`: the members, each
    told to commit and leave (the controller is STOPPING)."""
    members = start(controller, group)
    group.complete_steps(members[0], 1, 7, 3)
    controller.tick()
    controller.checkpoints.stop = {"format": 1, "reason": reason}
    controller.tick()
    assert controller.state.state == RunState.STOPPING
    return members

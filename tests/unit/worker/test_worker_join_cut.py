"""A rank joining a generation that a member never joins (it did not get its plan: refused,
unreachable, dead) waits on the generation's store for that member's address. The controller
cuts the group of the members that got their plan (reliability review R3-6): the cut must
release the join at once, not after collective_timeout_s, and leave the worker ready for the
next generation (its process and state kept: the recovery stays warm).

A real TrainWorker in a fresh interpreter (its join forms the default process group), with
gloo on a store on this machine; the member that never comes is simply never started."""
from __future__ import annotations

import pytest

from support import fresh_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

COLLECTIVE_TIMEOUT_S = 300     # the join's own timeout: beyond this test's, waiting it out cannot pass
RELEASE_DEADLINE_S = 60        # far below it: a join released by the cut ends well within this

PROGRAM = """
import sys, threading, time
from ray import cloudpickle
from elastic._protocol import GenerationPlan, RestorePlan, RunSpec, WorkerPhase
from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
from elastic._worker import rendezvous
from elastic._worker.rendezvous import HostedStore
from elastic._worker.worker import TrainWorker

role, when, storage = sys.argv[1], sys.argv[2], sys.argv[3]
TIMEOUT_S, DEADLINE_S = %d, %d


def loop(ctx):
    # The name torch gave this generation's default group (a fresh worker's first is "0"): the
    # name is in every rendezvous key, so a worker whose join failed must name its next the same.
    import torch.distributed as dist
    with open(sys.argv[3] + "/group_name", "w") as out:
        out.write(dist.distributed_c10d._get_default_group().group_name)


def wait_for(condition, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            print("timed out waiting for", what, flush=True)
            sys.exit(3)
        threading.Event().wait(0.01)


spec = RunSpec(user_code=cloudpickle.dumps((loop, None)), total_steps=1, seed=0, scaling=ScalingConfig(),
               checkpoint=CheckpointConfig(storage=storage, keep=1, async_save=False, max_consecutive_failures=1),
               failure=FailureConfig(collective_timeout_s=TIMEOUT_S))
worker = TrainWorker(spec)
if role == "host":      # the plan's rank 0: it hosts the store (what rendezvous_address does)
    worker._membership.hosted = HostedStore("127.0.0.1")
    rank, address = 0, worker._membership.hosted.address
else:                   # rank 1 of a store hosted by a rank 0 that never joins (here, in this process)
    absent = HostedStore("127.0.0.1")
    rank, address = 1, absent.address
if when == "before_join":
    # The cut comes after the plan but before the training thread reaches the join.
    entered, cut = threading.Event(), threading.Event()
    join_store = rendezvous.join_store

    def gated(*args):
        entered.set()
        cut.wait(DEADLINE_S)
        return join_store(*args)
    rendezvous.join_store = gated
worker.start_generation(GenerationPlan(generation=1, rank=rank, world_size=2, master_addr=address[0],
                                       master_port=address[1], restore=RestorePlan("fresh"), timeout_s=TIMEOUT_S))


def joining():
    frame = sys._current_frames().get(worker._thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "init_process_group":
            return True
        frame = frame.f_back
    return False


if when == "before_join":
    wait_for(entered.is_set, "the training thread to begin its join")
    cut_at = time.monotonic()
    worker.request_stop(1, cut_group=True)
    cut.set()
else:
    wait_for(joining, "the training thread to wait in init_process_group")
    print("joining", flush=True)
    cut_at = time.monotonic()
    worker.request_stop(1, cut_group=True)
wait_for(lambda: worker.poll(1.0).phase != WorkerPhase.RUNNING, "the join to end")
report = worker.poll()
print("left", report.phase, report.error_kind, report.error_type, round(time.monotonic() - cut_at, 2), flush=True)
worker._thread.join(DEADLINE_S)
# The next generation (alone, on a store of its own) starts and runs on the same worker.
worker._membership.hosted = HostedStore("127.0.0.1")
worker.start_generation(GenerationPlan(generation=2, rank=0, world_size=1, master_addr="127.0.0.1",
                                       master_port=worker._membership.hosted.address[1], restore=RestorePlan("fresh"),
                                       timeout_s=TIMEOUT_S))
wait_for(lambda: worker.poll(1.0).phase != WorkerPhase.RUNNING, "the next generation to end")
report = worker.poll()
print("next", report.phase, report.generation, report.error_type, report.error_message, flush=True)
""" % (COLLECTIVE_TIMEOUT_S, RELEASE_DEADLINE_S)  # noqa: UP031 - the program's own f-strings use braces


@pytest.mark.parametrize("role, when", [("host", "in_join"), ("joiner", "in_join"), ("joiner", "before_join")],
                         ids=["store_host_in_join", "rank_in_join", "cut_before_the_join"])
def test_a_cut_releases_a_rank_joining_a_generation_whose_peer_never_comes(tmp_path, role, when):
    done = fresh_python(PROGRAM, role, when, str(tmp_path), timeout_s=200)
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, out + done.stderr.decode(errors="replace")[-4000:]
    lines = out.splitlines()
    if when == "in_join":
        assert "joining" in lines, out
    # Out of the join within the deadline (far below its collective timeout): a broken group, the
    # "comm" kind the controller settles a survivor on, not an error of the loop's.
    left = next(line for line in lines if line.startswith("left "))
    assert left.split()[1:3] == ["interrupted", "comm"], out
    next_generation = next(line for line in lines if line.startswith("next "))
    assert next_generation.split()[1:3] == ["finished", "2"], out
    # ... under the name a fresh worker gives its first group, as its peers of that generation
    # would (before the fix, "1" after a join that failed inside init_process_group).
    assert (tmp_path / "group_name").read_text() == "0"

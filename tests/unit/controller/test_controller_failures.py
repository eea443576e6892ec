"""The controller and the errors behind failures (reliability review F8, F13), with fakes (no Ray):
a collective error that recurs at the same step is the loop's bug and fails the run with the
worker's own error; a failed GPU's worker is replaced; a run that fails on too many failures
still says what the last one was."""
import pytest
from harness import make, start

from elastic._controller.states import RunState
from elastic._protocol import WorkerPhase
from elastic.errors import TooManyFailuresError

pytestmark = pytest.mark.timeout(30)

MISMATCH = "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (2), got ({n}))"
OWN = MISMATCH.format(n=3)      # rank 0's own error in broken_group
OTHER = "ProcessGroupGloo::broadcast: invalid root rank: 5"
CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
          "[10.0.0.{n}]:{port}")


def broken_group(group, members, generation, step, *, own=OWN, port=41537):
    """Rank 0 made the wrong call (its own error); the others only saw it leave."""
    errors = {}
    for rank, wid in enumerate(members):
        message = own if rank == 0 else CLOSED.format(n=rank, port=port + rank)
        errors[rank] = RuntimeError(message)
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=generation, rank=rank, step=step,
                         error_type="RuntimeError", error_message=message, error_kind="comm",
                         error_traceback=f"Traceback (rank {rank}, generation {generation})\n{message}",
                         error=errors[rank])
    return errors


def detect(controller, clock):
    controller.tick()
    clock.advance(5.1)              # heartbeat_timeout_s: no peer turned out lost
    controller.tick()


def reform(controller, group, members, generation, step):
    """The survivors left the broken generation before it was judged a fault: the group
    re-formed (warm) in the tick that opened the recovery, and runs again."""
    assert controller.state.state == RunState.RUNNING and controller.generation == generation + 1
    return controller.state.members


def test_a_collective_error_recurring_at_the_same_step_fails_the_run_with_the_original_error():
    controller, group, clock, _ = make(max_failures=20)
    members = start(controller, group)
    broken_group(group, members, 0, step=4)
    detect(controller, clock)
    assert controller.generation == 1                                     # the first time: maybe a fault
    assert controller.failures[-1].cause == "collective_error"
    assert "invalid tensor size" in controller.failures[-1].message
    members = reform(controller, group, members, 0, 4)
    errors = broken_group(group, members, 1, step=4, own=MISMATCH.format(n=5), port=52000)  # same error
    detect(controller, clock)
    assert controller.state.state == RunState.FAILED
    assert controller.failures[-1].cause == "user_error" and controller.infra_failures == 1
    error = controller.error
    assert error["exception"] is errors[0] and error["type"] == "RuntimeError"
    assert error["message"] == MISMATCH.format(n=5)            # this attempt's own words
    assert error["traceback"].startswith("Traceback (rank 0, generation 1)") and error["ranks"] == [0]


def test_a_collective_error_at_another_step_or_of_another_kind_is_still_recovered():
    controller, group, clock, _ = make(max_failures=20)
    members = start(controller, group)
    broken_group(group, members, 0, step=4)
    detect(controller, clock)
    members = reform(controller, group, members, 0, 4)
    broken_group(group, members, 1, step=9)                               # progress since: a new fault
    detect(controller, clock)
    members = reform(controller, group, members, 1, 9)
    broken_group(group, members, 2, step=9, own=OTHER)                    # same step, another error
    detect(controller, clock)
    assert controller.generation == 3 and controller.infra_failures == 3


def test_a_run_failing_on_too_many_failures_names_the_last_workers_error_and_its_traceback():
    controller, group, clock, _ = make(max_failures=1)
    members = start(controller, group)
    broken_group(group, members, 0, step=4)
    detect(controller, clock)
    members = reform(controller, group, members, 0, 4)
    broken_group(group, members, 1, step=6)
    detect(controller, clock)
    assert controller.state.state == RunState.FAILED
    assert isinstance(controller.error["exception"], TooManyFailuresError)
    assert "last error: RuntimeError: ProcessGroupGloo::allgather" in controller.error["message"]
    assert controller.error["traceback"].startswith("Traceback (rank 0, generation 1)")


def test_a_failed_gpu_replaces_its_worker_and_the_others_recover_warm():
    controller, group, clock, _ = make(max_failures=3)
    members = start(controller, group)
    ecc = RuntimeError("CUDA error: uncorrectable ECC error encountered")
    group.set_report(members[1], WorkerPhase.FAILED, generation=0, rank=1, step=4, error_type="RuntimeError",
                     error_message=str(ecc), error_traceback="tb", error_kind="hardware", error=ecc)
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and controller.infra_failures == 1
    assert controller.failures[-1].cause == "hardware_error" and controller.failures[-1].error_traceback == "tb"
    assert group.killed == [(members[1], "hardware_error")]
    assert group.cuts[-1] is True       # the survivors cut their connections to the replaced worker


def test_lost_connections_alone_at_the_same_step_stay_a_fault():
    """Every rank saw only its connections go (a flapping link), twice at the same step: recovered."""
    controller, group, clock, _ = make(max_failures=20)
    members = start(controller, group)
    for generation in (0, 1):
        broken_group(group, members, generation, step=4, own=CLOSED.format(n=9, port=1000 + generation))
        detect(controller, clock)
        members = reform(controller, group, members, generation, 4)


def test_a_worker_that_refuses_its_generation_is_replaced_and_the_run_goes_on():
    """RayWorkerGroup.start_generation kills a worker whose call raised (RayTaskError) and raises
    WorkerLostError (tests/unit/controller/test_ray_group_errors.py); the controller recovers without it."""
    from elastic.errors import WorkerLostError
    controller, group, clock, _ = make(capacity=4, max_workers=3, max_failures=3)
    members = start(controller, group)
    group.die(members[2])
    controller.tick()                                        # recovering; a replacement is placed
    for rank, wid in enumerate(members[:2]):
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=0, rank=rank, step=5)
    refusing = members[1]
    start_generation = group.start_generation

    def refuse_once(plans):
        group.start_generation = start_generation
        start_generation(plans)
        group.kill(refusing, "could not start the generation: RuntimeError: still running generation 0")
        raise WorkerLostError(f"worker {refusing} could not start the generation and was replaced")
    group.start_generation = refuse_once
    controller.tick()                                        # generation 1 fails to start: recovering
    assert controller.state.state == RunState.RECOVERING and controller.generation == 1
    assert (refusing, "could not start the generation: RuntimeError: still running generation 0") in group.killed
    for wid in controller.state.survivors:                   # the others leave the rendezvous it broke
        if wid != refusing:
            group.set_report(wid, WorkerPhase.INTERRUPTED, generation=1, step=5)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and refusing not in controller.state.members
    assert len(controller.state.members) == 3 and controller.generation == 2


@pytest.mark.parametrize("how", ["no_answer", "refused"])
def test_a_member_that_does_not_take_its_plan_is_lost_at_its_rank_and_the_others_are_cut_from_the_join(how):
    """Reliability review R3-6: a re-form's start_generation hands out the plans, and one member
    does not take its own (it did not answer within heartbeat_timeout_s, or refused and was
    replaced by RayWorkerGroup). The others hold their plan and wait in the rendezvous for it:
    that member is lost at its rank in the new generation (killed), and the others' group is cut,
    so they leave the join at once and the recovery stays warm."""
    from elastic.errors import WorkerLostError
    from elastic.policies import Cause
    controller, group, clock, _ = make(capacity=4, max_workers=3, max_failures=3)
    members = start(controller, group)
    group.complete_steps(members[0], 1, 5, 3)
    controller.tick()
    group.die(members[2])
    controller.tick()                                        # recovering; a replacement is placed
    for rank, wid in enumerate(members[:2]):
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=0, rank=rank, step=5)
    failing = members[1]                                     # a survivor: rank 1 of generation 1
    start_generation = group.start_generation

    def fail_once(plans):
        group.start_generation = start_generation
        start_generation(plans)                              # every member is handed its plan ...
        if how == "refused":                                 # ... and this one's call fails
            group.kill(failing, "could not start the generation: RuntimeError: still running generation 0")
        raise WorkerLostError(f"worker {failing} could not start the generation", lost={failing: Cause.HANG})
    group.start_generation = fail_once
    controller.tick()                                        # generation 1 fails to start: recovering
    plans = group.generations[-1]
    joining = [w for w in plans if w != failing]
    assert controller.state.state == RunState.RECOVERING and controller.generation == 1
    assert controller.failures[-1].cause == "hang" and controller.failures[-1].ranks == (plans[failing].rank,) == (1,)
    assert failing in [w for w, _ in group.killed] and failing not in controller.state.survivors
    assert group.stops[-1] == (joining, 1) and group.cuts[-1] is True      # the joining members are cut
    for wid in joining:                                      # the cut ends their join: out of generation 1
        group.set_report(wid, WorkerPhase.INTERRUPTED, generation=1, rank=plans[wid].rank, step=5)
    controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.generation == 2
    assert failing not in controller.state.members
    assert group.generations[-1][members[0]].restore.kind == "broadcast"   # warm: the survivors' state


def corrupted(group, members, generation, step, named):
    """Every rank raised the same silent corruption verdict at `step`."""
    from elastic.errors import SilentCorruptionError
    error = SilentCorruptionError(f"silent data corruption at step {step}", step=step, ranks=named)
    for rank, wid in enumerate(members):
        group.set_report(wid, WorkerPhase.FAILED, generation=generation, rank=rank, step=step + 1,
                         error_type="SilentCorruptionError", error_message=str(error), error_kind="sdc", error=error)


def test_silent_corruption_replaces_the_named_rank_rolls_back_and_a_node_named_twice_is_avoided():
    controller, group, clock, _ = make(max_failures=5)
    members = start(controller, group)
    corrupted(group, members, 0, step=4, named=(1,))
    controller.tick()
    failure = controller.failures[-1]
    assert failure.cause == "sdc" and failure.ranks == (1,) and failure.step == 4
    assert group.killed == [(members[1], "sdc")]
    # Not the survivors' live state (step 5): they may have trained on the corrupt gradient.
    assert controller.state.state in (RunState.RECOVERING, RunState.STARTING, RunState.RUNNING)
    if controller.state.state == RunState.RECOVERING:
        assert controller.state.restore_before == 4
    assert controller.bad_nodes.bad == () and group.avoided == ()
    for _ in range(3):
        controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.generation == 1
    (plan,) = {p.restore for p in group.generations[-1].values()}
    assert plan.kind != "broadcast" and "silent corruption, rolled back to before step 4" in plan.reason, plan
    members = controller.state.members
    corrupted(group, members, 1, step=9, named=(0,))     # a rank on the same node (the fakes' one node)
    controller.tick()
    assert controller.bad_nodes.bad == ("node",) and group.avoided == ("node",)

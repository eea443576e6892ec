"""The hang judge (elastic/_controller/hang_watch.py) on scripted positions and a fake clock: a
silent rank and a rank whose training thread has not moved are declared hung once the others
have waited the bound; a rank in a checkpoint save or ctx.restore, a generation's first steps and
a run with too few step times never are; the bound follows the step times."""
from __future__ import annotations

import pytest

from elastic._controller.hang_watch import MIN_ANSWER_GAPS, HangWatch
from elastic._controller.running import Fault, RunningWatch
from elastic._controller.slot_table import READY, WorkerView
from elastic._controller.states import Running
from elastic._protocol import PositionReport, ThreadPlace, WorkerPhase, WorkerReport
from elastic.config import FailureConfig
from elastic.errors import ConfigError
from elastic.policies import Cause
from support import FakeClock

pytestmark = pytest.mark.timeout(30)

SYNC, EXCHANGE, COMPUTING = ThreadPlace.SYNC, ThreadPlace.EXCHANGE, ThreadPlace.COMPUTING
GEN = 3
DEFAULT = FailureConfig()          # hang_timeout_s="auto": max(4 x p99, 2 s)


def view(wid: int, place: ThreadPlace, *, age: float, silent: float = 0.2, step: int = 40, nth: int = 10,
         generation: int = GEN, times: tuple[float, ...] = (), phase: WorkerPhase = WorkerPhase.RUNNING,
         exchanged: int | None = None) -> WorkerView:
    position = PositionReport(generation=generation, place=place, step=step, nth=nth, age_s=age, step_times=times,
                              exchanged=step if exchanged is None else exchanged)
    report = WorkerReport(phase=phase, generation=generation, rank=wid, step=step, has_state=True, records=[],
                          position=position)
    return WorkerView(wid=wid, status=READY, report=report, silent_s=silent)


def group(*views: WorkerView, generation: int = GEN) -> tuple[Running, dict[int, WorkerView]]:
    return Running(generation, [v.wid for v in views], started_at=FakeClock().now), {v.wid: v for v in views}


def taught(clock: FakeClock, step_s: float = 0.1, n: int = 40, world: int = 4) -> HangWatch:
    """A judge that has learned `n` step times of `step_s` from the first member."""
    watch = HangWatch(clock)
    st, views = group(view(0, COMPUTING, age=0.0, times=(step_s,) * n), *(view(w, COMPUTING, age=0.0)
                                                                        for w in range(1, world)))
    watch.learn(st, views)
    return watch


def judge(watch: HangWatch, *views: WorkerView, failure: FailureConfig = DEFAULT):
    """The verdict on these views (what they bring is not learned: `taught` did that)."""
    st, by_wid = group(*views)
    return watch.assess(st, by_wid, failure)


def test_a_silent_rank_is_hung_once_the_others_have_waited_the_bound():
    clock = FakeClock()
    watch = taught(clock)
    assert watch.bound(DEFAULT) == 2.0          # 4 x 0.1 s is below the floor
    waiting = [view(w, SYNC, age=1.9) for w in (0, 2, 3)]
    assert judge(watch, waiting[0], view(1, COMPUTING, age=0.2, silent=2.1), *waiting[1:]) is None
    waiting = [view(w, SYNC, age=2.0) for w in (0, 2, 3)]
    hung = judge(watch, waiting[0], view(1, COMPUTING, age=0.2, silent=2.2), *waiting[1:])
    assert hung is not None and hung.ranks == (1,) and hung.lost == [1]
    assert hung.detect_s == pytest.approx(2.2)  # since it was last heard: the fault came after that
    assert "silent" in hung.reason and "hang_timeout_s='auto'" in hung.reason


def test_a_rank_that_answers_is_not_hung_for_a_late_answer_alone():
    watch = taught(FakeClock())
    # Its answer is late (the poll hold is 1 s: late means beyond 2 s), but the others have not
    # waited the bound: nothing is held up.
    assert judge(watch, view(0, SYNC, age=0.5), view(1, COMPUTING, age=0.2, silent=1.9)) is None
    assert judge(watch, view(0, COMPUTING, age=2.5), view(1, COMPUTING, age=2.4, silent=3.0)) is None


def test_an_answering_rank_whose_training_thread_has_not_moved_is_hung():
    watch = taught(FakeClock())
    # Rank 2's thread entered the step's compute 3 s before its answer (0.5 s ago) and is still
    # there; its poll thread answers. The others have waited in DDP's sync for the bound.
    hung = judge(watch, view(0, SYNC, age=2.0), view(1, SYNC, age=2.05), view(2, COMPUTING, age=3.0, silent=0.5))
    assert hung is not None and hung.ranks == (2,) and hung.detect_s == pytest.approx(3.5)
    assert "has not moved" in hung.reason
    # The same in the boundary's exchange (a loop without DDP's sync).
    hung = judge(watch, view(0, EXCHANGE, age=2.1, step=39), view(1, COMPUTING, age=2.5, step=39))
    assert hung is not None and hung.ranks == (1,)


def test_a_pipeline_stage_that_waits_for_a_neighbour_is_not_named_for_it():
    # PP 2 x DP 2 (ranks 0,1: pipeline 0; 2,3: pipeline 1). Rank 2 froze in its step: rank 3
    # waits for its activations in the schedule's recv, ranks 0 and 1 in their stages' gradient
    # reduce with it. The frozen rank is named, not its neighbour.
    watch = taught(FakeClock())
    PIPELINE = ThreadPlace.PIPELINE
    sync = [view(w, SYNC, age=2.0) for w in (0, 1)]
    hung = judge(watch, *sync, view(2, COMPUTING, age=0.3, silent=2.2), view(3, PIPELINE, age=2.1))
    assert hung is not None and hung.ranks == (2,) and "silent" in hung.reason
    # The same when rank 2 answers but its thread is stuck in its compute (a hung kernel), and
    # when rank 3's recv is itself the front's place (no stage reduced yet).
    hung = judge(watch, *sync, view(2, COMPUTING, age=3.0), view(3, PIPELINE, age=2.1))
    assert hung is not None and hung.ranks == (2,) and "has not moved" in hung.reason
    hung = judge(watch, view(0, COMPUTING, age=0.1, silent=0.1), view(1, PIPELINE, age=0.05),
                 view(2, COMPUTING, age=3.0), view(3, PIPELINE, age=2.1))
    assert hung is not None and hung.ranks == (2,)
    # Stages that wait on each other with no one else to blame (a lost send between them): both.
    hung = judge(watch, *sync, view(2, PIPELINE, age=2.5), view(3, PIPELINE, age=2.4))
    assert hung is not None and hung.ranks == (2, 3)
    # A healthy pipeline: its waits are short against the bound.
    assert judge(watch, *sync[:1], view(1, PIPELINE, age=0.4), view(2, COMPUTING, age=0.2),
                 view(3, PIPELINE, age=0.3)) is None


def test_a_rank_that_moved_after_the_others_began_to_wait_is_judged_from_when_it_moved():
    watch = taught(FakeClock())
    # Rank 1 came out of a checkpoint save 0.5 s ago and computes: the others' long wait was
    # for its save, which is never judged. It has held them up for 0.5 s only.
    assert judge(watch, view(0, SYNC, age=2.5, silent=0.1), view(1, COMPUTING, age=0.5, silent=0.1)) is None
    hung = judge(watch, view(0, SYNC, age=4.2, silent=0.1), view(1, COMPUTING, age=2.2, silent=0.1))
    assert hung is not None and hung.ranks == (1,)


def test_never_a_rank_in_a_checkpoint_save_in_restore_or_joining():
    watch = taught(FakeClock())
    for place in (ThreadPlace.CHECKPOINT, ThreadPlace.RESTORING, ThreadPlace.JOINING):
        for silent in (0.2, 5.0):        # answering, or silent (a save may hold the GIL)
            assert judge(watch, view(0, SYNC, age=6.0), view(1, place, age=7.0, silent=silent, step=40),
                         view(2, SYNC, age=6.0)) is None, (place, silent)
    # The boundary's own work after an exchange and the tests' hold: judged only when silent.
    for place in (ThreadPlace.BOUNDARY, ThreadPlace.HELD):
        assert judge(watch, view(0, SYNC, age=6.0), view(1, place, age=7.0, step=40)) is None
        assert judge(watch, view(0, SYNC, age=6.0), view(1, place, age=7.0, silent=6.5, step=40)) is not None


def test_a_silent_rank_last_heard_in_a_save_is_hung_once_the_others_have_collected_a_later_exchange():
    # Its last answer came from inside the save of step 40 (a save may keep the poll thread from
    # the GIL), then it stopped. The others have since collected step 41's exchange, which it
    # entered after the save: it is out of the save, and silent. (CI, stop 23: found by the
    # heartbeat after 10 s instead.)
    watch = taught(FakeClock())
    for place in (ThreadPlace.CHECKPOINT, ThreadPlace.RESTORING, ThreadPlace.JOINING):
        waiting = [view(w, SYNC, age=2.0, step=42, exchanged=41) for w in (0, 2)]
        hung = judge(watch, waiting[0], view(1, place, age=0.3, silent=2.5, step=40), waiting[1])
        assert hung is not None and hung.ranks == (1,) and "silent" in hung.reason, place
        # Still in it as far as anyone knows: step 41's exchange not collected (a device exchange
        # is read a step late), or the rank answers.
        waiting = [view(w, SYNC, age=6.0, step=41, exchanged=40) for w in (0, 2)]
        assert judge(watch, waiting[0], view(1, place, age=7.0, silent=6.5, step=40), waiting[1]) is None
        waiting = [view(w, SYNC, age=6.0, step=42, exchanged=41) for w in (0, 2)]
        assert judge(watch, waiting[0], view(1, place, age=7.0, silent=0.2, step=40), waiting[1]) is None


def teach_gaps(watch: HangWatch, clock: FakeClock, gap: float, n: int, world: int = 4,
               generation: int = GEN) -> None:
    """The first member answers `n` more times, `gap` seconds apart."""
    for _ in range(n):
        clock.advance(gap)
        st, views = group(*(view(w, COMPUTING, age=0.0, generation=generation) for w in range(world)),
                          generation=generation)
        watch.learn(st, views)


def test_a_rank_silent_in_a_save_restore_or_join_is_hung_past_the_quiet_limit():
    # The mixed campaign gates its faults on commits: a partition or a freeze often lands in a
    # save, and each was found by the 10 s heartbeat. Once the run knows how far apart a healthy
    # member's answers come (here 1 s, the poll hold), a rank silent there for HANG_FACTOR x that
    # is hung; one that answers never is.
    clock = FakeClock()
    watch = taught(clock)
    teach_gaps(watch, clock, gap=1.0, n=MIN_ANSWER_GAPS - 1)
    assert watch.quiet_limit(2.0) is None                       # too few gaps known yet
    teach_gaps(watch, clock, gap=1.0, n=1)
    assert watch.quiet_limit(2.0) == pytest.approx(4.0) and watch.quiet_limit(5.0) == 5.0   # at least the bound
    for place in (ThreadPlace.CHECKPOINT, ThreadPlace.RESTORING, ThreadPlace.JOINING):
        waiting = [view(w, SYNC, age=6.0, step=41, exchanged=40) for w in (0, 2)]
        assert judge(watch, waiting[0], view(1, place, age=7.0, silent=3.9, step=40), waiting[1]) is None, place
        hung = judge(watch, waiting[0], view(1, place, age=7.0, silent=4.01, step=40), waiting[1])
        assert hung is not None and hung.ranks == (1,) and "beyond the quiet limit 4.0s" in hung.reason, place
        assert judge(watch, waiting[0], view(1, place, age=7.0, silent=0.2, step=40), waiting[1]) is None, place
    # A member once answered 3 s late (a save that kept its poll thread from the GIL, a loaded
    # host): the limit follows it.
    teach_gaps(watch, clock, gap=3.0, n=1)
    waiting = [view(w, SYNC, age=13.0, step=41, exchanged=40) for w in (0, 2)]
    assert judge(watch, waiting[0], view(1, ThreadPlace.CHECKPOINT, age=13.0, silent=11.9, step=40),
                 waiting[1]) is None
    assert judge(watch, waiting[0], view(1, ThreadPlace.CHECKPOINT, age=13.0, silent=12.01, step=40),
                 waiting[1]) is not None


def test_a_recovery_between_two_answers_is_not_a_gap_that_lengthens_the_quiet_limit():
    # Seen in G1: the first member's last answer before a fault and its first in the re-formed
    # group were 12 s apart (detection and re-form), and the limit became 4 x 12 s: a rank silent
    # in a save was found by the 10 s heartbeat. The same member, another generation: no gap.
    clock = FakeClock()
    watch = taught(clock)
    teach_gaps(watch, clock, gap=1.0, n=MIN_ANSWER_GAPS)
    assert watch.quiet_limit(2.0) == pytest.approx(4.0)
    teach_gaps(watch, clock, gap=12.0, n=1, generation=GEN + 1)
    teach_gaps(watch, clock, gap=1.0, n=3, generation=GEN + 1)
    assert watch.quiet_limit(2.0) == pytest.approx(4.0)


def test_never_on_a_generations_first_steps():
    watch = taught(FakeClock())
    for nth in (1, 2):                   # the group formed, DDP's first buckets, lazy allocations
        assert judge(watch, view(0, SYNC, age=9.0, nth=nth), view(1, COMPUTING, age=9.5, silent=9.0, nth=nth)) is None
    assert judge(watch, view(0, SYNC, age=9.0, nth=3), view(1, COMPUTING, age=9.5, silent=9.0, nth=3)) is not None


def test_auto_judges_only_once_enough_step_times_are_known_a_number_pins_it_and_none_turns_it_off():
    clock = FakeClock()
    stuck = (view(0, SYNC, age=30.0), view(1, COMPUTING, age=31.0, silent=30.0))
    assert judge(taught(clock, n=19), *stuck) is None
    assert judge(taught(clock, n=20), *stuck) is not None
    pinned = FailureConfig(hang_timeout_s=5.0)
    assert judge(HangWatch(clock), view(0, SYNC, age=4.9), view(1, COMPUTING, age=5.0, silent=4.9),
                 failure=pinned) is None
    hung = judge(HangWatch(clock), view(0, SYNC, age=5.0), view(1, COMPUTING, age=5.1, silent=5.0), failure=pinned)
    assert hung is not None and "pinned" in hung.reason
    assert judge(taught(clock), *stuck, failure=FailureConfig(hang_timeout_s=None)) is None


def test_the_bound_follows_the_step_times_and_forgets_them_when_the_world_size_changes():
    clock = FakeClock()
    watch = taught(clock, step_s=1.0)
    assert watch.bound(DEFAULT) == pytest.approx(4.0)
    assert judge(watch, view(0, SYNC, age=3.0), view(1, COMPUTING, age=3.5, silent=3.0)) is None
    assert judge(watch, view(0, SYNC, age=4.0), view(1, COMPUTING, age=4.5, silent=4.0)) is not None
    # A few slow steps among fast ones move the p99 (the 2nd slowest of 200 here).
    watch = taught(clock, step_s=0.1, n=198)
    st, views = group(view(0, COMPUTING, age=0.0, times=(0.9, 0.9)), *(view(w, COMPUTING, age=0.0) for w in (1, 2, 3)))
    watch.learn(st, views)
    watch.learn(st, views)                # the same answer again: its step times count once
    assert watch.bound(DEFAULT) == pytest.approx(3.6)
    st, views = group(view(0, COMPUTING, age=0.0), view(1, COMPUTING, age=0.0))   # 2 ranks now
    watch.learn(st, views)
    assert watch.p99_s() is None and watch.bound(DEFAULT) is None


def test_a_silent_rank_at_the_waiters_own_place_is_hung_only_when_no_rank_is_behind():
    watch = taught(FakeClock())
    # Stopped inside the sync it was waiting in: every rank is at the same place, one is silent.
    hung = judge(watch, view(0, SYNC, age=2.0), view(1, SYNC, age=2.3, silent=2.2), view(2, SYNC, age=2.1))
    assert hung is not None and hung.ranks == (1,)
    # With a rank behind, the wait is that rank's doing: a late answer at the front is no proof.
    hung = judge(watch, view(0, SYNC, age=2.0), view(1, SYNC, age=2.3, silent=2.2), view(2, COMPUTING, age=2.6))
    assert hung is not None and hung.ranks == (2,)


def test_a_member_not_training_this_generation_leaves_it_to_the_other_rules():
    watch = taught(FakeClock())
    assert judge(watch, view(0, SYNC, age=9.0), view(1, COMPUTING, age=9.5, silent=9.0, generation=GEN - 1)) is None
    assert judge(watch, view(0, SYNC, age=9.0), view(1, COMPUTING, age=9.5, phase=WorkerPhase.INTERRUPTED)) is None
    # A waiting rank whose own answer is old is no witness.
    assert judge(watch, view(0, SYNC, age=9.0, silent=2.5), view(1, COMPUTING, age=9.5, silent=2.5)) is None


def test_running_watch_turns_the_verdict_into_a_hang_fault_that_replaces_the_rank():
    clock = FakeClock()
    running = RunningWatch(clock)
    st, views = group(view(10, COMPUTING, age=0.0, times=(0.1,) * 30), view(11, COMPUTING, age=0.0))
    assert running.assess(st, views, DEFAULT, step_s=0.1) is None
    st, views = group(view(10, SYNC, age=2.0), view(11, COMPUTING, age=2.4, silent=2.1))
    fault = running.assess(st, views, DEFAULT, step_s=0.1)
    assert isinstance(fault, Fault) and fault.failure.cause == Cause.HANG
    assert fault.failure.ranks == (1,) and fault.lost == [11] and fault.detect_s == pytest.approx(2.1)


def test_a_heartbeat_timeout_says_where_the_silent_rank_last_was():
    # The hang judge exempts a rank whose last answer came from its save: the heartbeat finds it,
    # and the reason says where it was heard last (what the next flaky run would have told).
    running = RunningWatch(FakeClock())
    st, views = group(view(10, SYNC, age=10.5, step=51, exchanged=50),
                      view(11, ThreadPlace.CHECKPOINT, age=0.1, silent=10.2, step=50))
    fault = running.assess(st, views, DEFAULT, step_s=0.1)
    assert isinstance(fault, Fault) and fault.failure.cause == Cause.HANG and fault.lost == [11]
    assert fault.failure.message == ("lost worker(s) [11]; worker 11 silent for 10.2s (heartbeat_timeout_s=10; "
                                     "its last answer: checkpoint, 50 steps done)")


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "soon", True])
def test_hang_timeout_s_refuses_what_is_not_seconds_auto_or_none(value):
    with pytest.raises(ConfigError, match="FailureConfig.hang_timeout_s"):
        FailureConfig(hang_timeout_s=value)


def test_steps_after_a_save_or_copy_are_learned_apart_and_judge_only_such_a_step():
    """Ordinary steps of 0.1 s and, after each save, steps of 1.9 s: mixed, the slow few set the
    p99 (a 7.6 s bound for every step); apart, an ordinary step is judged at the floor (2 s),
    and only a step after a save by the p99 of all of them (4 x 1.9 s)."""
    clock = FakeClock()
    watch = HangWatch(clock)
    first = PositionReport(generation=GEN, place=COMPUTING, step=40, nth=10, age_s=0.0, step_times=(0.1,) * 40,
                           after_work_times=(1.9,) * 3)
    report = WorkerReport(phase=WorkerPhase.RUNNING, generation=GEN, rank=0, step=40, has_state=True, records=[],
                          position=first)
    st, views = group(WorkerView(wid=0, status=READY, report=report, silent_s=0.2), view(1, COMPUTING, age=0.0))
    watch.learn(st, views)
    assert watch.bound(DEFAULT) == 2.0
    assert watch.bound(DEFAULT, after_work=True) == pytest.approx(7.6)

    def front(age: float, after_work: bool) -> WorkerView:
        position = PositionReport(generation=GEN, place=SYNC, step=40, nth=10, age_s=age, exchanged=40,
                                  after_work=after_work)
        return WorkerView(wid=0, status=READY, silent_s=0.2, report=WorkerReport(
            phase=WorkerPhase.RUNNING, generation=GEN, rank=0, step=40, has_state=True, records=[], position=position))

    stuck = view(1, COMPUTING, age=3.0, silent=0.5)
    hung = judge(watch, front(2.0, after_work=False), stuck)
    assert hung is not None and hung.ranks == (1,) and "bound 2.0s" in hung.reason
    assert judge(watch, front(2.0, after_work=True), view(1, COMPUTING, age=3.0, silent=0.5)) is None
    hung = judge(watch, front(7.6, after_work=True), view(1, COMPUTING, age=8.0, silent=0.5))
    assert hung is not None and "follows a save or copy" in hung.reason and "bound 7.6s" in hung.reason


def test_with_a_copy_at_every_step_the_bound_is_learned_from_those_steps():
    """in_memory_every_n_steps=1: every step follows a copy; the bound is still learned (from all
    of them, as before the kinds were told apart), not left off for want of ordinary steps."""
    watch = HangWatch(FakeClock())
    first = PositionReport(generation=GEN, place=COMPUTING, step=40, nth=10, age_s=0.0, after_work_times=(0.1,) * 40)
    report = WorkerReport(phase=WorkerPhase.RUNNING, generation=GEN, rank=0, step=40, has_state=True, records=[],
                          position=first)
    st, views = group(WorkerView(wid=0, status=READY, report=report, silent_s=0.2), view(1, COMPUTING, age=0.0))
    watch.learn(st, views)
    assert watch.bound(DEFAULT) == watch.bound(DEFAULT, after_work=True) == 2.0

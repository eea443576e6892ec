"""A controller that replaces a lost one: the journal, the judge of what it finds, the take-over,
and the driver's feed across it (no Ray: the fakes, a fake clock)."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
from fakes import FakeGroup
from harness import make, start

from elastic._controller.adoption import AdoptionKind, judge
from elastic._controller.feed import RESTART_GAP, FeedKind, RunFeed
from elastic._controller.journal import ENDED, BackgroundPuts, Journal
from elastic._controller.states import Recovering, Running, RunState, Scheduling, Starting
from elastic._protocol import RestoreKind, RestorePlan, StepRecord, WorkerPhase, WorkerReport
from elastic._run_names import RunNames
from elastic._worker.state import HISTORY_KEPT, Outbox
from elastic.callbacks import CallbackRunner

pytestmark = pytest.mark.timeout(30)


class MemoryStore:
    def __init__(self):
        self.data: bytes | None = None
        self.puts = 0

    def put(self, data: bytes) -> None:
        self.data, self.puts = data, self.puts + 1

    def get(self) -> bytes | None:
        return self.data

    def delete(self) -> None:
        self.data = None


def report(generation: int, step: int = 5, phase=WorkerPhase.RUNNING) -> WorkerReport:
    return WorkerReport(phase=phase, generation=generation, rank=0, step=step, has_state=True, records=[])


# ---- the judge -------------------------------------------------------------------------------
def entry_in(state):
    controller, _, _, _ = make(journal=Journal(MemoryStore()))
    controller.state = state
    return controller.journal_entry()


def test_a_running_generation_goes_on_with_its_members_and_the_missing_ones_are_lost():
    entry = entry_in(Running(generation=3, members=[4, 5, 6]))
    whole = judge(entry, {4: report(3), 5: report(3), 6: report(3), 9: report(-1)})
    assert whole.kind == AdoptionKind.RUNNING and whole.adopted == [4, 5, 6, 9] and not whole.lost + whole.replaced
    short = judge(entry, {4: report(3), 6: report(3), 5: report(2)})
    assert short.kind == AdoptionKind.RUNNING and short.adopted == [4, 6]
    assert short.replaced == [5] and short.lost == [] and "[5]" in short.reason
    assert judge(entry, {4: report(3)}).lost == [5, 6]


def test_between_generations_the_workers_are_replaced_before_any_they_are_adopted_without_a_journal_all_go():
    for state in (Starting(members=[1, 2], restore=RestorePlan(RestoreKind.FRESH)),
                  Recovering(generation=2, survivors=[1], deadline=9.0)):
        adoption = judge(entry_in(state), {1: report(2), 2: report(2)})
        assert adoption.kind == AdoptionKind.RESTART and adoption.replaced == [1, 2] and not adoption.adopted
    idle = judge(entry_in(Scheduling(since=0.0)), {0: report(-1), 1: report(-1)})
    assert idle.kind == AdoptionKind.IDLE and idle.adopted == [0, 1]
    fresh = judge(None, {0: report(0)})
    assert fresh.kind == AdoptionKind.FRESH and fresh.replaced == [0]


# ---- the take-over ---------------------------------------------------------------------------
def replacement(entry, lost_group: FakeGroup, alive: list[int]):
    """A new controller from `entry`, over a group that holds the lost one's `alive` workers."""
    controller, group, clock, transitions = make(resumed=entry, journal=Journal(MemoryStore()))
    group.views = {wid: replace(lost_group.views[wid]) for wid in alive}
    group._next = max(alive) + 1
    reports = {wid: view.report for wid, view in group.views.items() if view.report is not None}
    controller.take_over(judge(entry, reports), entry)
    return controller, group, transitions


def test_a_replacing_controller_goes_on_with_the_generation_and_takes_each_step_once():
    store = MemoryStore()
    lost, group, _, _ = make(journal=Journal(store, every_s=60.0, clock=lambda: 0.0))
    members = start(lost, group)
    group.complete_steps(members[0], 1, 6, 3)
    lost.tick()                                     # steps 1..6: not in the journal (its first tick, then transitions)
    entry = Journal(store).read()
    assert entry is not None and entry.state == lost.state and entry.intake.step == 0 and store.puts == 3
    # The workers replay every step after the entry's, those the lost controller took too: each is
    # taken once by the replacement, whose record goes on from the entry's step.
    group.complete_steps(members[0], 1, 9, 3)
    controller, new_group, transitions = replacement(entry, group, members)
    assert controller.state == entry.state and controller.generation == lost.generation
    assert new_group.next_wid == 3 and not new_group.killed
    controller.tick()
    assert controller.state.state == RunState.RUNNING and controller.step == 9
    assert controller.recorder.steps == list(range(1, 10))
    assert transitions == [] and controller.history[-1][:2] == ("running", "running")


def test_a_starting_controller_reads_its_journal_once_for_the_entry_and_the_end():
    store = MemoryStore()
    reads = []
    get = store.get
    store.get = lambda: reads.append(1) or get()
    journal = Journal(store)
    assert journal.opening() == (None, False) and len(reads) == 1
    lost, group, _, _ = make(journal=Journal(store, every_s=60.0, clock=lambda: 0.0))
    start(lost, group)
    entry, ended = journal.opening()
    assert entry is not None and entry.state == lost.state and not ended and len(reads) == 2
    journal.end()
    assert journal.opening() == (None, True) and len(reads) == 3


def test_a_journal_put_that_blocks_does_not_block_the_controller_and_only_the_newest_entry_is_written():
    """A GCS that is down blocks a key-value put until it is back: BackgroundPuts takes the put
    off the controller's thread (tests/integration/test_gcs_restart.py saw the loop stall)."""
    import threading
    gcs_up, written = threading.Event(), []

    class DownStore(MemoryStore):
        def put(self, data: bytes) -> None:
            gcs_up.wait(10)
            written.append(data)

    store = BackgroundPuts(DownStore())
    journal = Journal(store)
    began = time.monotonic()
    for data in (b"one", b"two", b"three"):
        store.put(data)
    assert time.monotonic() - began < 1.0           # handed over, not written
    threading.Timer(0.5, gcs_up.set).start()
    journal.end()                                   # returns once its mark is written
    assert gcs_up.is_set() and written[-1] == ENDED
    assert len(written) <= 2            # at most the put in flight, then the newest (the end): none between


def test_a_member_lost_while_no_controller_was_there_is_recovered_once_the_replacement_is_up():
    store = MemoryStore()
    lost, group, _, _ = make(journal=Journal(store))
    members = start(lost, group)
    group.complete_steps(members[0], 1, 3, 3)
    lost.tick()
    entry = Journal(store).read()
    controller, new_group, transitions = replacement(entry, group, members[:2])   # the third died meanwhile
    assert new_group.views[members[2]].status == "dead"
    controller.tick()
    assert controller.state.state == RunState.RECOVERING and transitions[0][1] == RunState.RECOVERING
    assert controller.budget.failures[-1].cause == "worker_died"


def test_a_controller_lost_while_recovering_restarts_the_workers_from_storage():
    entry = entry_in(Recovering(generation=0, survivors=[0, 1], deadline=30.0))
    lost_group = FakeGroup(3)
    lost_group.scale_to(2)
    for wid in (0, 1):
        lost_group.set_report(wid, WorkerPhase.INTERRUPTED, generation=0)
    controller, new_group, _ = replacement(entry, lost_group, [0, 1])
    assert sorted(wid for wid, _ in new_group.killed) == [0, 1]
    assert controller.state.state == RunState.SCHEDULING
    controller.tick()                               # places new workers, for a resume from storage
    assert len(new_group.live()) == 3


# ---- the run record ----------------------------------------------------------------------------
def lines_of(run_dir) -> list[int]:
    import json
    return [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("flushed_after_journal", [False, True])
def test_a_replacing_record_keeps_each_metrics_line_once_whatever_the_lost_one_had_written(
        tmp_path, flushed_after_journal):
    from ray import cloudpickle

    from elastic._controller.run_record import RunRecorder
    lost = RunRecorder(str(tmp_path), None, total_steps=100, config={})
    lost.on_generation_start(0, 2)
    for step in range(1, 7):
        lost.on_step(record(step))
    lost.flush_metrics()
    for step in range(7, 11):
        lost.on_step(record(step))               # taken, not written yet when the journal is written
    state = cloudpickle.loads(cloudpickle.dumps(lost.journal_state()))
    assert state.metrics_step == 10 and [line["step"] for line in state.pending_lines] == [7, 8, 9, 10]
    if flushed_after_journal:                    # the lost controller wrote them, and newer ones, before its end
        lost.on_step(record(11))
        lost.flush_metrics()
    assert lines_of(tmp_path) == list(range(1, 12 if flushed_after_journal else 7))
    replacing = RunRecorder(str(tmp_path), None, total_steps=100, config={})
    replacing.restore_journal(state)
    for step in range(11, 14):                   # replayed by the workers, then new
        replacing.on_step(record(step))
    replacing.flush_metrics()
    assert lines_of(tmp_path) == list(range(1, 14))
    assert [step for step, _ in replacing.user_metrics()["history"]["loss"]] == list(range(1, 14))


# ---- the workers' side ------------------------------------------------------------------------
def record(step: int) -> StepRecord:
    return StepRecord(step=step, loss=1.0, world_size=2, time=float(step), samples_seen=step, global_batch=1)


def test_a_rank_replays_every_step_after_the_journals_polled_or_not_and_nothing_twice():
    outbox = Outbox()
    for step in range(1, 8):
        outbox.put(record(step))
    outbox.answer(None)                             # the lost controller polled steps 1..7
    for step in range(8, 11):
        outbox.put(record(step))                    # 8..10 were never polled
    assert [r.step for r in outbox.replay(after_step=5)] == [6, 7, 8, 9, 10]
    assert outbox.answer(0)[1] == []                # handed over: the next poll carries only newer ones
    outbox.drop_after(8)
    assert [r.step for r in outbox.replay(after_step=0)] == list(range(1, 9))
    for step in range(11, 11 + HISTORY_KEPT):
        outbox.put(record(step))
    assert len(outbox.replay(after_step=0)) == HISTORY_KEPT


def test_run_names_say_which_worker_bundle_and_group_and_nothing_of_other_runs():
    names = RunNames("abc123")
    group = names.placement_group()
    assert names.owns_placement_group(group) and not RunNames("abc").owns_placement_group(group)
    parsed = names.parse_worker(names.worker(17, 3, group))
    assert parsed is not None and (parsed.wid, parsed.bundle, parsed.placement_group) == (17, 3, group)
    assert RunNames("abc12").parse_worker(names.worker(17, 3, group)) is None
    assert names.parse_worker("abc123.agent") is None


# ---- the driver's feed across a restart ----------------------------------------------------------
class Seen:
    def __init__(self):
        self.steps: list[int] = []
        self.recoveries = 0
        self.commits: list[int] = []

    def on_step(self, info):
        self.steps.append(info["step"])

    def on_recovery(self, info):
        self.recoveries += 1

    def on_checkpoint(self, info):
        self.commits.append(info["step"])


def test_callbacks_see_each_step_once_across_a_controller_restart_and_redone_steps_after_a_recovery():
    lost = RunFeed()
    for step in range(1, 11):
        lost.put(FeedKind.STEP, {"step": step})
    lost.put(FeedKind.CHECKPOINT, {"step": 10})
    seen = Seen()
    runner = CallbackRunner([seen])
    runner.poll(lost.after)                         # the driver had all of it
    journal_next = 7                                # the lost controller's entry: steps 1..6 fed
    new = RunFeed()
    new.continue_after(journal_next)
    assert new.next == journal_next + RESTART_GAP
    for step in range(7, 15):                       # replayed from the workers, then new ones
        new.put(FeedKind.STEP, {"step": step})
    new.put(FeedKind.CHECKPOINT, {"step": 10})
    new.put(FeedKind.RECOVERY, {"step": 12, "detected_at": 100.0})
    for step in (13, 14, 15):                       # redone after the recovery: told again
        new.put(FeedKind.STEP, {"step": step})
    runner.drain(new.after)
    assert seen.steps == list(range(1, 15)) + [13, 14, 15]
    assert seen.commits == [10] and seen.recoveries == 1

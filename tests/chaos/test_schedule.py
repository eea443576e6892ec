"""Faults are data and schedules are reproducible from their seed."""
from __future__ import annotations

import pytest

from chaos.faults import (
    FAULT_TYPES,
    CorruptCheckpoint,
    Hang,
    KillWorker,
    LateCommit,
    SecondRun,
    Slow,
    UserError,
    fault_from_dict,
)
from chaos.scenarios import MIXED_MENU, NOT_IN_MIXED, SCENARIOS
from chaos.schedule import Schedule, fixed, randomized

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_is_a_pure_function_of_its_seed(name):
    sc = SCENARIOS[name]
    assert sc.schedule(7).to_json() == sc.schedule(7).to_json()
    assert Schedule.from_dict(sc.schedule(7).to_dict()).to_json() == sc.schedule(7).to_json()


def test_random_schedules_differ_between_seeds_and_repeat_within_one():
    a = randomized(1, MIXED_MENU, count=20, mean_interval_s=25, jitter=0.2)
    b = randomized(1, MIXED_MENU, count=20, mean_interval_s=25, jitter=0.2)
    c = randomized(2, MIXED_MENU, count=20, mean_interval_s=25, jitter=0.2)
    assert a == b
    assert a.to_json() != c.to_json()
    gaps = [y.at_s - x.at_s for x, y in zip(a.entries, a.entries[1:], strict=False)]
    assert all(20 <= g <= 30 for g in gaps), gaps


def test_target_choices_repeat_for_the_same_seed_and_index():
    s = fixed([(1, KillWorker())], seed=5)
    workers = list(range(8))
    assert [s.target_rng(i).choice(workers) for i in range(10)] == [s.target_rng(i).choice(workers) for i in range(10)]


@pytest.mark.parametrize("seed", range(20))
def test_mixed_campaign_has_fifty_faults_of_every_kind_every_20_to_30_s(seed):
    s = SCENARIOS["mixed"].schedule(seed)
    assert len(s.entries) >= 50
    # Every kind, the user error included, but those that need replicas (mixed-fsdp shares the menu).
    assert set(s.kinds()) == set(FAULT_TYPES) - set(NOT_IN_MIXED), s.kinds()
    gaps = [y.at_s - x.at_s for x, y in zip(s.entries, s.entries[1:], strict=False)]
    assert all(20 <= g <= 30 for g in gaps), gaps
    assert [f.kind for f in s.launch_faults] == ["user_error"]
    # The first faults cover the menu, so a campaign cut short with --faults 11 has every kind.
    assert {e.fault.kind for e in s.entries[:len(MIXED_MENU)]} == set(FAULT_TYPES) - {"user_error", *NOT_IN_MIXED}


def test_smoke_is_seven_kinds_on_two_workers_and_three_nodes():
    sc = SCENARIOS["smoke"]
    assert len(sc.schedule(1).entries) == 7 and len(sc.schedule(1).kinds()) == 7
    assert (sc.workers, sc.nodes) == ("2:2", 3)


def test_fixed_schedules_are_sorted():
    s = fixed([(9, Hang()), (1, KillWorker())])
    assert [e.fault.kind for e in s.entries] == ["kill_worker", "hang"]


def test_faults_round_trip_and_reject_bad_values():
    for cls in FAULT_TYPES.values():
        fault = cls()
        assert fault_from_dict(fault.to_dict()) == fault
    with pytest.raises(ValueError):
        KillWorker(target="somebody")
    with pytest.raises(ValueError):
        Slow(stopped_share=1.5)
    with pytest.raises(ValueError):
        UserError(step=0)
    with pytest.raises(ValueError):
        fault_from_dict({"kind": "meteor"})


def test_expectations_depend_on_the_heartbeat_timeout():
    assert Hang(duration_s=20).expectation(10).required
    assert not Hang(duration_s=5).expectation(10).required
    assert CorruptCheckpoint(force_load=True).expectation(10).required
    assert UserError().expectation(10).fails_run


def test_the_commit_scenario_attacks_the_protocol_in_both_phases_after_a_second_run():
    for seed in range(5):
        s = SCENARIOS["commit"].schedule(seed)
        assert [e.fault.kind for e in s.entries] == ["second_run", "late_commit", "late_commit"]
        assert sorted(e.fault.phase for e in s.entries[1:]) == ["check", "put"]
    with pytest.raises(ValueError):
        LateCommit(phase="never")
    assert LateCommit().expectation(10).required and not SecondRun().expectation(10).required

"""The chaos report's cost per fault kind: the mean seconds each injected fault cost, from the
time ledger of the recovery it was matched to (summary.json `recoveries[].time_ledger`)."""
from __future__ import annotations

import pytest

from chaos.report import _summed_ledger, lost_per_kind, summarize

pytestmark = pytest.mark.timeout(30)


def recovery(detection, reform, restore, redone):
    return {"cause": "worker_died", "time_ledger": {"detection": detection, "reform": reform,
                                                    "restore": restore, "redone": redone}}


def test_each_recovery_is_counted_once_and_faults_that_cost_nothing_count_zero():
    shared = recovery(0.5, 2.0, 0.5, 1.0)
    faults = [
        {"kind": "kill_worker", "outcome": "recovered", "recovery": shared},
        {"kind": "kill_worker", "outcome": "shared", "recovery": shared},        # counted with the first
        {"kind": "kill_worker", "outcome": "recovered", "recovery": recovery(0.1, 1.0, 0.3, 0.6)},
        {"kind": "corrupt_checkpoint", "outcome": "not required", "recovery": None},
        {"kind": "hang", "outcome": "recovered (optional)", "recovery": recovery(10.0, 3.0, 0.5, 2.0)},
    ]
    lost = lost_per_kind(faults)
    assert lost["kill_worker"] == {"faults": 3, "mean_lost_s": pytest.approx(2.0),
                                   "mean_parts_s": {"detection": 0.2, "redone": pytest.approx(0.533, abs=1e-3),
                                                    "reform": 1.0, "restore": pytest.approx(0.267, abs=1e-3)}}
    assert lost["corrupt_checkpoint"] == {"faults": 1, "mean_lost_s": 0.0, "mean_parts_s": {}}
    assert lost["hang"]["mean_lost_s"] == pytest.approx(15.5)


def test_the_attempts_ledgers_are_summed_and_shown():
    attempts = [{"summary": {"time_ledger": {"productive": 10.0, "reform": 1.0}}}, {"summary": None},
                {"summary": {"time_ledger": {"productive": 5.0, "reform": 0.5}}}]
    assert _summed_ledger(attempts) == {"productive": 15.0, "reform": 1.5}
    assert _summed_ledger([{"summary": {}}]) is None
    report = {"scenario": "s", "seed": 1, "ok": True, "faults_injected": 1, "kinds_injected": ["kill_worker"],
              "faults_skipped": 0, "recoveries": [], "unsupported": {}, "invariants": [],
              "goodput": {"campaign": 0.9, "per_attempt": [0.9], "vs_reference": None},
              "time_ledger": {"productive": 15.0}, "lost_per_kind": lost_per_kind(
                  [{"kind": "kill_worker", "outcome": "recovered", "recovery": recovery(0.5, 1.0, 0.2, 0.3)}])}
    text = summarize(report)
    assert "time ledger productive 15.0s" in text and "kill_worker: 1 faults, 2.00s lost per fault" in text

"""The fault-to-recovery pairing in a storm (`kill-storm`, seed 1: data/kill_storm_seed1.json says
where it came from). Kills came faster than the group re-formed, so one recovery absorbed eight
of them (its `failures`, each with its own `detected_at`). The recovery's own `detected_at` is its
first failure's: judged on that alone, every fault folded in later looked detected before it
acted, and `faults_recovered` failed for faults that were recovered."""
from __future__ import annotations

import json
import os

import pytest

from chaos.invariants import PASS, Evidence, check_all
from chaos.matching import match_recoveries

pytestmark = pytest.mark.timeout(30)

DATA = os.path.join(os.path.dirname(__file__), "data", "kill_storm_seed1.json")


def storm() -> Evidence:
    with open(DATA) as f:
        data = json.load(f)
    return Evidence(history=data["history"], attempts=data["attempts"], total_steps=3000,
                    heartbeat_timeout_s=data["heartbeat_timeout_s"])


def test_every_kill_of_the_storm_is_matched_to_the_recovery_that_absorbed_it():
    entries = match_recoveries(storm())
    assert [e["outcome"] for e in entries if e["outcome"] not in ("recovered", "shared")] == []
    for e in entries:
        ranks = set(e["invoke"]["detail"].get("ranks") or [])
        t = e["invoke"]["t"]
        # The recovery holds a failure of the killed rank detected once the kill acted.
        assert any(ranks & set(f["ranks"]) and f["detected_at"] >= t - 5.0 for f in e["recovery"]["failures"]), e


def test_the_faults_recovered_invariant_holds_on_the_storm():
    verdict = next(v for v in check_all(storm()) if v.name == "faults_recovered")
    assert verdict.status == PASS, verdict.detail


def test_a_kill_whose_rank_the_absorbing_recovery_never_names_stays_missing():
    ev = storm()
    for recovery in ev.recoveries():
        recovery["failures"] = [f for f in recovery["failures"] if f["ranks"] != [2]]
    outcomes = [e["outcome"] for e in match_recoveries(ev) if 2 in (e["invoke"]["detail"].get("ranks") or [])]
    assert "missing" in outcomes

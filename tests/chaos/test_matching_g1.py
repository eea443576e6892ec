"""The fault-to-recovery pairing on a real campaign's history: G1, `mixed` with seed 1 (51 faults
of 10 kinds over 3 attempts; data/mixed_seed1.json says where it came from). Matched by
generation order alone, one fault whose attempt ended (fault 26, the 21st failure against
max_failures=20) took the next attempt's first recovery, every later fault took its
successor's, and the last one was reported without a recovery."""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from chaos.invariants import PASS, Evidence, check_all
from chaos.matching import match_recoveries

pytestmark = pytest.mark.timeout(30)

DATA = os.path.join(os.path.dirname(__file__), "data", "mixed_seed1.json")


def g1() -> Evidence:
    with open(DATA) as f:
        data = json.load(f)
    return Evidence(history=data["history"], attempts=data["attempts"], total_steps=2000,
                    heartbeat_timeout_s=data["heartbeat_timeout_s"])


def test_every_fault_of_g1_finds_its_own_recovery():
    entries = match_recoveries(g1())
    by_index = {e["invoke"]["index"]: e for e in entries}
    assert Counter(e["outcome"] for e in entries) == {
        "recovered": 39, "not required": 10, "ended attempt": 1, "failed as expected": 1}
    assert by_index[26]["outcome"] == "ended attempt"
    for e in entries:
        recovery = e["recovery"]
        if recovery is None:
            continue
        # Each recovery names the rank the fault hit (corrupt_checkpoint kills them all).
        ranks = set(e["invoke"]["detail"].get("ranks") or [])
        failed = {r for f in recovery["failures"] for r in f["ranks"]}
        assert not ranks or ranks & failed, (e["invoke"]["index"], ranks, recovery)
        assert recovery["detected_at"] >= e["invoke"]["t"] - 5.0
    # The pairing that slipped before: crash_before_commit killed rank 0 at the step-860 save.
    assert by_index[37]["recovery"]["generation"] == 32
    assert [f["ranks"] for f in by_index[37]["recovery"]["failures"]] == [[0]]
    used = [id(e["recovery"]) for e in entries if e["recovery"] is not None]
    assert len(used) == len(set(used))


def test_the_faults_recovered_invariant_holds_on_g1():
    verdict = next(v for v in check_all(g1()) if v.name == "faults_recovered")
    assert verdict.status == PASS, verdict.detail


def test_a_recovery_that_names_another_rank_is_not_the_faults():
    ev = g1()
    recovery = next(r for r in ev.recoveries() if r["generation"] == 32)
    recovery["failures"] = [{**f, "ranks": [2]} for f in recovery["failures"]]
    entries = {e["invoke"]["index"]: e for e in match_recoveries(ev)}
    assert entries[37]["outcome"] == "missing" and "rank(s) [0]" in entries[37]["why"]
    assert entries[39]["recovery"]["generation"] == 33        # the next fault keeps its own

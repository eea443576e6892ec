"""The `smoke` scenario end to end: the main job on a 3-node Ray cluster, S3 storage on moto
behind the fault proxy, seven kinds of faults, every heal, the reference run and the verdicts."""
from __future__ import annotations

import os

import pytest

from chaos.procs import alive
from chaos.report import summarize
from chaos.runner import RunOptions, run
from chaos.scenarios import SCENARIOS

pytestmark = [pytest.mark.chaos]

# Violations the suite has found in the runtime and reported; the smoke test still checks them
# and shows them as XFAIL (`-ra`), so that a fix turns them into plain passes. Campaigns run
# with `python -m chaos run` fail on them as on any other violation.
KNOWN_RUNTIME_ISSUES = {
    "metrics_complete": "elastic: metrics.jsonl misses the steps a lost worker had completed but "
                        "not yet reported (its records die with it while a survivor keeps the state)",
    "data_order_matches_reference": "elastic: data_order_sha256 differs from the fault-free run's after "
                                    "such a recovery, although the model and every loss are identical",
}


@pytest.mark.timeout(900)
def test_smoke_scenario_injects_heals_and_passes_every_invariant(tmp_path, s3_env):
    out = tmp_path / "out"
    outcome = run(RunOptions(scenario=SCENARIOS["smoke"], seed=1, storage="s3://chaos-smoke/run", out_dir=str(out)))
    report = outcome.report
    failed = [v["name"] for v in report["invariants"] if v["status"] == "fail"]
    assert not [name for name in failed if name not in KNOWN_RUNTIME_ISSUES], summarize(report)
    injected = [f for f in report["faults"] if f["injected"]]
    assert len(injected) >= 5 and len(report["kinds_injected"]) >= 5, summarize(report)
    assert all(f.get("healed_t") is not None for f in injected), "every injected fault is healed"
    outage = [f for f in injected if f["kind"] == "storage_outage"]
    assert not outage or outage[0]["heal"]["refused_requests"] > 0, "the outage refused writes"
    assert {v["name"]: v["status"] for v in report["invariants"]}["model_matches_reference"] == "pass"
    assert os.path.getsize(out / "chaos_report.png") > 0
    pids = [p for f in injected for p in (f.get("detail") or {}).get("pids", [])]
    assert not [p for p in pids if alive(p)], "no worker process left behind"
    if failed:
        pytest.xfail("known runtime issue: " + "; ".join(KNOWN_RUNTIME_ISSUES[name] for name in failed))

"""`smoke` end to end, test-sized: the main job on S3 storage (moto) behind the fault proxy,
faults of four kinds from the `smoke` schedule (a SIGKILL, a crash between the shards and the
commit, a rotted checkpoint forced to load, a write outage), every heal, the fault-free
reference run and the verdicts.

The named `smoke` scenario (`python -m chaos run smoke`, seven kinds on a 3-node cluster) takes
several minutes on a loaded 2-core machine; CI runs this subset on the job's embedded Ray. The
kinds left out are covered where they are cheap: hang and slow on real processes
(test_injectors.py), node loss and partition injectors on a fake cluster (test_injectors.py),
the runtime's node loss in tests/integration/test_node_loss.py.
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from chaos.procs import alive
from chaos.report import summarize
from chaos.runner import RunOptions, run
from chaos.scenarios import SCENARIOS
from chaos.schedule import fixed

pytestmark = [pytest.mark.chaos]

CI_KINDS = {"kill_worker", "crash_before_commit", "corrupt_checkpoint", "storage_outage"}

# Violations the suite has found in the runtime and reported; the test still checks them and
# shows them as XFAIL (`-ra`) while they last. When none of them fails the test is a plain pass;
# remove an entry once its fix is on main. Campaigns run with `python -m chaos run` fail on them
# as on any other violation.
KNOWN_RUNTIME_ISSUES = {
    "metrics_complete": "elastic: metrics.jsonl misses the steps a lost worker had completed but "
                        "not yet reported (its records die with it while a survivor keeps the state)",
}


def smoke_for_ci():
    smoke = SCENARIOS["smoke"]

    def build(sc, seed):
        entries = [(e.at_s, e.fault) for e in smoke.schedule(seed).entries if e.fault.kind in CI_KINDS]
        return fixed(entries, seed=seed)

    # 320 steps outlast the four gated faults in one attempt (each waits for a commit of the
    # generation it hits, every 20 steps; with 200 the runner ran the job a second time, to 309,
    # a second start-up of the job's Ray); no cluster: no node faults here.
    return dataclasses.replace(smoke, name="smoke-ci", build=build, steps=320, nodes=None, job_timeout_s=300)


def test_the_ci_variant_keeps_smokes_faults_of_those_kinds():
    smoke, ci = SCENARIOS["smoke"].schedule(1), smoke_for_ci().schedule(1)
    assert set(ci.kinds()) == CI_KINDS
    assert [e for e in smoke.entries if e.fault.kind in CI_KINDS] == list(ci.entries)


@pytest.mark.exclusive
@pytest.mark.timeout(600)
def test_smoke_scenario_injects_heals_and_passes_every_invariant(tmp_path, s3_env):
    out = tmp_path / "out"
    # The reference alongside the job from its first step, not from its start: on 2 cores a
    # reference started with the job slows the job's start (32 s to its first step, against 15 s);
    # once the job trains, the reference (at nice 19) takes the CPU the recoveries leave. The
    # runner trains it again if it has to run the job on for longer than planned.
    outcome = run(RunOptions(scenario=smoke_for_ci(), seed=1, storage="s3://chaos-smoke/run", out_dir=str(out),
                             reference_alongside=True, reference_once_running=True))
    report = outcome.report
    verdicts = {v["name"]: v["status"] for v in report["invariants"]}
    failed = [name for name, status in verdicts.items() if status == "fail"]
    assert not [name for name in failed if name not in KNOWN_RUNTIME_ISSUES], summarize(report)
    injected = [f for f in report["faults"] if f["injected"]]
    assert set(report["kinds_injected"]) == CI_KINDS and report["faults_skipped"] == 0, summarize(report)
    assert all(f.get("healed_t") is not None for f in injected), "every injected fault is healed"
    outage, = [f for f in injected if f["kind"] == "storage_outage"]
    assert outage["heal"]["refused_requests"] > 0, "the outage refused writes"
    rot, = [f for f in injected if f["kind"] == "corrupt_checkpoint"]
    assert rot["detail"]["killed_all"] and report["checkpoint_fallbacks"], "the rotted checkpoint was met and skipped"
    for name in ("terminates_typed", "committed_steps_kept", "no_bad_checkpoint_loaded", "model_matches_reference",
                 "data_order_matches_reference", "faults_recovered"):
        assert verdicts[name] == "pass", summarize(report)
    assert verdicts["metrics_complete"] in ("pass", "fail"), summarize(report)   # checked, not skipped
    assert os.path.getsize(out / "chaos_report.png") > 0
    pids = [p for f in injected for p in (f.get("detail") or {}).get("pids", [])]
    assert not [p for p in pids if alive(p)], "no worker process left behind"
    if failed:
        pytest.xfail("known runtime issue: " + "; ".join(KNOWN_RUNTIME_ISSUES[name] for name in failed))

"""A real network partition: Ray nodes in network namespaces made by the test (chaos.netns), a
worker's link cut and healed. The run goes on without the cut worker, and the cut worker, when
its link comes back, is fenced: it reports no step, writes and commits nothing, and exits.

The driver (and the controller pinned to its node) runs in the head's namespace; each worker
node has one CPU, so the three workers sit on three nodes. Storage is a local directory: the
cut leaves the old worker able to reach it, so only the generation fence keeps it out.
Skipped where namespaces cannot be made (not Linux, not root, no iproute2 or bridge support).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from support import pid_alive, read_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.exclusive]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVERY = 10              # checkpoint interval
# The run must outlast the cut worker: were it to end first, the job's end would take that
# worker with it, and its exit would show no fencing. The 2-worker generation therefore waits
# after its SHRUNK_STEPS-th step (support.ShrunkHold) until the test has seen the cut worker exit
# (its release file); the steps are margin for the 3-worker generation to be cut before the
# hold's step (here it was cut at step 50), not for the fencing, however long that takes.
STEPS = 250
SHRUNK_STEPS = 25

# The job's driver, run inside the head's namespace. The cut worker is declared lost after the
# heartbeat timeout; the survivors, told to cut their own connections of the group, leave the
# collective with it at once and come back warm. collective_timeout_s is beyond this test's
# timeout, so that waiting it out cannot pass. Every checkpoint is kept, so the old generation's
# files stay to be inspected. Straggler eviction is off: tiny-model compute times on loaded
# shared cores score up to 1.5 and a three-worker group evicts above 3/2, a recovery this test
# is not about.
DRIVER = """
import sys
from ray import cloudpickle
import gpt
import support
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from support import ShrunkHold
for module in (gpt, support):      # the workers import neither; the loop below travels by value
    cloudpickle.register_pickle_by_value(module)
def held_while_shrunk(ctx):
    gpt.train_loop(ShrunkHold.wrap(ctx))
hold = ShrunkHold(2, int(sys.argv[5]), sys.argv[4])
result = ElasticTrainer(
    held_while_shrunk, train_loop_config={"model_size": "tiny", "batch_size": 8, **hold.as_config()},
    total_steps=int(sys.argv[2]),
    seed=0, scaling=ScalingConfig(min_workers=2, max_workers=3, startup_wait_s=120),
    checkpoint=CheckpointConfig(storage=sys.argv[1], every_n_steps=int(sys.argv[3]), keep=None),
    failure=FailureConfig(heartbeat_timeout_s=5.0, collective_timeout_s=600.0, straggler_threshold=None)).fit()
sys.exit(0 if result.ok else 1)
"""


def _leftovers(tag: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line]
    names += os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    return [n for n in names if n.startswith(tag)]


@pytest.fixture
def netns_cluster(tmp_path):
    from chaos.netns import NetnsCluster, netns_unsupported_reason
    reason = netns_unsupported_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable here: {reason}")
    cluster = NetnsCluster(3, log_dir=str(tmp_path / "ray-nodes"))
    try:
        yield cluster.start()
    finally:
        pids = [int(p) for ns in cluster._procs for p in
                subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        cluster.shutdown()
        left = _leftovers(f"chx{cluster.id}") + [str(p) for p in pids if pid_alive(p)]
        assert left == [], f"namespaces, links or processes left behind: {left}"


@pytest.fixture
def driver(netns_cluster, tmp_path):
    """Starts the job's driver in the head's namespace; kills its whole session at the end."""
    procs: list[subprocess.Popen] = []

    def start(run_dir: str) -> subprocess.Popen:
        env = dict(os.environ, **netns_cluster.env())
        env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests"),
                                             env.get("PYTHONPATH", "")])
        with open(tmp_path / "driver.log", "ab") as log:
            proc = subprocess.Popen(netns_cluster.exec_prefix() + [sys.executable, "-c", DRIVER, run_dir, str(STEPS),
                                                                   str(EVERY), _release_file(run_dir),
                                                                   str(SHRUNK_STEPS)],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _release_file(run_dir: str) -> str:
    """Created once the cut worker has exited: the 2-worker generation's hold ends."""
    return run_dir.rstrip("/") + ".cut-worker-gone"


def _status(run_dir: str) -> dict:
    return read_json(run_dir, "status.json") or {}


def _driver_log(tmp_path) -> str:
    path = tmp_path / "driver.log"
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""


@pytest.mark.timeout(300)
def test_cut_link_run_goes_on_and_the_healed_worker_is_fenced(netns_cluster, driver, run_dir, tmp_path):
    job = driver(run_dir)

    def running(world_size: int, min_step: int, generation: int = -1) -> bool:
        s = _status(run_dir)
        if job.poll() is not None:
            raise AssertionError(f"the job exited with {job.returncode}:\n{_driver_log(tmp_path)}")
        return (s.get("state") == "running" and s.get("world_size") == world_size and s.get("step", 0) >= min_step
                and s.get("generation", -1) > generation)

    wait_for(lambda: running(3, 2 * EVERY), 150, "the run to train with 3 workers")
    first = _status(run_dir)
    # A checkpoint of this generation is committed: its files are there when the check looks.
    wait_for(lambda: running(3, 0) and _status(run_dir)["generation"] == first["generation"]
             and (_status(run_dir).get("last_committed_step") or 0) >= first["step"], 60,
             "a checkpoint committed by the 3-worker generation")
    before = _status(run_dir)
    nodes = {w["rank"]: netns_cluster.node_of(w) for w in before["workers"]}
    assert len(set(nodes.values())) == 3 and None not in nodes.values(), nodes   # one worker per node
    victim = next(w for w in before["workers"] if w["rank"] == 1)
    cut_at = time.time()
    netns_cluster.cut(nodes[1])

    # The run goes on without the cut worker, in a newer generation.
    wait_for(lambda: running(2, before["step"] + 10, before["generation"]), 120, "the run to go on with 2 workers")
    after = _status(run_dir)
    assert victim["pid"] not in [w["pid"] for w in after["workers"]], after["workers"]

    healed_at = time.time()
    netns_cluster.reconnect(nodes[1])
    try:
        wait_for(lambda: not pid_alive(victim["pid"]), 90, "the cut worker to exit once its link is back")
        exited_s = time.time() - healed_at
        # Fenced, not taken down with the job: the job was still running when the cut worker exited.
        job_went_on = job.poll() is None and _status(run_dir).get("state") not in ("finished", "failed")
    finally:
        open(_release_file(run_dir), "w").close()
    assert job_went_on, _status(run_dir)
    assert job.wait(timeout=150) == 0, _driver_log(tmp_path)

    summary = read_json(run_dir, "summary.json")
    assert summary["status"] == "finished" and summary["final_step"] == STEPS
    lost = [r for r in summary["recoveries"] if r["cause"] != "scale_up"]
    assert len(lost) == 1 and lost[0]["cause"] in ("hang", "node_lost"), summary["recoveries"]
    assert lost[0]["from_world"] == 3 and lost[0]["to_world"] == 2 and lost[0]["rung"] == "warm", lost
    print(f"\npartition recovery: {json.dumps(lost[0])}; link cut for {healed_at - cut_at:.1f}s; the cut "
          f"worker exited {exited_s:.1f}s after the heal; world sizes {summary['world_size_history']}")

    # Fenced: nothing of the old generation was written after the cut (its files from before the
    # cut are there: the check looks where they would be), nor committed once FENCE named the next
    # generation. A save whose every shard was written before the cut may still be committed by
    # rank 0 (not cut off) in the moments before the group is found broken: CI saw step 30's
    # commit 0.6 s after the cut, its shards all older than the cut. That is the protocol's own
    # order (docs/guarantees.md), not a fenced writer's commit ...
    from checkpointing import CheckpointManager
    from checkpointing.manifest import read_fence_doc
    from checkpointing.storage import Storage
    commits = CheckpointManager(run_dir).committed()
    assert before["generation"] in {c.generation for c in commits}
    fence = read_fence_doc(Storage(run_dir))
    assert fence is not None
    fenced_at = min(e.at for e in fence.history if e.generation > before["generation"])
    assert cut_at < fenced_at
    assert [c for c in commits if c.committed_at >= fenced_at and c.generation <= before["generation"]] == []
    old = f"g{before['generation']:06d}"
    old_files = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(run_dir, "checkpoints"))
                 for f in files if old in d.split(os.sep)]
    assert old_files and [f for f in old_files if os.path.getmtime(f) >= cut_at] == []
    # ... and reported no step: each step once, in order, at the world size of its generation
    # (step k ran at the size set after the last history entry before k).
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    steps = [m["step"] for m in lines]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS, steps
    history = summary["world_size_history"]
    assert [m["step"] for m in lines if m["world_size"] != [w for s, w in history if s < m["step"]][-1]] == []
    # Known gap, not a fencing matter: when the cut lands between a step's gradient all-reduce
    # and its report all-gather, the survivors keep the step but its line is never made.
    assert set(range(1, STEPS + 1)) - set(steps) <= {lost[0]["step"]}

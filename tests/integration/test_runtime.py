"""The elastic runtime end to end on a local Ray: clean runs, kills, hangs, FSDP, user errors."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from itertools import pairwise

import pytest
import torch

import gpt
import support
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig
from run_file_schemas import validate_run
from support import ShrunkHold, SignalAtStep, pid_alive, read_json, wait_for

pytestmark = [pytest.mark.integration]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {"model_size": "tiny", "batch_size": 8}


def trainer(run_dir, *, workers=(2, 2), steps=40, every=None, strategy="ddp", loop=gpt.train_loop,
            heartbeat_timeout_s=10.0, max_failures=5, config=TINY, collective_timeout_s=30.0, spare_workers=0,
            in_memory_every=1, node_agents=False, callbacks=None):
    # startup_wait_s: the tests that rescale from 3 begin with all 3 workers, however slow their start.
    return ElasticTrainer(
        loop, train_loop_config=config, total_steps=steps, seed=0, callbacks=callbacks,
        scaling=ScalingConfig(min_workers=workers[0], max_workers=workers[1], strategy=strategy,
                              startup_wait_s=120, spare_workers=spare_workers, node_agents=node_agents),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=every, in_memory_every_n_steps=in_memory_every),
        failure=FailureConfig(heartbeat_timeout_s=heartbeat_timeout_s, max_failures=max_failures,
                              collective_timeout_s=collective_timeout_s, rendezvous_timeout_s=60.0))


def expected_data_order(samples: int, seed: int = 0, n_samples: int = 100_000) -> str:
    """The data-order hash of exactly the first `samples` samples of the example's global order,
    computed here from the loader's order function, not by the run."""
    from types import SimpleNamespace

    from elastic._determinism import DataOrder
    from elastic._worker.loader import ElasticLoader
    loader = ElasticLoader(SimpleNamespace(seed=seed, dp_size=1, total_steps=1), range(n_samples), batch_size=1)
    return DataOrder.of(loader._dataset_indices(0, samples)).hexdigest()


def fit_with_fault(run_dir, fault: SignalAtStep | None, hold: bool = True, **kwargs):
    """A run with `fault` injected; with `hold`, the example loop waits at the fault's step for it."""
    if fault is not None:
        if hold:
            kwargs["config"] = {**kwargs.get("config", TINY), **fault.hold_config()}
        fault.start()
    result = trainer(run_dir, **kwargs).fit()
    if fault is not None:
        fault.join(timeout=5)
        assert fault.fired(), f"the fault never fired (run ended at step {result.final_step})"
    assert result.summary == read_json(run_dir, "summary.json") | {"config": result.summary["config"]}
    return result


@pytest.mark.timeout(120)
def test_clean_run_finishes_learns_and_writes_the_contract_files(ray_session, run_dir):
    result = fit_with_fault(run_dir, None, steps=40, every=20)
    s = result.summary
    assert result.ok and s["status"] == "finished" and s["final_step"] == 40 == s["total_steps"]
    assert s["loss_last"] < s["loss_first"]
    assert s["world_size_history"] == [[0, 2]] and s["recoveries"] == [] and s["checkpoints"] == [20, 40]
    assert s["resumed_from"] is None and len(s["model_sha256"]) == 64 and 0 < s["goodput"] <= 1
    assert s["config"]["scaling"]["min_workers"] == 2
    status = read_json(run_dir, "status.json")
    assert status["state"] == "finished" and status["step"] == 40 and status["last_committed_step"] == 40
    assert {"generation", "world_size", "updated_at", "workers"} <= set(status)
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == list(range(1, 41))
    assert lines[-1]["samples_seen"] == 40 * 16 and lines[0]["world_size"] == 2 and lines[0]["lr"] == 3e-3
    # Each rank's compute seconds on every line of a healthy run (they were on about half).
    assert all(len(m["compute_s"]) == 2 for m in lines), [m["step"] for m in lines if len(m["compute_s"]) != 2]
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "step_00000040", "COMMITTED"))


@pytest.mark.timeout(180)
def test_sigkill_of_rank_0_recovers_warm_loses_no_metrics_line_then_grows_back(ray_session, run_dir):
    # Not held at the fault's step (a held run would have reported every step before the kill):
    # rank 0 dies with steps it completed that the controller had not polled yet, and a
    # survivor has them. The run is long enough for the fault to land mid-run. The polls go
    # through a node agent (ScalingConfig.node_agents): its answers carry the death, the
    # survivors' records and the replacement's start as the direct polls of the other tests do.
    # The group of 2 left by the kill waits after its 10th step until the replacement is ready
    # (support.ShrunkHold): the regrowth lands inside 250 steps however slowly it starts.
    from ray import cloudpickle
    for module in (gpt, support):      # the loop's own module travels by value with it (ElasticTrainer.fit)
        cloudpickle.register_pickle_by_value(module)
    fault = SignalAtStep(run_dir, at_step=60, sig=signal.SIGKILL, rank=0)
    hold = ShrunkHold(2, 10, run_dir.rstrip("/") + ".regrow")
    hold.release_when(run_dir, lambda status: status.get("world_size") == 2 and status.get("spares"), 180,
                      "the replacement ready beside the group of 2")
    agent_carried = []            # status.json seen during the run with every member polled by the agent

    def watch():
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: _all_polled_by_agent(run_dir), 120, "the node agent to carry every member's polls")
            agent_carried.append(True)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = fit_with_fault(run_dir, fault, hold=False, workers=(2, 3), steps=250, every=100, node_agents=True,
                            loop=held_while_shrunk, config={**TINY, **hold.as_config()})
    watcher.join(timeout=5)
    assert agent_carried, "no status.json showed the members' polls carried by the node agent"
    s = result.summary
    assert result.ok and s["final_step"] == 250
    (recovery,) = [r for r in s["recoveries"] if r["cause"] == "worker_died"]
    assert recovery["rung"] == "warm" and recovery["lost_steps"] <= 1
    assert recovery["from_world"] == 3 and recovery["to_world"] == 2
    assert [f["cause"] for f in recovery["failures"]] == ["worker_died"]
    assert recovery["detected_at"] <= recovery["recovered_at"]
    assert metrics_steps(run_dir) == list(range(1, 251))
    sizes = [w for _, w in s["world_size_history"]]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, s["world_size_history"]
    assert not pid_alive(fault.pid)
    # Exactly once through 3 -> 2 -> 3: the consumed samples are the global order's first ones.
    assert s["samples_consumed"] == 24 * _steps_at(s, 3) + 16 * _steps_at(s, 2)
    assert s["data_order_sha256"] == expected_data_order(s["samples_consumed"])
    # The files others parse fit the JSON Schemas that ship in the package, after a recovery ...
    assert validate_run(run_dir) == {"status.json": 1, "summary.json": 1, "metrics.jsonl": 250}
    # Running again on the same storage resumes, although the fence moved on with the recoveries.
    again = fit_with_fault(run_dir, None, workers=(2, 3), steps=270, every=100, node_agents=True)
    assert again.ok and again.summary["resumed_from"] == 250 and again.final_step == 270
    assert again.summary["samples_consumed"] == s["samples_consumed"] + 24 * _steps_at(again.summary, 3) \
        + 16 * _steps_at(again.summary, 2)
    assert again.summary["data_order_sha256"] == expected_data_order(again.summary["samples_consumed"])
    assert validate_run(run_dir)["metrics.jsonl"] == 270                 # ... and after a resume


def held_while_shrunk(ctx) -> None:
    gpt.train_loop(ShrunkHold.wrap(ctx))


def _all_polled_by_agent(run_dir) -> bool:
    workers = (read_json(run_dir, "status.json") or {}).get("workers") or []
    return len(workers) >= 2 and all(w.get("polled_by") == "agent" for w in workers)


def metrics_steps(run_dir):
    return [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def dies_as_the_first_save_starts(ctx):
    """The example's loop; rank 1 of the first generation dies on entering the first save."""
    if ctx.rank == 1 and ctx.generation == 0:
        from checkpointing import CheckpointManager
        CheckpointManager.save = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    gpt.train_loop(ctx)


@pytest.mark.timeout(150)
def test_a_rank_lost_at_the_first_checkpoint_releases_the_survivors(ray_session, run_dir):
    # The checkpoint side group is formed with the generation, so the survivors' next collective
    # fails at once instead of waiting on the store for the dead rank (for collective_timeout_s,
    # set here beyond this test's timeout so that waiting it out cannot pass).
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(gpt)    # the loop below calls the example's, which workers cannot import
    # Two ranks, fixed: with three, CI once saw the surviving rank 0 stop answering polls for the
    # heartbeat timeout after it abandoned the save (a separate open bug, cold rung in ~10 s).
    result = fit_with_fault(run_dir, None, loop=dies_as_the_first_save_starts, workers=(2, 2), steps=40, every=10,
                            collective_timeout_s=300.0)
    s = result.summary
    assert result.ok and s["final_step"] == 40, result.error_traceback
    (recovery,) = [r for r in s["recoveries"] if r["cause"] == "worker_died"]
    assert recovery["rung"] == "warm" and recovery["lost_steps"] <= 1 and recovery["step"] >= 10
    assert metrics_steps(run_dir) == list(range(1, 41))


def dies_while_committing_the_final_step(ctx):
    """The example's loop; rank 0 of the first generation dies while it commits the final step
    (its shards are written, the manifest is not)."""
    if ctx.rank == 0 and ctx.generation == 0:
        from checkpointing import _save
        commit, total = _save._commit, ctx.total_steps

        def commit_or_die(job, records):
            if job.step == total:
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(job, records)
        _save._commit = commit_or_die
    gpt.train_loop(ctx)


@pytest.mark.timeout(150)
def test_a_run_whose_final_commit_is_lost_commits_it_again_before_finishing(ray_session, run_dir):
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(gpt)
    result = fit_with_fault(run_dir, None, loop=dies_while_committing_the_final_step, workers=(2, 2), steps=30,
                            every=10)
    s = result.summary
    assert result.ok and s["final_step"] == 30, result.error_traceback
    assert [r["cause"] for r in s["recoveries"]] == ["worker_died"], s["recoveries"]
    assert s["checkpoints"][-1] == 30 and s["model_sha256"], s
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "step_00000030", "COMMITTED"))


def a_peer_dies_inside_the_final_save(ctx):
    """The example's loop; rank 1 of the first generation dies while DCP plans the final save
    (the only one: no checkpoint interval), so the others' save fails on the broken collective."""
    if ctx.rank == 1 and ctx.generation == 0:
        from checkpointing._dcp_io import StorageWriter
        StorageWriter.prepare_local_plan = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    gpt.train_loop(ctx)


@pytest.mark.timeout(150)
def test_a_peer_lost_inside_the_final_save_is_recovered_not_a_fatal_checkpoint_error(ray_session, run_dir):
    # Seen in CI: rank 1 died as the final save began; rank 0's DCP save failed on the broken
    # collective, and that CheckpointError failed the run as fatal. It is the peer's failure.
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(gpt)
    result = fit_with_fault(run_dir, None, loop=a_peer_dies_inside_the_final_save, workers=(3, 3), steps=20)
    s = result.summary
    assert result.ok and s["final_step"] == 20, result.error_traceback
    assert [r["cause"] for r in s["recoveries"]] == ["worker_died"], s["recoveries"]
    assert s["checkpoints"] == [20] and s["model_sha256"], s
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "step_00000020", "COMMITTED"))


def _steps_at(summary, world_size):
    """Kept steps run at `world_size`, from the world-size history."""
    history = summary["world_size_history"] + [[summary["final_step"], None]]
    return sum(b[0] - a[0] for a, b in pairwise(history) if a[1] == world_size)


@pytest.mark.timeout(300)
def test_kill_with_replacement_is_bitwise_identical_to_a_clean_run(ray_session, tmp_path):
    # Three ranks: with two, a+b == b+a, so a changed reduction order could not show. The
    # replacement is the hot spare, ready before the kill (the run holds at the step until it is).
    # 100 steps: the kill held at step 60 (once the spare is ready), then 40 steps of the group
    # with the spare in it, compared bit for bit at the end.
    clean = fit_with_fault(str(tmp_path / "clean"), None, workers=(3, 3), steps=100)
    faulty_dir = str(tmp_path / "faulty")
    fault = SignalAtStep(faulty_dir, at_step=60, sig=signal.SIGKILL, rank=1, when=lambda status: status["spares"])
    faulty = fit_with_fault(faulty_dir, fault, workers=(3, 3), steps=100, spare_workers=1)
    assert faulty.ok and [r["cause"] for r in faulty.summary["recoveries"]] == ["worker_died"]
    assert {w for _, w in faulty.summary["world_size_history"]} == {3}
    (spare,) = fault.status_seen["spares"]
    assert spare["pid"] in [w["pid"] for w in read_json(faulty_dir, "status.json")["workers"]]
    assert faulty.summary["model_sha256"] == clean.summary["model_sha256"]
    for key in ("samples_consumed", "data_order_sha256"):
        assert faulty.summary[key] == clean.summary[key]
    assert clean.summary["samples_consumed"] == 100 * 24
    assert clean.summary["data_order_sha256"] == expected_data_order(100 * 24), clean.summary


@pytest.mark.exclusive
@pytest.mark.timeout(180)
def test_sigstop_is_detected_within_the_hang_bound_and_replaced(ray_session, run_dir, _no_stray_stopped_workers):
    # The default detection (heartbeat_timeout_s 10 s, hang_timeout_s "auto"): the others wait for
    # the stopped rank in DDP's sync, and it is declared hung after the learned bound (2 s with
    # these steps), long before the heartbeat timeout (issue 14: <= 3 s with steps <= 0.3 s).
    # Stopped mid-step, as R2 stops it, a few steps after the hold at step 60 is released (detect_s
    # is since it last moved or answered: stopped in the tests' hold, it would count the hold too),
    # with the commit of step 50 behind it and the next save 40 steps away. Not left to land where
    # the run happens to be: stopped inside a save in the run's first seconds, before the quiet
    # limit has learned the answers' gaps, a rank is found by the 10 s heartbeat, by design
    # (elastic/_controller/hang_watch.py; CI saw it once at step 50).
    fault = SignalAtStep(run_dir, at_step=60, sig=signal.SIGSTOP, rank=1, after_release_s=0.05)
    # 200 steps: the replacement's generation trains on and commits (steps 100 to 200) before the
    # stopped worker is woken, which is all the check below needs of the run after the fault.
    result = fit_with_fault(run_dir, fault, workers=(3, 3), steps=200, every=50)
    _no_stray_stopped_workers.append(fault.pid)
    assert result.ok and result.final_step == 200
    (recovery,) = result.summary["recoveries"]
    assert recovery["cause"] == "hang" and recovery["detect_s"] <= 3.0, recovery
    assert 60 <= recovery["step"] < 100, recovery          # stopped between the hold and the next save
    assert recovery["rung"] == "warm" and recovery["to_world"] == 3   # the stopped worker was replaced
    # Wake the stopped worker as an operator would: it must not write or commit anything.
    woken_at = time.time()
    try:
        os.kill(fault.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    wait_for(lambda: not pid_alive(fault.pid), 10, "the stopped worker to exit")
    from checkpointing import CheckpointManager
    for commit in CheckpointManager(run_dir).committed():
        assert commit.committed_at < fault.sent_at or commit.generation >= 1, commit
    stale = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(run_dir, "checkpoints"))
             for f in files if "g000000" in d and os.path.getmtime(os.path.join(d, f)) >= woken_at]
    assert stale == []


@pytest.mark.timeout(180)
def test_fsdp_trains_and_recovers_through_a_checkpoint(ray_session, run_dir):
    # Without copies in memory (tests/integration/test_fsdp_memory.py has them): the checkpoint rung.
    # Held at step 30 (fit_with_fault), the kill lands there: 100 steps leave the restored group
    # 70 steps and 7 commits of its own.
    fault = SignalAtStep(run_dir, at_step=30, sig=signal.SIGKILL, rank=1)
    result = fit_with_fault(run_dir, fault, workers=(2, 2), steps=100, every=10, strategy="fsdp",
                            in_memory_every=None)
    s = result.summary
    assert result.ok and s["final_step"] == 100 and s["loss_last"] < s["loss_first"]
    (recovery,) = s["recoveries"]
    assert recovery["rung"] == "checkpoint" and recovery["lost_steps"] < 10 + 5
    assert recovery["reason"] == "no member holds a copy of the state in memory; no node keeper holds a copy"
    assert recovery["step"] in s["checkpoints"] or recovery["step"] % 10 == 0


@pytest.mark.timeout(150)
def test_fsdp_rank_lost_before_any_commit_starts_every_rank_over(ray_session, run_dir):
    # No checkpoint and no copies in memory: the group starts fresh, and the survivor's counters
    # must start over with the new rank's.
    fault = SignalAtStep(run_dir, at_step=5, sig=signal.SIGKILL, rank=1)
    result = fit_with_fault(run_dir, fault, workers=(2, 2), steps=20, strategy="fsdp", in_memory_every=None)
    s = result.summary
    assert result.ok and s["final_step"] == 20, result.error_traceback
    (recovery,) = s["recoveries"]
    assert recovery["cause"] == "worker_died" and recovery["step"] == 0 and recovery["lost_steps"] == 5
    assert s["samples_consumed"] == 20 * 16 and s["data_order_sha256"] == expected_data_order(20 * 16)


def raise_at_step_3(ctx):
    model = ctx.prepare_model(torch.nn.Linear(4, 1))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = ctx.prepare_data([torch.randn(4) for _ in range(64)], batch_size=2)
    ctx.restore()
    for batch in loader:
        if ctx.step == 3:
            raise ValueError(f"bad batch on rank {ctx.rank}")
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.report(loss=0.0)


@pytest.mark.timeout(120)
def test_user_error_fails_fast_with_its_type_and_traceback(ray_session, run_dir):
    result = fit_with_fault(run_dir, None, loop=raise_at_step_3, steps=50, max_failures=20, config=None)
    assert not result.ok and isinstance(result.error, ValueError) and "bad batch" in str(result.error)
    assert "raise_at_step_3" in result.error_traceback and "ValueError" in result.error_traceback
    s = result.summary
    assert s["status"] == "failed" and s["recoveries"] == [] and s["final_step"] == 3
    assert s["error"]["type"] == "ValueError" and "raise_at_step_3" in s["error"]["traceback"]


def make_run(run_dir: str, steps: int) -> subprocess.CompletedProcess:
    args = f"--storage {run_dir} --workers 2:2 --steps {steps} --checkpoint-every 10 --model-size tiny --quiet"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    process = subprocess.Popen(["make", "-s", "run", f"RUN_ARGS={args}"], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out)


@pytest.mark.timeout(420)
def test_make_run_trains_and_resumes_to_the_same_model(ray_session, tmp_path):
    run_dir = str(tmp_path / "job")
    first = make_run(run_dir, 20)
    assert first.returncode == 0, first.stdout[-3000:]
    second = make_run(run_dir, 30)
    assert second.returncode == 0, second.stdout[-3000:]
    s = read_json(run_dir, "summary.json")
    assert s["status"] == "finished" and s["resumed_from"] == 20 and s["final_step"] == 30
    assert s["checkpoints"][-1] == 30
    steps = [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert steps == list(range(1, 31))           # no step repeated or skipped across the resume
    # The main job trains on the Parquet corpus it generated under its storage: so does the reference.
    straight = fit_with_fault(str(tmp_path / "straight"), None, workers=(2, 2), steps=30, every=10,
                              config={**TINY, "lr": 3e-3, "data": os.path.join(run_dir, "corpus")})
    assert s["model_sha256"] == straight.summary["model_sha256"]

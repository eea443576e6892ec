"""Pipeline parallelism end to end on a local Ray: PP 2 x DP 2 of the example GPT (its blocks cut
in two stages, 1F1B over 2 micro-batches), a SIGKILL of one stage rank in the middle of a step
(inside its backward, after the other stage's), its pipeline leaving whole while the other goes
on, the pipeline coming back warm from the survivor's memory stage by stage, the run ending on
the fault-free model bit for bit (constant global batch), and a resume of that model with no
pipeline (P 2 -> 1)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import pytest

import gpt
from elastic import CheckpointConfig, ElasticTrainer, FailureConfig, LRScalingConfig, ScalingConfig
from run_file_schemas import validate_run
from support import read_json, wait_for
from test_runtime import expected_data_order, metrics_steps
from test_tensor_parallel import counting_loads

pytestmark = [pytest.mark.integration]

STEPS = 50
KILL_AT = 10
REGROW_AT = 20      # the shrunk group waits after this step until the pipeline's replacement is ready
BATCH = 4


DIES = 2            # rank 2: stage 0 of pipeline 1


class _KilledMidStepThenHeld:
    """The context as the loop sees it, except that
    - with `died_file` set, rank DIES of the run's first generation SIGKILLs itself in the middle
      of step KILL_AT + 1: in stage 0's backward of the last micro-batch, after stage 1 finished
      its own (whose gradient reduce, within stage 1, can then complete without stage 0);
    - in a group of one pipeline every rank waits after step REGROW_AT until `release_file`
      exists: the pipeline's return then lands inside the run however slowly its replacement
      worker starts on a loaded machine."""

    def __init__(self, ctx, release_file: str, died_file: str | None):
        self._ctx, self._release_file, self._died_file = ctx, release_file, died_file

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def prepare_pipeline(self, model, **options):
        pipeline = self._ctx.prepare_pipeline(model, **options)
        if self._died_file and self._ctx.generation == 0 and self._ctx.rank == DIES:
            ctx, died_file, backwards = self._ctx, self._died_file, []

            def on_grad(grad):
                if ctx.step == KILL_AT:
                    backwards.append(grad)
                    if len(backwards) == 2:         # the last micro-batch's backward in stage 0
                        open(died_file, "w").close()
                        os.kill(os.getpid(), signal.SIGKILL)
                return grad

            def on_output(_module, _inputs, output):
                if output.requires_grad:
                    output.register_hook(on_grad)

            pipeline.blocks[0].register_forward_hook(on_output)
        return pipeline

    def report(self, **metrics):
        self._ctx.report(**metrics)
        if self._ctx.dp_size == 1 and self._ctx.step == REGROW_AT:
            from elastic._protocol import ThreadPlace
            from elastic._worker import thread_position
            from elastic._worker.fault_gate import HoldAt
            thread_position.mark(ThreadPlace.HELD)
            HoldAt(REGROW_AT, self._release_file).wait()


def killed_mid_step_then_held(ctx) -> None:
    counting_loads(_KilledMidStepThenHeld(ctx, ctx.config["regrow_file"], ctx.config.get("died_file")))


def _pp_run(run_dir: str, *, pp: int = 2, steps: int = STEPS, kill: bool = False,
            loads_file: str | None = None) -> tuple[dict, list[dict]]:
    """The example GPT at PP `pp` on 2 to 4 ranks (DP 1 to 2 at PP 2, DP 2 at PP 1), the global
    batch held at 2 replicas' batches."""
    import sys

    from ray import cloudpickle

    import test_tensor_parallel
    # The loop travels by value, with the example and the tests' loop wrappers it calls (the
    # workers import neither module).
    for module in (gpt, test_tensor_parallel, sys.modules[__name__]):
        cloudpickle.register_pickle_by_value(module)
    config = {"model_size": "tiny", "batch_size": BATCH, "optimizer": "sgd", "lr": 0.05, "microbatches": 2,
              "loads_file": loads_file or run_dir.rstrip("/") + ".loads",
              "regrow_file": run_dir.rstrip("/") + ".regrow"}
    if kill:
        config["died_file"] = run_dir.rstrip("/") + ".died"
        threading.Thread(target=_release_when_regrowable, args=(run_dir, config["regrow_file"]), daemon=True).start()
    result = ElasticTrainer(
        killed_mid_step_then_held, train_loop_config=config, total_steps=steps, seed=0,
        scaling=ScalingConfig(min_workers=pp, max_workers=2 * pp, pipeline_parallel_size=pp, startup_wait_s=120),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=1000),
        failure=FailureConfig(heartbeat_timeout_s=10.0, collective_timeout_s=30.0, rendezvous_timeout_s=60.0),
        lr=LRScalingConfig(base_world_size=2, warmup_steps=5, mode="constant_global_batch")).fit()
    if kill:
        assert os.path.exists(config["died_file"]), f"rank {DIES} never died (run ended at step {result.final_step})"
    assert result.ok, result.error_traceback
    return result.summary, [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _release_when_regrowable(run_dir: str, release_file: str) -> None:
    """Release the shrunk group once status.json shows two ready workers outside it (the killed
    rank's stage peer and its replacement): a whole pipeline to grow back with."""
    def regrowable() -> bool:
        status = read_json(run_dir, "status.json") or {}
        return status.get("world_size") == 2 and len(status.get("spares") or []) >= 2

    try:
        wait_for(regrowable, timeout_s=180, what="the killed pipeline's two workers ready outside the shrunk group")
    finally:
        open(release_file, "w").close()


@pytest.mark.timeout(480)
def test_a_killed_stage_rank_takes_its_pipeline_out_which_heals_from_memory_bitwise(ray_session, tmp_path):
    clean, clean_lines = _pp_run(str(tmp_path / "clean"))
    faulty_dir = str(tmp_path / "faulty")
    loads_file = faulty_dir + ".loads"
    s, lines = _pp_run(faulty_dir, kill=True, loads_file=loads_file)

    # 4 ranks (DP 2) -> the killed rank's pipeline leaves: 2 (DP 1) -> a replacement completes it: 4.
    assert [w for _, w in s["world_size_history"]] == [4, 2, 4], s["world_size_history"]
    assert [layout for _, layout in s["layout_history"]] == [
        {"dp": 2, "tp": 1, "pp": 2}, {"dp": 1, "tp": 1, "pp": 2}, {"dp": 2, "tp": 1, "pp": 2}]
    died, grew = s["recoveries"]
    # Killed mid-step, the pipelines still agree: no stage applied step KILL_AT + 1, so every
    # place of the surviving pipeline holds step KILL_AT and the restore is warm.
    assert died["cause"] == "worker_died" and died["rung"] == "warm" and died["lost_steps"] == 0, died
    assert died["step"] == KILL_AT, died
    assert died["from_world"] == 4 and died["to_world"] == 2
    assert grew["cause"] == "scale_up" and grew["rung"] == "warm" and grew["to_world"] == 4, grew
    assert "model shards (all 2 places" in died["reason"] and "model shards (all 2 places" in grew["reason"]
    # No checkpoint was read: the returning pipeline's stages came from the survivor's memory.
    assert not os.path.exists(loads_file), open(loads_file).read()
    # Each step once; the survivor took both replicas' micro-batches at DP 1, so the run ends on
    # the fault-free model, with the same samples in the same order.
    assert metrics_steps(faulty_dir) == list(range(1, STEPS + 1))
    assert s["model_sha256"] == clean["model_sha256"] and len(clean["model_sha256"]) == 64
    assert s["samples_consumed"] == clean["samples_consumed"] == STEPS * 2 * BATCH
    assert s["data_order_sha256"] == clean["data_order_sha256"] == expected_data_order(STEPS * 2 * BATCH)
    assert [m["loss"] for m in lines] == [m["loss"] for m in clean_lines]
    status = read_json(faulty_dir, "status.json")
    assert status["layout"] == {"dp": 2, "tp": 1, "pp": 2}
    assert [(w["replica"], w["pp_rank"]) for w in status["workers"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert validate_run(faulty_dir) == {"status.json": 1, "summary.json": 1, "metrics.jsonl": STEPS}

    # P 2 -> 1: a copy of the run resumes with no pipeline (the whole model on each of 2 ranks),
    # the run itself at P 2, both for the same 5 steps: the checkpoint's names are the whole
    # model's, the same samples, and the same losses up to the order of the sums.
    switched = faulty_dir + "-unpipelined"
    shutil.copytree(faulty_dir, switched)
    unpiped, unpiped_lines = _pp_run(switched, pp=1, steps=STEPS + 5, loads_file=loads_file)
    kept, kept_lines = _pp_run(faulty_dir, steps=STEPS + 5, loads_file=loads_file)
    assert unpiped["resumed_from"] == kept["resumed_from"] == STEPS
    assert unpiped["layout_history"][0] == [STEPS, {"dp": 2, "tp": 1, "pp": 1}]
    assert [m["step"] for m in unpiped_lines] == list(range(1, STEPS + 6)) == [m["step"] for m in kept_lines]
    assert unpiped["data_order_sha256"] == kept["data_order_sha256"]
    for a, b in zip(unpiped_lines[STEPS:], kept_lines[STEPS:], strict=True):
        assert a["lr"] == b["lr"] and a["global_batch"] == b["global_batch"] == 2 * BATCH
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), (a["step"], a["loss"], b["loss"])
    # Each resume read the checkpoint once per rank (2 and 4 ranks), and nothing else did.
    assert len(open(loads_file).read().split()) == 6

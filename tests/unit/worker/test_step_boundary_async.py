"""The non-blocking step boundary (issue 18) on real TrainContexts, no Ray: two ranks in two
processes over gloo (the group decides one step late, and every rank leaves at the same step,
after a rescale request or a preemption notice that reaches one rank only); one rank in this
process (every step's record is kept, in order, whatever ends the loop); DDP's bucket layout
fixed without find_unused_parameters; the compute-time stamp at the end of backward."""
from __future__ import annotations

import json
import math
import multiprocessing
import threading

import pytest
import torch
from torch import nn

from support import run_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

STEPS = 8


def _rank_main(rank: int, ports, storage: str, flag: str, flag_rank: int, flag_before: int, out: str) -> None:
    """One rank: train STEPS steps, `flag` set on `flag_rank` (-1: on every rank) before the report
    of step `flag_before`: "stop" (a rescale request), "preempt" (a notice), "elastic_stop" (the
    controller's stop: a notice that asks for a commit), "preempt_staggered" (a notice to
    `flag_rank`, and one to the other rank a step later, before the step the group leaves from);
    writes what it saw to `out`.
    Rank 0's store binds a port the OS picks and hands it to rank 1 through `ports` (a port
    picked free beforehand can be taken by another test's process first)."""
    import torch.distributed as dist

    from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
    from elastic._worker.state import WorkerState
    from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
    from elastic.context import RescaleInterrupt, TrainContext
    torch.set_num_threads(1)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=60), 2, False)
    port = store.port
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    spec = RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy="ddp", use_gpu=False),
                   checkpoint=CheckpointConfig(storage=storage, keep=None,
                                               async_save=False, max_consecutive_failures=3),
                   failure=FailureConfig(collective_timeout_s=60.0))
    worker = WorkerState()
    stop, preempted, commit_requested = threading.Event(), threading.Event(), threading.Event()
    plan = GenerationPlan(generation=1, rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                          restore=RestorePlan("fresh"), timeout_s=60.0)
    ctx = TrainContext(plan=plan, spec=spec, worker=worker, loop_config=None, stop_requested=stop,
                       preempted=preempted, commit_requested=commit_requested, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = ctx.prepare_model(nn.Linear(4, 1))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.restore()
    left_at = None
    losses = []
    try:
        for step in range(STEPS):
            torch.manual_seed(100 * rank + step)
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
            if flag_rank in (rank, -1) and step + 1 == flag_before:
                if flag == "elastic_stop":
                    commit_requested.set()
                (stop if flag == "stop" else preempted).set()
            if flag == "preempt_staggered" and rank != flag_rank and step + 1 == flag_before + 1:
                preempted.set()
            ctx.report(loss=loss, acc=torch.tensor(float(rank)))
    except RescaleInterrupt:
        left_at = ctx.step
    else:
        ctx._finish()
    records = [{"step": r.step, "loss": r.loss, "acc": r.metrics.get("acc"), "compute_s": list(r.compute_s)}
               for r in worker.outbox.drain()]
    commit = worker.checkpoints.manager.last_commit if worker.checkpoints.manager is not None else None
    with open(out, "w") as f:
        json.dump({"left_at": left_at, "step": ctx.step, "losses": losses, "records": records,
                   "committed": commit.step if commit is not None else None}, f)
    if worker.checkpoints.manager is not None:
        worker.checkpoints.manager.close()
    # Teardown in order, before the group goes: once in five runs under load, a rank hung in C++
    # (no Python frame) while this function's locals were freed after destroy_process_group(),
    # with DDP, the step exchange and the group dropped together. Not root-caused (see issue 18's
    # note); freed one by one first, it did not recur in 6 runs.
    import gc
    del optimizer, model, ctx
    gc.collect()
    dist.destroy_process_group()
    del store
    gc.collect()


def _two_ranks(tmp_path, flag: str, flag_rank: int, flag_before: int) -> list[dict]:
    mp = multiprocessing.get_context("spawn")
    ports = mp.Queue()
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    procs = [mp.Process(target=_rank_main, args=(r, ports, str(tmp_path / "run"), flag, flag_rank, flag_before,
                                                  outs[r])) for r in range(2)]
    run_processes(procs, timeout_s=150)
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def _check_records(results: list[dict], last: int) -> None:
    """Every rank has every step's record, in order, with the group's means and the per-rank
    compute times (on every rank's at this world size: the controller may take a step from any
    of them first, and its metrics line must have the times; above COMPUTE_TIMES_PER_LINE ranks
    on rank 0's alone, see test_controller_scale)."""
    for result in results:
        assert [r["step"] for r in result["records"]] == list(range(1, last + 1))
        for record in result["records"]:
            i = record["step"] - 1
            assert math.isclose(record["loss"], (results[0]["losses"][i] + results[1]["losses"][i]) / 2,
                                rel_tol=1e-6)
            assert record["acc"] == 0.5
            assert len(record["compute_s"]) == 2


@pytest.mark.parametrize("flag_rank", [0, 1], ids=["rank0", "rank1"])
def test_a_stop_request_on_one_rank_unwinds_every_rank_at_the_same_step_one_step_later(tmp_path, flag_rank):
    results = _two_ranks(tmp_path, "stop", flag_rank=flag_rank, flag_before=3)
    # Set before the report of step 3, posted with step 3's exchange, acted on at step 4 by both.
    assert [r["left_at"] for r in results] == [4, 4]
    _check_records(results, 4)


@pytest.mark.parametrize(("flag", "flag_rank", "commits"), [
    ("preempt", 1, False),          # DDP: the rank that stays holds a full replica, no commit needed
    ("preempt", -1, True),          # every rank leaves: the state would be lost
    ("elastic_stop", 1, True),      # the run stops: its state must be on storage
    ("preempt_staggered", 1, True),  # the other rank's notice came after the decision to leave
], ids=["notice_to_one", "notice_to_all", "elastic_stop", "notices_a_step_apart"])
def test_a_preemption_notice_leaves_at_the_same_step_on_both_and_commits_only_if_the_state_would_be_lost(
        tmp_path, flag, flag_rank, commits):
    results = _two_ranks(tmp_path, flag, flag_rank=flag_rank, flag_before=5)
    assert [r["left_at"] for r in results] == [6, 6]
    assert [r["committed"] for r in results] == ([6, 6] if commits else [None, None])
    _check_records(results, 6)


def test_without_a_flag_both_ranks_finish_with_every_steps_record(tmp_path):
    results = _two_ranks(tmp_path, "stop", flag_rank=0, flag_before=STEPS + 10)
    assert [r["left_at"] for r in results] == [None, None] and [r["step"] for r in results] == [STEPS, STEPS]
    _check_records(results, STEPS)


# ---- one rank, in this process ------------------------------------------------------------
def _prepared(run):
    ctx = run.context("fresh")
    model = ctx.prepare_model(nn.Linear(4, 1))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.restore()
    return ctx, model, optimizer


def _step(ctx, model, optimizer, loss_value: float | None = None) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    ctx.report(loss=loss if loss_value is None else torch.tensor(loss_value))


def test_records_come_in_step_order_and_none_is_lost_when_the_loop_fails(generations):
    ctx, model, optimizer = _prepared(generations())
    for _ in range(3):
        _step(ctx, model, optimizer)
    # The generation's first step is read at once (it ends a recovery), the others a step
    # later: step 3's is pending, and the failure path keeps it.
    assert [r.step for r in ctx._worker.outbox.drain()] == [1, 2]
    ctx._abandon()
    assert [r.step for r in ctx._worker.outbox.drain()] == [3]


def test_the_last_steps_record_is_kept_at_the_end_of_the_run(generations):
    ctx, model, optimizer = _prepared(generations())
    for _ in range(3):
        _step(ctx, model, optimizer)
    ctx._finish()
    assert [r.step for r in ctx._worker.outbox.drain()] == [1, 2, 3]


def test_a_step_logged_on_one_rank_comes_after_its_steps_record(generations):
    ctx, model, optimizer = _prepared(generations())
    for _ in range(2):
        _step(ctx, model, optimizer)
    ctx.log(eval_loss=1.5)
    assert [(r.step, r.kind) for r in ctx._worker.outbox.drain()] == [(1, "step"), (2, "step"), (2, "log")]


def test_the_position_reports_the_newest_exchange_collected(generations):
    # What the hang judge proves a silent rank's older answer stale with (hang_watch): an
    # exchange is collected at the next report (the generation's first at once).
    from elastic._worker import thread_position
    ctx, model, optimizer = _prepared(generations())
    position = thread_position.ThreadPosition(completed=lambda: ctx.step, news=threading.Event())
    position.enter(generation=0)
    try:
        seen = []
        for _ in range(3):
            _step(ctx, model, optimizer)
            seen.append(position.report().exchanged)
        assert seen == [1, 1, 2]
        ctx.log(eval_loss=1.0)                      # log() collects what is pending
        assert position.report().exchanged == 3
        position.enter(generation=1)
        assert position.report().exchanged == 0    # counted per generation
    finally:
        thread_position._bound.position = None


def test_a_nonfinite_loss_is_found_before_its_step_is_checkpointed(generations):
    from elastic import NonFiniteLossError
    run = generations(checkpoint_every=2)
    ctx, model, optimizer = _prepared(run)
    _step(ctx, model, optimizer)
    with pytest.raises(NonFiniteLossError, match="the loss of step 2 is nan"):
        _step(ctx, model, optimizer, loss_value=float("nan"))
    assert run.worker.checkpoints.last_saved_step is None


# ---- DDP: bucket layout and compute stamp --------------------------------------------------
def _ddp(timer=None):
    from elastic._worker import wrap as _wrap
    from elastic._worker.step_timer import StepTimer
    from elastic.config import ScalingConfig
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 50))
    ddp, _ = _wrap.wrap_model(model, device=torch.device("cpu"), world_size=1, scaling=ScalingConfig(),
                              timer=timer or StepTimer(), seed=0)
    return ddp


def _train(ddp, steps: int) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(steps):
        ddp(torch.randint(0, 50, (8,))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _layout(ddp) -> list[list[int]]:
    """Each gradient bucket's parameters (by id in the module's parameter order)."""
    index = {id(p): i for i, p in enumerate(ddp.parameters())}
    return [[index[id(p)] for p in bucket.parameters()] for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def test_ddp_keeps_one_bucket_layout_from_its_first_step_without_find_unused(one_rank_group):
    old = _ddp()
    _train(old, 5)
    fresh = _ddp()
    _train(fresh, 1)
    # No unused-parameter search (DDP's warning about it comes from C++ on stderr: see
    # tests/integration/test_step_boundary_cost.py, which greps a run's output for it).
    assert not old.find_unused_parameters
    # A generation's first step reduces in the layout a long-running wrapper uses (without the
    # fix: the reverse order of the parameters after DDP's rebuild, parameter order before it).
    assert _layout(fresh) == _layout(old)


def test_the_compute_stamp_is_taken_once_when_backward_ends(one_rank_group):
    from elastic._worker.step_timer import StepTimer
    timer = StepTimer()
    ddp = _ddp(timer)
    assert ddp._get_ddp_logging_data().get("comm_hook") in (None, "", "builtin_allreduce")   # no Python hook
    calls = []
    mark = timer.mark_compute_done
    timer.mark_compute_done = lambda: (calls.append(1), mark())   # type: ignore[method-assign]
    timer.start()
    loss = ddp(torch.randint(0, 50, (8,))).pow(2).mean()
    before = timer._compute_done
    loss.backward()
    assert before is None and timer._compute_done is not None and calls == [1]
    with torch.no_grad():                       # no backward: no stamp, and nothing left queued
        ddp(torch.randint(0, 50, (8,)))
    assert calls == [1]


def test_an_exchange_is_collected_or_falls_back_to_this_ranks_values(one_rank_group):
    from elastic._worker import step_exchange
    pending = step_exchange.post([1.0, 0.0, 1.0], {0: torch.tensor(2.5)}, device=torch.device("cpu"), world_size=1)
    assert pending.collect().tolist() == [[2.5, 0.0, 1.0]]
    assert pending.own_values().tolist() == [[2.5, 0.0, 1.0]]

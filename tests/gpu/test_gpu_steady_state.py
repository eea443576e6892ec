"""Issue 18 on a GPU: in steady state the framework's step boundary puts no host-device
synchronisation on the step. A real TrainContext on a one-rank NCCL group in this process (no Ray),
the model and optimizer prepared as the runtime prepares them, the loop reporting its loss as a
tensor (it never reads it itself):

- under `torch.cuda.set_sync_debug_mode("error")` every synchronising call torch routes through
  its sync checks (`.item()`, `.cpu()`, blocking copies, stream and device synchronisation) raises,
  so steady-state steps that finish have made none of them;
- a spin kernel queued just before `ctx.report()` is still running when report() returns: the
  boundary did not wait for the device to finish the step it closed (it reads the step's values at
  the next report, behind an event recorded after them);
- the records still arrive, each step's at the next report, with that step's values: the loss and
  a tensor metric the device computed, a number the host gave (one that held another step's values,
  or memory the all-gather had not written yet, fails).
"""
import threading

import pytest
import torch
import torch.nn.functional as F

import gpt

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

CUDA = torch.device("cuda", 0)
CFG = gpt.GPTConfig.named("tiny")
DATA = gpt.SyntheticTokens(4000, CFG.seq_len, CFG.vocab)
SPIN_CYCLES = 500_000_000   # a few hundred ms of one SM's clock: far longer than report()'s host work


def _context(tmp_path):
    from elastic._protocol import GenerationPlan, RestorePlan, RunSpec
    from elastic._worker.state import WorkerState
    from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
    from elastic.context import TrainContext
    spec = RunSpec(user_code=b"", total_steps=100, seed=0,
                   scaling=ScalingConfig(strategy="ddp", use_gpu=True),
                   checkpoint=CheckpointConfig(storage=str(tmp_path / "run"), keep=None,
                                               async_save=False, max_consecutive_failures=3),
                   failure=FailureConfig(collective_timeout_s=60.0))
    plan = GenerationPlan(generation=1, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                          restore=RestorePlan("fresh"), timeout_s=60.0)
    return TrainContext(plan=plan, spec=spec, worker=WorkerState(), loop_config=None,
                        stop_requested=threading.Event(), preempted=threading.Event(), device=CUDA)


def _batch(step: int) -> torch.Tensor:
    """The 8 samples of 0-based `step`, on the host."""
    return torch.stack([DATA[step * 8 + i] for i in range(8)])


def _step(ctx, model, optimizer, step: int, *, spin: bool = False) -> torch.Tensor:
    """One step (0-based `step`, counted as step + 1); its loss, still on the device. Reported: the
    loss and the batch's token sum as device tensors, the step's index as a host number, each
    different at every step, so a record that carried another step's values (or memory nothing
    wrote) shows."""
    batch = _batch(step).pin_memory().to(CUDA, non_blocking=True)
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if spin:
        torch.cuda._sleep(SPIN_CYCLES)
    ctx.report(loss=loss.detach(), token_sum=batch.sum(), index=step, tokens=batch.numel())
    return loss.detach()


def test_steady_state_steps_make_no_host_device_sync_and_report_does_not_wait_for_its_step(nccl_group, tmp_path):
    ctx = _context(tmp_path)
    torch.manual_seed(0)
    model = ctx.prepare_model(gpt.GPT(CFG).to(CUDA))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True))
    ctx.restore()
    losses: dict[int, torch.Tensor] = {}   # by the step's number (index + 1)
    for step in range(3):                 # the first steps: DDP's first-iteration work, pinned buffers cached
        losses[step + 1] = _step(ctx, model, optimizer, step)
    assert [r.step for r in ctx._worker.outbox.drain()] == [1, 2]   # the first at once, then a step late
    still_busy = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3, 9):
            losses[step + 1] = _step(ctx, model, optimizer, step, spin=True)
            still_busy.append(not torch.cuda.current_stream().query())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    waited = [4 + i for i, busy in enumerate(still_busy) if not busy]
    assert not waited, f"report() waited for the device at steps {waited}"
    # Each step's record is kept at the next report: steps 3 (pending after the first steps) to 8;
    # the ninth's exchange is still pending, read when someone needs it settled.
    records = ctx._worker.outbox.drain()
    assert [r.step for r in records] == [3, 4, 5, 6, 7, 8]
    # Each record holds its own step's values: the device's loss and token sum, the host's index.
    got = {r.step: (r.loss, r.metrics["token_sum"], r.metrics["index"], r.metrics["tokens"]) for r in records}
    want = {s: (pytest.approx(losses[s].item(), rel=1e-6), int(_batch(s - 1).sum()), s - 1, 8 * DATA[0].numel())
            for s in got}
    assert got == want
    ctx._boundary.settle()
    assert [r.step for r in ctx._worker.outbox.drain()] == [9]

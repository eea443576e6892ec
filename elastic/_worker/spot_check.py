"""Compute corruption: the spot check.

A fault in one rank's forward or backward compute (a wrong product in a matrix multiply, a bit
flipped in an activation) corrupts that rank's gradient, and the gradient all-reduce averages it
into every replica's: the replicas stay bit-identical, so the parameters' fingerprints
(elastic._worker.fingerprint) agree and cannot see it. To see it the replicas must compute the
same thing and compare. Every FailureConfig.spot_check_every_n_steps steps (and at every step
whose checkpoint is committed, and the final one) every rank recomputes the gradient of one
shared micro-batch and the ranks compare what they got:

- The micro-batch. During a step that will be checked, a forward pre-hook on the prepared
  model's module keeps a reference to the arguments of its last forward (this rank's micro-batch:
  no copy). At the check one rank, in turn, broadcasts them; every rank then holds the same input.
- The recompute. The module (not its DDP wrapper: no all-reduce) runs forward in the mode the
  loop left it in, under the run's autocast and a fixed seed (the training RNG is forked, not
  consumed: every rank draws the same dropout masks), its buffers put back afterwards (batch
  norm's statistics are each rank's own under DDP, and a training-mode forward moves them; eval
  mode would read them and differ across ranks), and the gradient of a surrogate loss, the mean
  square of every floating output, is taken with `autograd.grad`: the parameters' `.grad` are
  not touched, and the hooks a fault would act through (a tensor hook on
  a parameter) run as in training. The user's loss function is not needed: a corrupt forward or
  backward kernel shows in the gradient of any loss that depends on the output's values.
- The comparison. Each rank sends a row: the 64-bit fingerprint of the gradients (exact), the
  newest step it knows to have passed a check, and (on GPUs) per gradient its sum, sum of
  squares and largest magnitude (float64). A rank whose recompute raised (out of memory, a model
  that refuses the input) says so in its row, and that check is skipped on every rank. On a CPU
  the recompute is bit-exact across ranks (same kernels, same reduction order), and the
  fingerprints are compared. On GPUs some backward kernels accumulate with atomics (an
  embedding's), so the statistics are compared instead, with a relative tolerance (SPOT_RTOL): a
  corruption that moves a gradient's sum, norm or maximum by less than that goes unseen there.
  The verdict is elastic._worker.fingerprint's: with 3 or more ranks the ones that differ from a
  strict majority are named, with 2 both are suspects.

A mismatch raises SilentCorruptionError on every rank, at the same step. The corruption may have
entered the model at any step since the last check passed (it reaches every replica through the
all-reduce), so the run rolls back to a state from before the step after it (`since`): a memory
copy or checkpoint from no later than the last passed check. A scheduled checkpoint, and the
final one, is committed only at a step whose check passed; the commit a group takes when it
leaves (a preemption notice, `elastic stop`) follows the parameters' verdict alone. What this
finds: a fault that persists across steps (a bad unit, a degraded part), within
spot_check_every_n_steps steps. A one-off fault in a step that is not checked trains on unseen,
as it would in any framework that does not recompute every step.

Where it runs: DDP without tensor or pipeline parallelism (every rank a whole replica, and the
module callable alone). Under FSDP, HSDP, TP and PP a rank's forward is a collective with its
shard or stage peers; the spot check is not done there (the parameter fingerprints still are).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic._determinism import mix_seed
from elastic._protocol import GenerationPlan, RestoreKind, RestorePlan, RunSpec, ThreadPlace
from elastic._worker import fingerprint as _fingerprint
from elastic._worker import thread_position
from elastic._worker.state import WorkerState
from elastic.errors import SilentCorruptionError
from elastic.layout import Layout

log = logging.getLogger("elastic.worker")

SPOT_RTOL = 1e-4      # GPUs: the relative difference of a gradient statistic that counts as a mismatch
# A row: the fingerprint's halves, the newest passed check, the recomputed flag (slot _OK); then
# 3 statistics a gradient, where they are compared.
_FIXED = 4
_OK = 3


class SpotCheck:
    """One generation's spot checks on one rank, for the module `module` (the first prepared
    model, unwrapped)."""

    def __init__(self, module: nn.Module, *, every: int, spec: RunSpec, worker: WorkerState, rank: int,
                 world_size: int, device: torch.device, exact: bool, seed: int, autocast: Callable[[], Any]):
        """`worker.spot_verified`: this rank's newest step known clean (for_generation sets it at
        the generation's start; a passed check moves it on)."""
        self._module, self._worker = module, worker
        self._every, self._spec = every, spec
        self._rank, self._world, self._device = rank, world_size, device
        self._exact, self._seed, self._autocast = exact, seed, autocast
        self._captured: tuple[tuple, dict] | None = None
        self._recomputing = False
        self._warned = False
        self._hook = module.register_forward_pre_hook(self._capture, with_kwargs=True)

    def close(self) -> None:
        """The generation ends: the module's hook goes, and the kept input with it."""
        self._hook.remove()
        self._captured = None

    def due(self, step: int) -> bool:
        """Whether the boundary after step `step` runs a check: every `every` steps, and before
        each commit (a scheduled checkpoint, the final one)."""
        return step % self._every == 0 or self._spec.checkpoint_due(step) or step == self._spec.total_steps

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The forward pre-hook: during a step that will be checked, keep its input (a reference)."""
        if not self._recomputing and self.due(self._worker.progress.step + 1):
            self._captured = (args, kwargs)

    def check(self, step: int) -> None:
        """Collective, at the boundary after step `step` (when `due`): recompute the shared
        micro-batch, compare, and raise SilentCorruptionError on a mismatch (every rank alike)."""
        source = (step // self._every) % self._world
        with thread_position.waiting(ThreadPlace.SYNC):
            batch = [_to(self._captured, torch.device("cpu")) if self._rank == source else None]
            dist.broadcast_object_list(batch, src=source)
        self._captured = None
        if batch[0] is None:
            if not self._warned:
                self._warned = True
                log.warning("spot check at step %d skipped: rank %d's model ran no forward in that step (call the "
                            "prepared model's forward, or set FailureConfig.spot_check_every_n_steps=None)",
                            step, source)
            return
        args, kwargs = _to(batch[0], self._device)
        try:
            row = self._row(self._gradients(args, kwargs))
        except Exception as error:   # noqa: BLE001 - the others wait in the all-gather: a row says it failed
            log.warning("spot check at step %d: the recompute failed on rank %d (%s: %s); this check is skipped",
                        step, self._rank, type(error).__name__, error)
            row = self._failed_row()
        rows = [torch.empty_like(row) for _ in range(self._world)]
        with thread_position.waiting(ThreadPlace.SYNC):
            dist.all_gather(rows, row)
        table = torch.stack(rows)
        if not bool((table[:, _OK] > 0).all()):
            return       # a rank could not recompute (out of memory, a model that refuses the input)
        verdict = _fingerprint.judge(agreeing_classes(table, exact=self._exact), 1, step)
        if verdict is None:
            self._worker.spot_verified = step
            return
        raise spot_check_error(verdict, since=int(table[:, 2].max()) + 1, replicas=self._world)

    def _gradients(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The gradient of the surrogate loss on the shared input, per trainable parameter."""
        params = [p for p in self._module.parameters() if p.requires_grad]
        # The buffers as they are: a forward in training mode moves batch norm's statistics.
        buffers = [(b, b.detach().clone()) for b in self._module.buffers()]
        devices = [self._device] if self._device.type == "cuda" else []
        self._recomputing = True
        try:
            with torch.random.fork_rng(devices=devices), self._autocast():
                torch.manual_seed(mix_seed(self._seed, "spot-check"))
                loss = surrogate_loss(self._module(*args, **kwargs))
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            self._recomputing = False
            with torch.no_grad():
                for buffer, kept in buffers:
                    buffer.copy_(kept)
        return [g.detach() if g is not None else torch.zeros_like(p) for g, p in zip(grads, params, strict=True)]

    def _row(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """This rank's row: the fingerprint's halves, its newest passed check, 1 (recomputed),
        then, where the statistics are compared, per gradient its sum, sum of squares and largest
        magnitude (float64 sums). A CPU compares the fingerprints alone: no statistics (they
        cost 13 % of a check of the small GPT)."""
        folded = _fingerprint.fingerprint(grads)
        zero = torch.zeros((), dtype=torch.float64, device=self._device)
        head = [*(_fingerprint.halves(folded) if folded is not None else (zero, zero)),
                zero + float(self._worker.spot_verified), zero + 1.0]
        stats = []
        if not self._exact:
            for g in grads:
                stats += [g.sum(dtype=torch.float64), (g * g).sum(dtype=torch.float64),
                          g.abs().max().double() if g.numel() else zero]
        return torch.stack([t.to(self._device) for t in head] + stats)

    def _failed_row(self) -> torch.Tensor:
        """A row of the same length that says this rank did not recompute."""
        size = _FIXED + (0 if self._exact else 3 * sum(p.requires_grad for p in self._module.parameters()))
        row = torch.zeros(size, dtype=torch.float64, device=self._device)
        row[2] = float(self._worker.spot_verified)
        return row


def for_generation(models: list[tuple[nn.Module, nn.Module]], *, spec: RunSpec, plan: GenerationPlan,
                   layout: Layout, worker: WorkerState, restored: RestorePlan, device: torch.device,
                   autocast: Callable[[], Any]) -> SpotCheck | None:
    """The generation's spot check, from `ctx.restore`: on the first prepared model (`models`:
    as returned to the user, unwrapped), when FailureConfig asks for it and the layout allows it
    (see the module docstring); else None."""
    failure = spec.failure
    if not (failure.sdc_check and failure.spot_check_every_n_steps and spec.scaling.strategy == "ddp"
            and layout.replica_size == 1 and plan.world_size >= 2 and models):
        return None
    module = _checked_module(models[0][0])
    if module is None:
        return None
    step = worker.progress.step
    # Known clean: a checkpoint's step (committed only where a check passed) or the start; a
    # state from the survivors' memory, as far as this process saw checks pass (the ranks that
    # saw more say so in their rows: the verdict takes the newest).
    worker.spot_verified = step if restored.kind in (RestoreKind.CHECKPOINT, RestoreKind.FRESH) \
        else min(worker.spot_verified, step)
    return SpotCheck(module, every=failure.spot_check_every_n_steps, spec=spec, worker=worker, rank=plan.rank,
                     world_size=plan.world_size, device=device, exact=not spec.scaling.use_gpu, seed=spec.seed,
                     autocast=autocast)


def _checked_module(prepared: nn.Module) -> nn.Module | None:
    """The module inside DDP's wrapper, which a rank can run alone (a P = 1 Pipeline's too)."""
    from torch.nn.parallel import DistributedDataParallel

    from elastic._worker.pipeline import Pipeline
    if isinstance(prepared, Pipeline):
        prepared = prepared.__dict__["stage_modules"][0]
    return prepared.module if isinstance(prepared, DistributedDataParallel) else None


def surrogate_loss(output: Any) -> torch.Tensor:
    """The mean square of every floating tensor in `output` (a tensor, a tuple, list or dict of
    them, nested), summed: its gradient depends on every output value."""
    tensors = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise TypeError(f"the model's output ({type(output).__name__}) holds no floating tensor that requires grad: "
                        f"the spot check has no gradient to compare; set FailureConfig.spot_check_every_n_steps=None")
    return sum((t.float().square().mean() for t in tensors), torch.zeros((), device=tensors[0].device))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _to(value: Any, device: torch.device) -> Any:
    """`value` (tensors in tuples, lists and dicts) with its tensors on `device`, detached."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_to(v, device) for v in value)
    return value


def agreeing_classes(table: torch.Tensor, *, exact: bool) -> list[tuple[float, float]]:
    """Per rank, the class of the ranks whose rows agree with its own (the first such rank),
    as the keys fingerprint.judge compares. Exact: the fingerprints are equal. Otherwise: every
    statistic within SPOT_RTOL of the other's (relative to the larger magnitude)."""
    classes: list[int] = []
    for i in range(table.shape[0]):
        for j in range(i):
            if classes[j] == j and _agree(table[i], table[j], exact=exact):
                classes.append(j)
                break
        else:
            classes.append(i)
    return [(float(c), 0.0) for c in classes]


def _agree(a: torch.Tensor, b: torch.Tensor, *, exact: bool) -> bool:
    if exact:
        return bool((a[:2] == b[:2]).all())
    x, y = a[_FIXED:], b[_FIXED:]
    return bool(((x - y).abs() <= SPOT_RTOL * torch.maximum(x.abs(), y.abs())).all())


def spot_check_error(verdict: _fingerprint.Verdict, *, since: int, replicas: int) -> SilentCorruptionError:
    if verdict.named:
        who = f"rank(s) {list(verdict.named)} differ from the majority of the {replicas} replicas"
    else:
        who = f"rank(s) {list(verdict.suspects)} disagree with no majority among {replicas} replicas: each is a suspect"
    return SilentCorruptionError(
        f"silent data corruption in compute at step {verdict.step}: the spot check's gradients of one shared "
        f"micro-batch disagree ({who}). The corruption may have reached the model at any step since the last "
        f"passed check: the run goes back to a state from before step {since}", step=verdict.step, since=since,
        ranks=verdict.named, suspects=verdict.suspects)

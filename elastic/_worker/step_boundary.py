"""The step boundary on one rank, for one generation: what happens between two steps.

The loader opens a step (`begin_step`: the step's sample ids and its learning rate); the
context's `report` closes it (`end_step`: the step is counted, every rank's metrics and flags
are shared in one all-gather, and the step's record waits in the outbox for the controller).
The loader sees only this object, through elastic._worker.loader's `LoaderSide` protocol; the user sees
TrainContext, which owns the checkpoint rules around the boundary.

The boundary does not hold the step (issue 18). Step s's all-gather
(elastic._worker.step_exchange) is posted when step s ends and read when step s+1 ends: on a GPU
the host never waits for the device at the step, on a CPU the all-gather runs on gloo's threads
during step s+1's compute (a pending one a generation lets go cannot hang its teardown: see
step_exchange). The group decides on it one step late, one logic for both backends:
- Leaving together. A rank's stop and preemption flags of step s are acted on at the end of step
  s+1, on every rank, whatever it knew earlier: every rank collects the same exchange, so every
  rank leaves at the same step s+1. Only the group's decisions count; a rank never acts on its
  own flag (a flag set between two exchanges would otherwise split the group). With one rank
  there is no one to agree with: it acts on its own flags at once.
- Rescale: the controller's stop request is honoured one step later than a blocking exchange
  would; the state the group leaves with is still one state, the same step on every rank.
- Preemption: the notice is seen one step later; the group leaves at that step, committing it
  first only when the ranks that stay would not hold the whole state (TrainContext.report): the
  exchange carries how many ranks got a notice, and whether `elastic stop` asked for a commit.
- Records: step s's record (the mean loss and metrics, every rank's compute time) is written
  when its exchange is collected, in step order, and never lost: the exchange is collected early
  wherever someone needs step s settled (its checkpoint, so a non-finite loss is still never
  committed; `ctx.log`, whose record comes after its step's; leaving the loop; the end of the
  run; the generation's first step, which ends a recovery and is announced at once), and a
  broken group or a failing loop leaves the pending records with this rank's own values
  (`abandon`), as a failed blocking exchange did.
- A non-finite loss is found when its exchange is collected: the error names step s and every
  rank raises it at the same point (the same exchange, collected at the same step).
- Silent corruption likewise (FailureConfig.sdc_check): the exchange carries each rank's
  fingerprint of its parameters before the step's update (and after it at the steps whose state
  is kept: elastic._worker.fingerprint), and when the replicas of a shard disagree every rank
  raises the same SilentCorruptionError, naming the step, the ranks and the first step that may
  be corrupt, where the exchange is collected: at the next step's end, or before a checkpoint or
  an in-memory copy of the step, which is so never taken from a step whose replicas disagreed.
"""
from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from elastic._determinism import mix_seed
from elastic._protocol import COMPUTE_TIMES_PER_LINE, GenerationPlan, RunSpec, StepRecord
from elastic._worker import fingerprint as _fingerprint
from elastic._worker import step_exchange, thread_position
from elastic._worker.accumulation import Accumulation, as_float, new_accumulation
from elastic._worker.lr import ScaleRamp, rule_lr
from elastic._worker.state import WorkerState
from elastic._worker.step_timer import StepTimer
from elastic.errors import NonFiniteLossError, SilentCorruptionError, StateError
from elastic.layout import Layout

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("elastic.worker")

MAX_METRICS = 32   # numeric report() keywords besides loss: fixed slots of the per-step all-gather
# metrics.jsonl's own keys: a report() keyword may not take their place (loss and lr may be given).
RESERVED_METRICS = frozenset({"step", "world_size", "time", "global_batch", "accum_steps", "samples_seen",
                              "kind", "generation"})
# loss, stop flag, preemption flag, compute seconds, hash of the metric names, the parameters'
# fingerprint after the step's update and before it (each as its low and high 32 bits:
# elastic._worker.fingerprint; 0 where not taken)
_HEADER = 9
_FINGERPRINTS = slice(5, 9)
_AFTER_UPDATE = slice(5, 7)
_BEFORE_UPDATE = slice(7, 9)
_COMMIT = 2.0      # the preemption flag's value when the rank's leave asks for a commit (`elastic stop`)


class StepOutcome(NamedTuple):
    """What the group decided at a step's all-gather: leave the loop (a rescale, or ranks that
    got a preemption notice), and whether the state must be committed first."""

    stop: bool
    preempted: int          # ranks of the group with a preemption notice (they leave)
    commit: bool            # `elastic stop`: the group commits the step before it leaves

    @classmethod
    def of(cls, flags: torch.Tensor) -> StepOutcome:
        """From the exchange's per-rank stop and preemption slots (a preemption slot is
        _COMMIT when that rank's leave asks for a commit)."""
        return cls(stop=bool(flags[:, 0].max() > 0), preempted=int((flags[:, 1] > 0).sum()),
                   commit=bool(flags[:, 1].max() >= _COMMIT))

    def merged(self, later: StepOutcome) -> StepOutcome:
        """Two steps' decisions acted on at once (a notice's flag stays set: the later knows more)."""
        return StepOutcome(self.stop or later.stop, max(self.preempted, later.preempted), self.commit or later.commit)


class StepBoundary:
    """One generation's step accounting on one rank."""

    def __init__(self, *, plan: GenerationPlan, spec: RunSpec, worker: WorkerState, device: torch.device,
                 layout: Layout, stop_requested: threading.Event, preempted: threading.Event,
                 commit_requested: threading.Event | None = None):
        self._plan, self._spec, self._worker = plan, spec, worker
        self.device = device
        self._comm_device = device if spec.scaling.use_gpu else torch.device("cpu")
        self._stop_requested, self._preempted = stop_requested, preempted
        self._commit_requested = commit_requested if commit_requested is not None else threading.Event()
        self.layout = layout
        # The generation's fixed values the loader reads (LoaderSide), as plain attributes.
        self.rank, self.world_size = plan.rank, plan.world_size
        self.dp_rank, self.dp_size = layout.dp_rank(plan.rank), layout.dp
        self.total_steps, self.seed = spec.total_steps, spec.seed
        self.accumulation: Accumulation | None = new_accumulation(spec.lr, self.layout.dp)
        self.timer = StepTimer()
        self.sync_model: nn.Module | None = None    # first prepared model: accumulation toggles its gradient sync
        self.lr_optimizer: torch.optim.Optimizer | None = None   # the first prepared: the LR rule acts on it
        self.group_ratios: list[float] = []         # its groups' LR ratios to its first group
        self._global_batch = 0
        self._step_ids: list[int] = []               # sample ids the whole group reads at this step
        self._first_step_announced = False
        self._pending: deque[tuple[_Step, step_exchange.PendingExchange]] = deque()   # posted, not collected
        self._decisions: dict[int, StepOutcome] = {}   # collected exchanges' flags, by step, not yet acted on
        self._steps_ended = 0                          # steps this generation has ended
        # Seconds spent outside the steps that this rank's next record carries (the run's time
        # ledger): in ctx.restore (the generation's first record), blocked in checkpoint saves.
        self.restore_s = 0.0
        self.checkpoint_stall_s = 0.0
        # Silent corruption: the tensors whose fingerprint each step carries (set by ctx.restore)
        # and the units whose same positions must agree (None: nothing is compared).
        self.fingerprinted: Callable[[], Iterable[torch.Tensor]] | None = None
        self.replica_unit: int | None = None
        self.clean_through = 0          # the newest step whose state every replica held alike (ctx.restore sets it)
        self._before_update: torch.Tensor | None = None   # this step's fingerprint before its update

    def before_update(self) -> None:
        """The first prepared optimizer is about to apply this step's update (its step pre-hook):
        fingerprint the parameters as the step's forward and backward used them."""
        if self.checks_fingerprints:
            assert self.fingerprinted is not None
            self._before_update = _fingerprint.fingerprint(self.fingerprinted())

    def _after_update_due(self, step: int) -> bool:
        """Whether step `step`'s exchange carries the fingerprint after its update too: at the
        steps whose state is kept (a checkpoint, a copy in memory, the final one), so that what
        is kept is what the replicas agreed on."""
        return self._spec.keeps_state_at(step)

    @property
    def checks_fingerprints(self) -> bool:
        """Whether the steps' fingerprints are compared (FailureConfig.sdc_check, with replicas)."""
        return (self.fingerprinted is not None and self.replica_unit is not None
                and self.world_size // self.replica_unit >= 2)

    # ---- what the loader reads (elastic._worker.loader.LoaderSide) ---------------------------
    @property
    def step(self) -> int:
        return self._worker.progress.step

    @property
    def samples_seen(self) -> int:
        return self._worker.progress.samples_seen

    @property
    def accum_steps(self) -> int:
        return self.accumulation.steps if self.accumulation is not None else 1

    def begin_step(self, global_batch: int, sample_ids: list[int]) -> None:
        """The loader is about to yield a step's batch of the group's `sample_ids`."""
        self._global_batch = global_batch
        self._step_ids = sample_ids
        self._worker.progress.pending_samples = global_batch
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Set this step's LR from the rule: a function of the step and the history of the
        data-parallel degree (the world size without tensor parallelism)."""
        rule, progress = self._spec.lr, self._worker.progress
        if rule is None or self.lr_optimizer is None or progress.base_lr is None or not self.group_ratios:
            return
        step = progress.step
        ramp = progress.lr_ramp or ScaleRamp.initial(self.dp_size, rule.base_world_size)
        progress.lr_ramp = ramp.rescaled(step, self.dp_size, rule.base_world_size, rule.rescale_warmup_steps)
        lr = rule_lr(rule, base_lr=progress.base_lr, ramp=progress.lr_ramp, step=step, total_steps=self.total_steps)
        # A group added after prepare_optimizer() has no ratio: it keeps the LR it was given.
        for group, ratio in zip(self.lr_optimizer.param_groups, self.group_ratios, strict=False):
            group["lr"] = lr * ratio

    # ---- what report() and log() do --------------------------------------------------
    def end_step(self, metrics: dict[str, Any]) -> StepOutcome | None:
        """Count the step, post its exchange, collect the previous step's, keep the records.
        Returns the group's decision; None: a non-final micro-batch (gradient accumulation),
        which only notes its loss."""
        accumulation = self.accumulation
        if accumulation is not None and accumulation.defer_report(metrics.get("loss")):
            return None
        thread_position.mark(thread_position.ThreadPlace.EXCHANGE)   # from here it waits for the others (hang_watch)
        names, values = report_values(metrics, skip=frozenset({"loss", "lr"}))
        progress = self._worker.progress
        # The optimizer step has run: the in-memory state is now the state after this step.
        progress.step += 1
        progress.samples_seen += progress.pending_samples
        progress.pending_samples = 0
        # The step's samples count as consumed with the step itself, before any collective: if
        # one fails, the state that survives has this step, so its hash must have its samples.
        if self._step_ids:
            progress.data_order.extend(self._step_ids)
            self._step_ids = []
        lr = as_float(metrics["lr"]) if "lr" in metrics else \
            (self.lr_optimizer.param_groups[0]["lr"] if self.lr_optimizer is not None else None)
        loss = metrics.get("loss")
        stop, leave = self._flags()
        # Fixed size (MAX_METRICS slots), whatever the names: ranks that disagree are caught by
        # the names' hash. Tensor values stay on their device until the exchange is collected.
        host = [0.0] * (_HEADER + MAX_METRICS)
        host[1:_FINGERPRINTS.start] = [float(stop), leave, self.timer.compute_s(),
                                      float(mix_seed("metrics", names) & ((1 << 52) - 1))]
        on_device: dict[int, torch.Tensor] = {}
        before, self._before_update = self._before_update, None
        if self.checks_fingerprints:
            assert self.fingerprinted is not None
            # Before the update (the optimizer's pre-hook took it): what this step's forward and
            # backward used. After it: at the steps whose state is kept, and wherever no prepared
            # optimizer took the one before (every rank alike: the same code path).
            after = _fingerprint.fingerprint(self.fingerprinted()) \
                if before is None or self._after_update_due(progress.step) else None
            for where, folded in ((_AFTER_UPDATE, after), (_BEFORE_UPDATE, before)):
                if folded is not None:
                    on_device.update(zip(range(where.start, where.stop), _fingerprint.halves(folded), strict=True))
        loss_value: float | torch.Tensor = accumulation.mean_loss() if accumulation is not None else \
            (loss if isinstance(loss, torch.Tensor) else as_float(loss) or 0.0)
        for slot, value in ((0, loss_value), *((_HEADER + i, v) for i, v in enumerate(values))):
            if isinstance(value, torch.Tensor):
                on_device[slot] = value
            else:
                host[slot] = value
        step = _Step(step=progress.step, time=time.time(), samples_seen=progress.samples_seen,
                     global_batch=self._global_batch, data_order=progress.data_order.hexdigest(), lr=lr, names=names,
                     has_loss=loss is not None, accum_steps=self.accum_steps)
        try:
            pending = step_exchange.post(host, on_device, device=self._comm_device, world_size=self.world_size)
        except BaseException:
            # The update is applied: this state may be the one the group restores (warm), so
            # every step it holds keeps a record, with this rank's own values.
            self.abandon()
            self._keep_record(step, _own_table(host, on_device), check=False)
            raise
        self._pending.append((step, pending))
        self._steps_ended += 1
        # Read when the next step ends (step_exchange), so no step waits for the others at its
        # own end, except the generation's first: its record ends a recovery, announced at once.
        self.settle(before=progress.step if self._steps_ended > 1 else None)
        thread_position.mark(thread_position.ThreadPlace.BOUNDARY)   # the exchange is over: its own work now
        decided = [flags for at, flags in self._decisions.items() if at < progress.step]
        self._decisions = {at: flags for at, flags in self._decisions.items() if at >= progress.step}
        if self.world_size == 1:
            return StepOutcome(stop=bool(stop), preempted=int(leave > 0), commit=leave >= _COMMIT)
        return functools.reduce(StepOutcome.merged, decided, StepOutcome(stop=False, preempted=0, commit=False))

    def _flags(self) -> tuple[float, float]:
        """This rank's stop flag, and its preemption flag (_COMMIT when its leave asks for a commit)."""
        preempted = self._preempted.is_set()
        return float(self._stop_requested.is_set()), \
            (_COMMIT if self._commit_requested.is_set() else 1.0) if preempted else 0.0

    def recount(self, outcome: StepOutcome) -> StepOutcome:
        """Collective, at the step the group leaves from (every rank leaves at it): the flags as
        they are now. The decision to leave was taken on a step's exchange; a notice that reached
        another rank since is counted too, so the group knows how many of its ranks go (whether
        what stays holds the state) from notices up to this step, not one step older."""
        if self.world_size == 1:
            return outcome
        now = step_exchange.post(list(self._flags()), {}, device=self._comm_device, world_size=self.world_size)
        return outcome.merged(StepOutcome.of(now.collect()))

    def settle(self, before: int | None = None) -> None:
        """Collect the pending exchanges (of the steps before `before`; None: all) and keep
        their records. Raises what a collective raises (the pending records are then kept
        with this rank's own values) and NonFiniteLossError / StateError like report()."""
        while self._pending and (before is None or self._pending[0][0].step < before):
            step, pending = self._pending[0]
            try:
                shared = pending.collect()
            except BaseException:
                self.abandon()
                raise
            self._pending.popleft()
            thread_position.exchanged(step.step)   # every rank entered this step's exchange (hang_watch)
            self._decisions[step.step] = StepOutcome.of(shared[:, 1:3])
            self._keep_record(step, shared)

    def abandon(self) -> NonFiniteLossError | None:
        """The group broke or the loop failed: keep every pending step's record now, without
        waiting, with the group's values where the exchange completed, else this rank's own.

        A pending step's loss is still checked (a non-finite own loss makes the mean non-finite),
        but nothing is raised here: the error of the first such step is returned, for the worker
        to report in place of the broken group's, so that the run fails with it (under
        on_nonfinite_loss="fail") instead of a re-form restoring and committing that step."""
        found: NonFiniteLossError | None = None
        while self._pending:
            step, pending = self._pending.popleft()
            table = None
            if pending.completed():
                try:
                    table = pending.collect()
                except BaseException:   # noqa: BLE001 - the group broke: this rank's values below
                    table = None
            try:
                mean_loss = self._keep_record(step, table if table is not None else pending.own_values(), check=False)
            except Exception:   # a dead device cannot give its values; the step goes unrecorded
                log.warning("no record of step %d: this rank's values could not be read", step.step, exc_info=True)
                continue
            # Under "ignore" the step is left unflagged, as before: only the ranks whose own row
            # shows it would know, and a rank that alone skipped a save's collective would hang
            # the others in it.
            if (found is None and self._spec.failure.on_nonfinite_loss == "fail" and mean_loss is not None
                    and not math.isfinite(mean_loss)):
                self._worker.checkpoints.nonfinite_step = step.step
                found = _nonfinite_error(step.step, mean_loss, table.shape[0] if table is not None else 1)
        return found

    def log(self, metrics: dict[str, Any]) -> None:
        """Metrics at the current step, counting no step: this rank's record only, after the
        record of its step (the step's exchange is collected first)."""
        names, values = numeric_metrics(metrics, reserved=RESERVED_METRICS | {"loss", "lr"})
        self.settle()
        progress = self._worker.progress
        self._worker.outbox.put(StepRecord(
            step=progress.step, loss=None, world_size=self.world_size, time=time.time(),
            samples_seen=progress.samples_seen, global_batch=self._global_batch,
            metrics=dict(zip(names, values, strict=True)), generation=self._plan.generation, kind="log"))

    def _judge_fingerprints(self, shared: torch.Tensor, step: int) -> tuple[_fingerprint.Verdict | None, int]:
        """The verdict on step `step`'s two fingerprints (elastic._worker.fingerprint.judge_step),
        and the first step that may be corrupt; keeps the newest step known clean."""
        assert self.replica_unit is not None
        rows = shared[:, _FINGERPRINTS].tolist()
        verdict, self.clean_through = _fingerprint.judge_step(
            after=[tuple(r[:2]) for r in rows], before=[tuple(r[2:]) for r in rows], unit=self.replica_unit,
            step=step, clean_through=self.clean_through)
        return verdict, self.clean_through + 1

    def verify_leaving_state(self) -> None:
        """Collective, at the step the group leaves from (its exchange may carry no fingerprint
        after the update): the replicas compare their state now, the one the group keeps, commits
        or hands to the next generation; SilentCorruptionError when they disagree."""
        self.settle()           # this step's own verdict first (before its update)
        if not self.checks_fingerprints or self.world_size == 1:
            return
        assert self.fingerprinted is not None
        folded = _fingerprint.fingerprint(self.fingerprinted())
        row = {} if folded is None else dict(zip(range(_AFTER_UPDATE.start, _AFTER_UPDATE.stop),
                                                 _fingerprint.halves(folded), strict=True))
        table = step_exchange.post([0.0] * _HEADER, row, device=self._comm_device, world_size=self.world_size).collect()
        verdict, since = self._judge_fingerprints(table, self.step)
        if verdict is not None:
            raise _corruption_error(verdict, self.replica_unit or 1, self.world_size, since)

    def _keep_record(self, step: _Step, shared: torch.Tensor, *, check: bool = True) -> float | None:
        """The record of `step` from its exchange's table (one row per rank that answered); its
        mean loss (None: no loss reported)."""
        names, ranks = step.names, shared.shape[0]
        verdict, since = None, step.step
        if check and ranks == self.world_size and self.checks_fingerprints:
            verdict, since = self._judge_fingerprints(shared, step.step)
        if check and bool((shared[:, 4] != shared[0, 4]).any()):
            raise StateError(f"ctx.report() at step {step.step}: the ranks reported different metric names "
                             f"(rank {self.rank}: {list(names)}); report the same names on every rank, and "
                             f"rank-local values through ctx.log()")
        # Means over the data-parallel replicas: one row per replica (TP rank 0 of its last stage:
        # the ranks of a stage compute the same loss, and only a pipeline's last stage has it),
        # so no replica weighs twice and no earlier stage's placeholder counts.
        rows = shared[self.layout.metric_ranks()] if ranks == self.world_size else shared
        means = rows[:, _HEADER:_HEADER + len(names)].mean(dim=0).tolist()
        metrics = dict(zip(names, means, strict=True))
        if step.lr is not None:
            metrics["lr"] = step.lr
        mean_loss = float(rows[:, 0].sum()) / rows.shape[0] if step.has_loss else None
        # Every rank keeps the record (same all-gathered values): if rank 0 dies before the
        # controller polls it, a survivor still has the step. The per-rank compute times ride on
        # every rank's up to COMPUTE_TIMES_PER_LINE ranks, so the step's metrics line has them
        # whichever record the controller takes first (with rank 0's alone, a healthy 2-rank
        # run's lines lacked them on about half the steps); above, on rank 0's only (N² floats a
        # step otherwise). The intake scores a step's times from whichever record carries them.
        carries = ranks > 1 and (self.rank == 0 or ranks <= COMPUTE_TIMES_PER_LINE)
        # One read of the column, not a float() per rank (part of the exchange's 23 ms a step at
        # 10,000 ranks: step_exchange); rounded for metrics.jsonl where its line is written.
        compute_s = tuple(shared[:, 3].tolist()) if carries else ()
        stall_s, self.checkpoint_stall_s = self.checkpoint_stall_s, 0.0
        self._worker.outbox.put(StepRecord(
            step=step.step, loss=mean_loss, world_size=self.world_size, time=step.time,
            samples_seen=step.samples_seen, global_batch=step.global_batch, metrics=metrics,
            compute_s=compute_s, data_order=step.data_order, generation=self._plan.generation,
            accum_steps=step.accum_steps, checkpoint_stall_s=round(stall_s, 6),
            restore_s=0.0 if self._first_step_announced else round(self.restore_s, 6)))
        if not self._first_step_announced:
            # The generation's first step ends a recovery: the controller hears it at once,
            # not when the held poll would have come back anyway.
            self._first_step_announced = True
            self._worker.outbox.news.set()
        if verdict is not None:
            # Every rank raises the same error (the fingerprints are all-gathered).
            raise _corruption_error(verdict, self.replica_unit or 1, self.world_size, since)
        if check and mean_loss is not None and not math.isfinite(mean_loss):
            self._worker.checkpoints.nonfinite_step = step.step
            if self._spec.failure.on_nonfinite_loss == "fail":
                # Every rank raises the same error (the values are all-gathered).
                raise _nonfinite_error(step.step, mean_loss, ranks)
        return mean_loss


def _nonfinite_error(step: int, mean_loss: float, ranks: int) -> NonFiniteLossError:
    return NonFiniteLossError(
        f"the loss of step {step} is {mean_loss} (mean over {ranks} rank(s)); no checkpoint was committed "
        f"from it. Lower the learning rate, clip gradients or check the data; "
        f"FailureConfig.on_nonfinite_loss='ignore' trains on")


def _corruption_error(verdict: _fingerprint.Verdict, unit: int, world: int, since: int) -> SilentCorruptionError:
    replicas = world // unit
    if verdict.named:
        who = f"rank(s) {list(verdict.named)} differ from the majority of their {replicas} replicas"
    else:
        who = (f"rank(s) {list(verdict.suspects)} disagree with no majority among {replicas} replicas: each is "
               f"a suspect")
    if verdict.named and verdict.suspects:
        who += f"; rank(s) {list(verdict.suspects)} disagree with no majority"
    return SilentCorruptionError(
        f"silent data corruption at step {verdict.step}: the parameters' fingerprints of the replicas disagree "
        f"({who}). The run goes back to a state from before step {since}; nothing from step {since} on is "
        f"committed", step=verdict.step, since=since, ranks=verdict.named, suspects=verdict.suspects)


class _Step(NamedTuple):
    """What a step's record needs besides its exchange, as it was when the step ended."""

    step: int
    time: float
    samples_seen: int
    global_batch: int
    data_order: str | None
    lr: float | None
    names: tuple[str, ...]
    has_loss: bool
    accum_steps: int


def _own_table(host: list[float], on_device: dict[int, torch.Tensor]) -> torch.Tensor:
    row = torch.tensor(host, dtype=torch.float64)
    for slot, value in on_device.items():
        row[slot] = float(value.detach())
    return row.unsqueeze(0)


def report_values(metrics: dict[str, Any], *, skip: frozenset[str]) -> tuple[tuple[str, ...],
                                                                             list[float | torch.Tensor]]:
    """Like `numeric_metrics`, but one-element tensors are kept as tensors: report() reads them
    only when the step's exchange is collected (on a GPU, never at their step)."""
    names, _ = _numeric_names(metrics, skip=skip, reserved=RESERVED_METRICS)
    return names, [_scalar(metrics[n]) for n in names]


def _scalar(value: Any) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(())
    return float(value)


def numeric_metrics(metrics: dict[str, Any], *, skip: frozenset[str] = frozenset(),
                    reserved: frozenset[str] = RESERVED_METRICS) -> tuple[tuple[str, ...], list[float]]:
    """The numeric keywords (numbers, one-element tensors) by sorted name, and their values;
    `skip`: names handled apart (report's loss and lr); `reserved`: names refused."""
    names, _ = _numeric_names(metrics, skip=skip, reserved=reserved)
    return names, [float(as_float(metrics[n]) or 0.0) for n in names]


def _numeric_names(metrics: dict[str, Any], *, skip: frozenset[str],
                   reserved: frozenset[str]) -> tuple[tuple[str, ...], None]:
    clash = sorted(set(metrics) & reserved)
    if clash:
        raise StateError(f"metric names {clash} are metrics.jsonl's own; rename them")
    names: list[str] = []
    for name, value in metrics.items():
        if name in skip or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            names.append(name)
        elif isinstance(value, torch.Tensor):
            raise StateError(f"metric {name!r} is a tensor of {value.numel()} elements; report a number or a "
                             f"one-element tensor")
    names.sort()
    if len(names) > MAX_METRICS:
        raise StateError(f"{len(names)} metrics in one call; at most {MAX_METRICS} besides loss and lr "
                         f"(split them over report() and ctx.log())")
    return tuple(names), None

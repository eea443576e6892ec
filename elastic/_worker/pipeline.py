"""Pipeline parallelism: the user's whole model split into stages, a schedule, and its step.

The user hands `ctx.prepare_pipeline` the whole model and where to split it, as torchtitan's
pipelining splits by module names. The model's *units* are its root's children in registration
order, with every ModuleList and ModuleDict opened into its entries ("tok", "pos", "blocks.0",
..., "ln_f", "head"); `split_points` names the unit each stage after the first begins with, so
registration order must be the order of the forward. A stage is the model with the other units
removed: a removed child becomes None (the model's forward skips a None child, as torchtitan's
models do: `h = self.tok(x) if self.tok is not None else x`), and a ModuleList keeps its kept
entries under their original indices (`StageModuleList`). So every parameter keeps its name in
the whole model, and a checkpoint saved with P stages loads with any other P, or none.

Stages are laid out as torch's schedules expect: with one stage per rank (GPipe, 1F1B) stage s
runs on pipeline rank s; under an interleaved schedule each rank runs V stages, rank p stages
p, p + P, ..., p + (V - 1) P. Each stage gets the user's TP plan on its stage's TP ranks, then
the data-parallel wrap (FSDP2 replicate or fully_shard over the replicas), exactly as a whole
model would under tensor parallelism (elastic._worker.wrap.wrap_tensor_parallel); torch's
schedules know both (`PipelineStage.backward_maybe_with_nosync`, `perform_reduce_grad`).

Gradients: torch's schedules divide the gradients by the micro-batch count at the end of each
step (`scale_grads`), which would divide again what an earlier step of a gradient accumulation
(LRScalingConfig "constant_global_batch") left there. So the loss of each micro-batch is divided
by the count instead and `scale_grads` is off: the gradients are the mean over the batch either
way, and they add up across accumulated micro-steps like any other loop's.

Hangs: a stage that waits on a dead or stuck neighbour waits in a send/recv inside the schedule,
and its data-parallel peers wait in the stage's gradient reduce. Both are marked as waiting places
for the controller's hang judge (elastic._worker.thread_position: PIPELINE and SYNC), so such a
hang is found within the learned hang bound, not by the heartbeat. torch's schedules wait on every
send/recv through one module function (`schedules._wait_batch_p2p`), which `mark_pipeline_waits`
wraps once per process; it marks nothing outside a worker's training thread.
"""
from __future__ import annotations

import copy
import enum
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from elastic._protocol import ThreadPlace
from elastic._worker import thread_position
from elastic.errors import ConfigError

if TYPE_CHECKING:
    from elastic._worker.mesh import GenerationMesh

logger = logging.getLogger(__name__)


class PipelineSchedule(enum.StrEnum):
    """The schedules `ctx.prepare_pipeline` builds, by torch's classes."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved1f1b"

    @property
    def interleaved(self) -> bool:
        return self is PipelineSchedule.INTERLEAVED_1F1B

    def torch_class(self) -> Any:
        from torch.distributed.pipelining import schedules
        return {PipelineSchedule.GPIPE: schedules.ScheduleGPipe,
                PipelineSchedule.ONE_F_ONE_B: schedules.Schedule1F1B,
                PipelineSchedule.INTERLEAVED_1F1B: schedules.ScheduleInterleaved1F1B}[self]


def parse_schedule(name: Any) -> PipelineSchedule:
    try:
        return PipelineSchedule(str(name).lower())
    except ValueError:
        raise ConfigError(f"pipeline schedule {name!r} is not one of {[s.value for s in PipelineSchedule]}") from None


class StageModuleList(nn.ModuleList):
    """The entries of a ModuleList that one stage keeps, under their indices in the whole list
    (so their parameters keep their names). Iterates, and has a length, as the kept list;
    `stage_list[i]` is entry i of the whole list, when this stage has it."""

    def __init__(self, entries: dict[str, nn.Module]):
        super().__init__()
        for key, module in entries.items():
            self.add_module(key, module)

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            raise TypeError("a pipeline stage's ModuleList holds only its own entries: iterate it instead of slicing")
        key = str(idx)
        if key not in self._modules:
            raise IndexError(f"entry {idx} of this ModuleList is in another pipeline stage (this stage holds "
                             f"{list(self._modules)})")
        return self._modules[key]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(m for m in self._modules.values() if m is not None)


def units(model: nn.Module) -> list[str]:
    """The model's units in order: its root's children, ModuleLists and ModuleDicts opened."""
    names = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            names += [f"{name}.{key}" for key in child._modules]
        else:
            names.append(name)
    return names


def split_units(model: nn.Module, split_points: list[str], stages: int) -> list[list[str]]:
    """The units of each of `stages` stages: `split_points` names the first unit of every stage
    but the first, in order. Refuses, naming the fix, what does not split the model that way."""
    if any(True for _ in model.parameters(recurse=False)):
        raise ConfigError(f"{type(model).__name__} holds parameters on its root module "
                          f"({[n for n, _ in model.named_parameters(recurse=False)]}): a pipeline splits a model by "
                          f"its child modules; move them into a submodule")
    order = units(model)
    if len(split_points) != stages - 1:
        raise ConfigError(f"split_points names {len(split_points)} stage starts for {stages} stages "
                          f"(pipeline_parallel_size x stages per rank); name {stages - 1}, from the model's units "
                          f"{order}")
    unknown = [p for p in split_points if p not in order]
    if unknown:
        raise ConfigError(f"split_points {unknown} are not units of {type(model).__name__}: its units, in forward "
                          f"order, are {order}")
    starts = [order.index(p) for p in split_points]
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise ConfigError(f"split_points {split_points} must name distinct units after the first, in the model's "
                          f"order {order}: every stage needs at least one unit")
    bounds = [0, *starts, len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def build_stage(model: nn.Module, keep: list[str]) -> nn.Module:
    """`model` with only the units in `keep`: a shallow copy of the root (the kept children are
    the model's own objects, each in one stage), other children None."""
    stage = copy.copy(model)
    # The copy's own registries (children, parameters, buffers, hooks): a shallow copy shares the
    # model's, and a wrapper's hooks on one stage (FSDP2's on its root) must not run on another.
    for key, value in list(stage.__dict__.items()):
        if isinstance(value, dict | set):
            stage.__dict__[key] = copy.copy(value)
    stage._modules = {}
    wanted = set(keep)
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            kept = {key: m for key, m in child._modules.items() if f"{name}.{key}" in wanted and m is not None}
            if not kept:
                stage._modules[name] = None
            elif isinstance(child, nn.ModuleList):
                stage._modules[name] = StageModuleList(kept)
            else:
                stage._modules[name] = nn.ModuleDict(kept)
        else:
            stage._modules[name] = child if name in wanted else None
    return stage


def _merged(stages: list[nn.Module]) -> dict[str, nn.Module | None]:
    """One rank's stages as one set of children, under the whole model's names (an interleaved
    rank's stages hold disjoint units)."""
    merged: dict[str, nn.Module | None] = {}
    for name in stages[0]._modules:
        held = [m for s in stages if (m := s._modules.get(name)) is not None]
        if not held:
            merged[name] = None
        elif len(held) == 1:
            merged[name] = held[0]
        else:
            entries = {k: m for h in held for k, m in h._modules.items() if m is not None}
            merged[name] = StageModuleList(entries) if isinstance(held[0], StageModuleList) else nn.ModuleDict(entries)
    return merged


class Pipeline(nn.Module):
    """This rank's part of the model (its stages' parameters, under the whole model's names:
    hand it to the optimizer and to `ctx.restore`) and the schedule that trains it.

    `step(inputs, targets)` runs one batch through the pipeline, forward and backward over its
    micro-batches, and returns the batch's mean loss on every stage's ranks (the last stage's,
    shared; a pipeline's metrics are still taken from its last stage, see Layout.metric_ranks).
    Without pipeline parallelism (P = 1) it is the whole prepared model's forward and backward,
    so one loop serves every P."""

    def __init__(self, stages: list[nn.Module], *, run: Callable[[Any, Any], torch.Tensor],
                 first: bool, last: bool, microbatches: int):
        super().__init__()
        for name, child in _merged(stages).items():
            self._modules[name] = child
        # Plain attributes, not submodules: the parameters are registered once, by name, above.
        self.__dict__["stage_modules"] = stages
        self.__dict__["_run"] = run
        self.is_first, self.is_last, self.microbatches = first, last, microbatches

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a Pipeline runs its stages through its schedule: call pipeline.step(inputs, targets), "
                        "which runs forward and backward over the micro-batches")

    def step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Forward and backward of one batch (every rank of a replica passes the same batch)."""
        rows = inputs.shape[0] if isinstance(inputs, torch.Tensor) else None
        if rows is not None and rows % self.microbatches:
            raise ConfigError(f"a batch of {rows} samples does not split into microbatches={self.microbatches}: use "
                              f"a per-rank batch size that is a multiple of it")
        return self.__dict__["_run"](inputs, targets)


def mark_pipeline_waits() -> bool:
    """Wrap torch's send/recv wait so that a stage's waits are marked PIPELINE (see the module
    docstring); idempotent. False when this torch has no such function: hangs inside the schedule
    are then found by the heartbeat and the collective timeout only."""
    from torch.distributed.pipelining import schedules
    original = getattr(schedules, "_wait_batch_p2p", None)
    if original is None:
        logger.warning("torch.distributed.pipelining.schedules has no _wait_batch_p2p in torch %s: a hang inside a "
                       "pipeline schedule is found by the heartbeat, not within the hang bound", torch.__version__)
        return False
    if getattr(original, "marks_pipeline_waits", False):
        return True

    def wait_batch_p2p(work: Any) -> None:
        with thread_position.waiting(ThreadPlace.PIPELINE):
            original(work)

    wait_batch_p2p.marks_pipeline_waits = True    # type: ignore[attr-defined]
    schedules._wait_batch_p2p = wait_batch_p2p
    return True


def _mark_reduce(stage: Any) -> None:
    """The stage's data-parallel gradient reduce waits for the same stage of the other replicas."""
    reduce = stage.perform_reduce_grad

    def perform_reduce_grad(grad_scale_factor: int) -> None:
        with thread_position.waiting(ThreadPlace.SYNC):
            reduce(grad_scale_factor)

    stage.perform_reduce_grad = perform_reduce_grad


def build_pipeline(model: nn.Module, *, mesh: GenerationMesh, device: torch.device, split_points: list[str],
                   loss_fn: Callable[[Any, Any], torch.Tensor], microbatches: int, schedule: Any,
                   stages_per_rank: int | None, wrap: Callable[[nn.Module], nn.Module],
                   autocast: Callable[[], Any]) -> Pipeline:
    """This rank's stages of `model` wrapped by `wrap` (the TP plan and the data-parallel wrap),
    with their schedule over the mesh's "pp" dimension."""
    from torch.distributed.pipelining import PipelineStage
    kind = parse_schedule(schedule)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches must be an int >= 1, got {microbatches!r}")
    per_rank = stages_per_rank if stages_per_rank is not None else (2 if kind.interleaved else 1)
    if not kind.interleaved and per_rank != 1:
        raise ConfigError(f"schedule {kind.value!r} runs one stage per rank; stages_per_rank={per_rank} needs "
                          f"schedule='interleaved1f1b'")
    if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 1:
        raise ConfigError(f"stages_per_rank must be an int >= 1, got {per_rank!r}")
    pp, rank = mesh.layout.pp, mesh.pp_rank
    if kind is PipelineSchedule.ONE_F_ONE_B and microbatches < pp:
        raise ConfigError(f"schedule '1f1b' needs at least as many microbatches as stages: microbatches="
                          f"{microbatches} < pipeline_parallel_size={pp}")
    n_stages = pp * per_rank
    plan = split_units(model, list(split_points), n_stages)
    model = model.to(device)
    indices = [rank + k * pp for k in range(per_rank)]
    stages = [wrap(build_stage(model, plan[i])) for i in indices]
    group = mesh.pp_group()
    torch_stages = [PipelineStage(s, i, n_stages, device, group=group) for s, i in zip(stages, indices, strict=True)]
    mark_pipeline_waits()
    for torch_stage in torch_stages:
        _mark_reduce(torch_stage)

    def scaled_loss(output: Any, target: Any) -> torch.Tensor:
        return loss_fn(output, target) / microbatches

    cls = kind.torch_class()
    try:
        runner = cls(torch_stages if kind.interleaved else torch_stages[0], microbatches, loss_fn=scaled_loss,
                     scale_grads=False)
    except ValueError as error:      # torch's own checks of the counts (stages, micro-batches)
        raise ConfigError(f"pipeline schedule {kind.value!r} with {pp} ranks x {per_rank} stages and microbatches="
                          f"{microbatches}: {error}") from error
    first, last = rank == 0, rank == pp - 1

    def run(inputs: Any, targets: Any) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        with autocast():
            if first:
                runner.step(inputs, target=targets if last else None, losses=losses if last else None)
            elif last:
                runner.step(target=targets, losses=losses)
            else:
                runner.step()
        loss = torch.stack([x.detach() for x in losses]).sum() if losses else torch.zeros((), device=device)
        # The pipeline agrees that every stage finished its step (the schedule ends with each
        # stage's data-parallel gradient reduce) before any stage applies it, and every stage
        # gets the loss. Without it, a rank lost in stage 0's backward left stage 1's ranks a
        # step ahead (their reduce, within stage 1, had completed): no step was held by every
        # place of a pipeline, and the recovery fell back to the checkpoint (the mixed-pp chaos
        # campaign). Now a pipeline steps whole or not at all.
        thread_position.mark(ThreadPlace.SYNC)      # waits for the other stages (hang_watch)
        dist.all_reduce(loss, group=group)
        return loss

    return Pipeline(stages, run=run, first=first, last=last, microbatches=microbatches)


def unpipelined(model: nn.Module, wrapped: nn.Module, *, loss_fn: Callable[[Any, Any], torch.Tensor],
                autocast: Callable[[], Any], backward: Callable[[torch.Tensor], None]) -> Pipeline:
    """At P = 1: the prepared whole model (`wrapped`, of `model`) behind the same step."""

    def run(inputs: Any, targets: Any) -> torch.Tensor:
        with autocast():
            loss = loss_fn(wrapped(inputs), targets)
        backward(loss)
        return loss.detach()

    pipeline = Pipeline([model], run=run, first=True, last=True, microbatches=1)
    pipeline.__dict__["stage_modules"] = [wrapped]
    return pipeline

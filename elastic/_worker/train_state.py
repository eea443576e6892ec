"""The one state contract: everything that must survive a rescale or a resume.

`TrainState` holds the framework's own progress (`Progress`: step, samples seen, data order,
the LR rule's ramp) and precision state (the GradScaler), and every object the user hands to
`ctx.restore(model=..., optimizer=..., **more)`, by name. Its `state_dict()` /
`load_state_dict()` are used the same way by the warm broadcast (a survivor's state sent to
every rank) and by checkpoints (saved and loaded through DCP), so what survives one survives the
other. The shape follows torchtitan's `Trainer.state_dict` and torchft's `_manager_state_dict`:
one dict, one key per named part, plus the framework's progress under "extra".

Per kind:
- a module: `get_model_state_dict` / `set_model_state_dict` (DDP's `module.` prefix is never
  seen: the unwrapped module is used; FSDP2 modules stay sharded as DTensors);
- an optimizer: `get_optimizer_state_dict` over all of the state's modules, so its state is keyed
  by parameter names (FQNs), which holds across world sizes and several models;
- anything else with `state_dict()` / `load_state_dict()` (torch's `Stateful`: LR schedulers, a
  GradScaler, an EMA object, a user's counters): its own state dict, replicated on every rank.
"""
from __future__ import annotations

import contextlib
import enum
import json
import keyword
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic._determinism import DataOrder
from elastic._worker.lr import ScaleRamp
from elastic.errors import StateError

if TYPE_CHECKING:
    from torch import nn

EXTRA = "extra"                    # the framework's own key in every state dict
STATE_KINDS = "state_kinds"        # extra[STATE_KINDS]: JSON {name: kind}, read by `elastic export`
# extra[OPTIMIZER_KEYS] == FLAT: the checkpoint's optimizer states are flattened, keyed by
# parameter name down to each param group's values (written under pipeline parallelism: its
# stages hold different parameters, and torch's nested "param_groups.0.params" list would be one
# key written with a different value by each stage, so a load would get another stage's list).
OPTIMIZER_KEYS = "optimizer_keys"
FLAT = "flat"


class StateKind(enum.StrEnum):
    MODULE = "module"
    OPTIMIZER = "optimizer"
    STATEFUL = "stateful"


def kind_of(name: str, obj: Any) -> StateKind:
    import torch
    if isinstance(obj, torch.nn.Module):
        return StateKind.MODULE
    if isinstance(obj, torch.optim.Optimizer):
        return StateKind.OPTIMIZER
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return StateKind.STATEFUL
    raise StateError(f"ctx.restore({name}=...) got a {type(obj).__name__}, which is neither a module, an "
                     f"optimizer nor an object with state_dict() and load_state_dict(); wrap it in one that "
                     f"has them, or keep it out of restore()")


@dataclass
class Progress:
    """The framework's own progress on this rank: plain values, identical on every rank."""

    step: int = 0                          # optimizer steps completed
    samples_seen: int = 0                  # global samples consumed by those steps
    data_order: DataOrder = field(default_factory=DataOrder)   # hash of every consumed sample id, in order
    pending_samples: int = 0               # samples of the step in flight (counted at its report)
    base_lr: float | None = None           # LR rule: LR at base_world_size
    lr_ramp: ScaleRamp | None = None       # LR rule: batch-size scale and its ramp

    def state_dict(self) -> dict[str, Any]:
        chain, tail = self.data_order.state()
        state: dict[str, Any] = {"step": self.step, "samples_seen": self.samples_seen,
                                 "data_order": chain, "data_order_tail": tail}
        if self.lr_ramp is not None:
            state.update(self.lr_ramp.to_state(self.base_lr))
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        # A state saved before the chain advanced by blocks has no tail: its digest goes on as the
        # chain (the run's digest from then on is not the one a run of the old code would give).
        self.data_order = DataOrder(str(state["data_order"]), bytes.fromhex(str(state.get("data_order_tail", ""))))
        self.pending_samples = 0
        if "lr_base" in state:
            self.base_lr, self.lr_ramp = float(state["lr_base"]), ScaleRamp.from_state(state)

    def reset(self) -> None:
        """Back to step 0 (a fresh start), keeping the LR rule's base LR."""
        self.step, self.samples_seen, self.data_order, self.pending_samples = 0, 0, DataOrder(), 0
        self.lr_ramp = None


class TrainState:
    """One generation's state: the framework's progress and the user's named objects.

    Built by `ctx.restore(...)`; the worker keeps the last one as the warm source of the next
    generation (its objects are the previous loop's model, optimizer, ...)."""

    def __init__(self, objects: Mapping[str, Any], *, progress: Progress, precision: Any):
        import torch
        for name in objects:
            if not name.isidentifier() or keyword.iskeyword(name) or name == EXTRA:
                raise StateError(f"ctx.restore: {name!r} cannot name a state (use an identifier other than "
                                 f"{EXTRA!r})")
        self.objects = dict(objects)
        self.kinds = {name: kind_of(name, obj) for name, obj in self.objects.items()}
        self.progress = progress
        self._precision = precision
        # The optimizers' states are keyed by parameter names: over this container, the names are
        # "<module name>.<parameter>", whichever module an optimizer's parameters belong to.
        self._container = torch.nn.ModuleDict(
            {n: o for n, o in self.objects.items() if self.kinds[n] is StateKind.MODULE})

    def modules(self) -> dict[str, nn.Module]:
        return {n: o for n, o in self.objects.items() if self.kinds[n] is StateKind.MODULE}

    def extra(self) -> dict[str, Any]:
        """The framework's part: plain values only (no tensors, no user objects)."""
        kinds = {n: k.value for n, k in self.kinds.items()}
        return {**self.progress.state_dict(), **self._precision.state(), STATE_KINDS: json.dumps(kinds)}

    def state_dict(self, extra: Mapping[str, Any] | None = None, *, legacy: bool = False,
                   flat: bool = False) -> dict[str, Any]:
        """Everything, by name; `extra` adds framework values (world size, per-rank compression).
        `legacy`: optimizer state named as an earlier runtime's checkpoint has it (_optimizer_root);
        `flat`: optimizer states flattened (see OPTIMIZER_KEYS)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        state: dict[str, Any] = {EXTRA: {**self.extra(), **(extra or {})}}
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        for name, obj in self.objects.items():
            kind = self.kinds[name]
            if kind is StateKind.MODULE:
                state[name] = get_model_state_dict(obj)
            elif kind is StateKind.OPTIMIZER:
                with _plain_steps(obj):
                    state[name] = get_optimizer_state_dict(self._optimizer_root(legacy), obj, options=options)
            else:
                state[name] = obj.state_dict()
        return state

    def checkpoint_payload(self, rank_extra: Mapping[str, Any], *, world_size: int, flat: bool = False
                           ) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a checkpoint saves: the objects' state for DCP, and the framework's part as JSON
        for the manifest (checkpoints are data: no pickle of the framework's own). `rank_extra`:
        per-rank values that must stay per rank in DCP (PowerSGD's state); `flat`: optimizer
        states flattened, and the manifest says so (OPTIMIZER_KEYS)."""
        payload = self.state_dict(flat=flat)
        extra = payload.pop(EXTRA)
        if rank_extra:
            payload[EXTRA] = dict(rank_extra)
        if flat:
            extra[OPTIMIZER_KEYS] = FLAT
        return payload, {EXTRA: {**extra, "world_size": world_size}}

    def _optimizer_root(self, legacy: bool) -> nn.Module:
        """The module the optimizers' parameter names are taken from: all modules, by name; for
        a checkpoint of an earlier runtime (one model, one optimizer) that model, unprefixed."""
        return self.objects["model"] if legacy and "model" in self.objects else self._container

    def checkpoint_template(self, rank_extra: Mapping[str, Any], *, framework_in_meta: bool,
                            flat: bool = False) -> dict[str, Any]:
        """The state dict a checkpoint load fills (see checkpoint_payload); with
        `framework_in_meta` False, a checkpoint of an earlier runtime (framework state in DCP);
        `flat`: one whose optimizer states are flattened (its manifest's OPTIMIZER_KEYS)."""
        if not framework_in_meta:
            template = self.state_dict(extra=rank_extra, legacy=True)
            del template[EXTRA][STATE_KINDS]      # earlier runtimes did not save these
            del template[EXTRA]["data_order_tail"]
            return template
        template = self.state_dict(flat=flat)
        del template[EXTRA]
        if rank_extra:
            template[EXTRA] = dict(rank_extra)
        return template

    def load_state_dict(self, state: Mapping[str, Any], *, source: str, legacy: bool = False,
                        flat: bool = False) -> None:
        """Load a state from `state_dict()` (here or on another rank); `source` names it in errors;
        `legacy` and `flat` as in state_dict."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        missing = [n for n in self.objects if n not in state]
        if missing or EXTRA not in state:
            held = sorted(k for k in state if k != EXTRA)
            raise StateError(f"{source} holds no state for {missing} (it holds {held}); pass ctx.restore the same "
                             f"names the saved run used")
        self.progress.load_state_dict(state[EXTRA])
        self._precision.load_state(state[EXTRA])
        # Modules first: an optimizer's state is matched to their parameters by name.
        order = sorted(self.objects, key=lambda n: self.kinds[n] is not StateKind.MODULE)
        for name in order:
            obj, kind = self.objects[name], self.kinds[name]
            if kind is StateKind.MODULE:
                set_model_state_dict(obj, state[name])
            elif kind is StateKind.OPTIMIZER:
                with _plain_steps(obj):
                    set_optimizer_state_dict(self._optimizer_root(legacy), obj, state[name],
                                             options=StateDictOptions(flatten_optimizer_state_dict=flat))
            else:
                obj.load_state_dict(state[name])


@contextlib.contextmanager
def _plain_steps(optimizer: Any):
    """The optimizer's own step() and zero_grad() for the duration.

    DCP fills an optimizer's empty state by one step() with zero gradients at lr 0, so that its
    state dict has every key a checkpoint holds. The framework patches step() on the instance
    (fp16: through the GradScaler, which refuses a step without ctx.backward; gradient
    accumulation: a no-op on non-final micro-steps, which would leave the state empty and a
    checkpoint's Adam moments silently unloaded). Those patches are instance attributes: hidden
    here, the class's own methods run."""
    patched = {k: optimizer.__dict__.pop(k) for k in ("step", "zero_grad") if k in optimizer.__dict__}
    try:
        yield
    finally:
        optimizer.__dict__.update(patched)

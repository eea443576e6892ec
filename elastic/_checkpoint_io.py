"""Bridge between a rank's model/optimizer and the checkpointing package (rung 2 of the ladder).

State dicts come from torch.distributed.checkpoint.state_dict, which gives the same view for
DDP (plain tensors, written once across ranks) and FSDP2 (DTensor shards), so a checkpoint saved
at one world size loads at another.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict)


def open_manager(carry: Any, spec: Any) -> Any:
    """The worker's CheckpointManager (it lives in the worker's Carry across generations)."""
    if carry.checkpoints is None:
        from checkpointing import CheckpointManager
        carry.checkpoints = CheckpointManager(
            spec.storage, keep=spec.keep, storage_options=spec.storage_options or None,
            async_save=spec.async_save, max_consecutive_failures=spec.max_consecutive_failures,
            collective_timeout_s=spec.collective_timeout_s)
    return carry.checkpoints


def build_state(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                extra: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {"extra": dict(extra)}
    if model is not None and optimizer is not None:
        state["model"], state["optim"] = get_state_dict(model, optimizer)
    elif model is not None:
        state["model"] = get_model_state_dict(model)
    return state


def apply_state(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                state: dict[str, Any]) -> None:
    if model is None:
        return
    optimizers = (optimizer,) if optimizer is not None else ()
    set_state_dict(model, optimizers, model_state_dict=state["model"],
                   optim_state_dict=state.get("optim") if optimizer is not None else {})


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state on CPU; a collective under FSDP2."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

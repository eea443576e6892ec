"""Bridge between a rank and the checkpointing package (rung 2 of the ladder): the worker's
checkpoint manager, and the full model state (the model hash). What a checkpoint holds is
elastic._train_state.TrainState's state dict."""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def open_manager(session: Any, spec: Any) -> Any:
    """The worker's CheckpointManager (it lives in the worker's CheckpointSession across generations)."""
    if session.manager is None:
        from checkpointing import CheckpointManager
        session.manager = CheckpointManager(
            spec.storage, keep=spec.keep, storage_options=spec.storage_options or None,
            async_save=spec.async_save, max_consecutive_failures=spec.max_consecutive_failures,
            collective_timeout_s=spec.collective_timeout_s)
    return session.manager


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state on CPU; a collective under FSDP2."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

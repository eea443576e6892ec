"""The full (unsharded) model state of a rank's model, for the run's model hash. (What a
checkpoint holds is elastic._worker.train_state.TrainState's state dict; the worker's checkpoint
manager lives in elastic._worker.checkpoint_session.)"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def full_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The full (unsharded) model state on CPU (tensors, and any extra state a module keeps); a
    collective under FSDP2."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

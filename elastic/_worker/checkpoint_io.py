"""The full (unsharded) model state of a rank's model, for the run's model hash. (What a
checkpoint holds is elastic._worker.train_state.TrainState's state dict; the worker's checkpoint
manager lives in elastic._worker.checkpoint_session.)"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def full_model_state(model: torch.nn.Module, pipeline: Any = None) -> dict[str, Any]:
    """The full (unsharded) model state on CPU (tensors, and any extra state a module keeps) on
    global rank 0; a collective under FSDP2 and TP.

    With `pipeline` (the process group of this rank's pipeline) each stage's rank holds only its
    stage's part: every stage gathers its own (torch keeps a full state on global rank 0 alone
    when offloading to CPU, so the parts are taken whole on each rank, then moved), and the
    pipeline's first rank merges them: its parameter names are the whole model's, so the parts
    never collide."""
    if pipeline is None:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    import torch.distributed as dist
    part = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    part = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in part.items()}
    first = dist.get_group_rank(pipeline, dist.get_rank()) == 0
    parts: list[Any] | None = [None] * dist.get_world_size(pipeline) if first else None
    dist.gather_object(part, parts, group=pipeline, group_dst=0)
    return {k: v for p in parts for k, v in p.items()} if parts is not None else {}

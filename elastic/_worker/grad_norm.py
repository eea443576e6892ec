"""Gradient clipping by the global norm, on every layout (`ctx.clip_grad_norm_`).

torch's `clip_grad_norm_` stacks the per-gradient norms into one tensor, which fails under FSDP x
TP: the gradients of the TP-split layers are DTensors on the 2-D (dp, tp) mesh, those of what the
TP plan leaves alone (embeddings, norms) on the data-parallel mesh only, and DTensor ops refuse
operands on different meshes. Here the gradients are grouped by mesh, each group's norm is
reduced to a plain tensor (`full_tensor()`: the sum over the shards), the groups are combined, and
under pipeline parallelism the stages' norms too (each stage holds other parameters). Every rank
then scales by the same factor, which is what clipping the unsplit model would do. torchtitan
does the same in its `clip_grad_norm_` (torchtitan/distributed/utils.py).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class _MeshGroup:
    """The parameters whose gradients live on one mesh (plain tensors: mesh None), and those gradients."""

    def __init__(self) -> None:
        self.parameters: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []


def _by_mesh(parameters: Iterable[torch.Tensor]) -> list[_MeshGroup]:
    groups: dict[object, _MeshGroup] = {}
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            group = groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, _MeshGroup())
            group.parameters.append(parameter)
            group.grads.append(grad)
    return list(groups.values())


def _total(groups: list[_MeshGroup], norm_type: float, pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm(group.grads, norm_type=norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    if not norms:
        total = torch.tensor(0.0)
    elif math.isinf(norm_type):
        total = torch.stack(norms).max()
    else:
        total = torch.stack([n ** norm_type for n in norms]).sum()
    if pp_group is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        device = groups[0].grads[0].device if groups else torch.device("cpu")
        total = total.to(device)       # NCCL reduces device tensors
        dist.all_reduce(total, op=op, group=pp_group)
        total = total.cpu()
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients of `parameters` so that their global norm is at most `max_norm`;
    returns the norm before clipping (a plain CPU tensor, the same on every rank). Each mesh's
    gradients are scaled on their own: DTensor ops take no operands on two meshes."""
    groups = _by_mesh(parameters)
    total = _total(groups, norm_type, pp_group)
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group.parameters, max_norm, total.to(group.grads[0].device))
    return total

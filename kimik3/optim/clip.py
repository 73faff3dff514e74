"""Gradient-norm clipping that works for plain tensors and for DTensors on several meshes.

``torch.nn.utils.clip_grad_norm_`` assumes one mesh; with FSDP2 (parameters sharded over the
data-parallel ranks) and MoonEP (experts sharded over the expert-parallel ranks) the gradients live
on different meshes. Here each DTensor contributes the squared norm of its local shard, summed over
the ranks of its own mesh (shards are disjoint; replicated placements count once), so the total is
the norm of the whole model on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def _reduction_groups(grad: torch.Tensor) -> tuple:
    """The process groups a gradient's local squared norm is summed over: one per mesh dimension on
    which it is sharded (shards are disjoint; replicated placements count once); () for plain tensors."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(grad, DTensor):
        return ()
    return tuple(grad.device_mesh.get_group(dim) for dim, pl in enumerate(grad.placements) if isinstance(pl, Shard))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; return the norm (fp32).

    A collective when any gradient is a DTensor: every rank must call it with the same parameters."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = _local(grads[0]).device
    # Local squared norms summed per set of reduction groups first, so each group sees one all-reduce
    # per step instead of one per parameter (hundreds of tiny collectives on a sharded model).
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_groups.setdefault(_reduction_groups(g), []).append(_local(g).detach().float().pow(2).sum().to(device))
    partials = []
    for groups, squares in by_groups.items():
        partial = torch.stack(squares).sum()
        for group in groups:
            dist.all_reduce(partial, group=group)
        partials.append(partial)
    total = torch.stack(partials).sum().sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        local = _local(grad)
        local.mul_(scale.to(local.dtype))
    return total

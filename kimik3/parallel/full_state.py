"""Full (unsharded) state of a sharded model and its optimizer, for checkpoints.

A distributed run writes the very files a single process writes: full tensors, and the optimizer
state in ``MultiOptimizer.state_dict()``'s own layout (parameter indices, not FQNs), so either kind
of run resumes the other and ``from_pretrained`` reads a distributed run's weights as they are.
Both functions are collectives when anything is sharded: every rank must call them, in the same
order. (Loading goes the other way without communication: ``kimik3.train.checkpoint`` cuts each
rank's shard out of the full tensors.)
"""

from __future__ import annotations

from typing import Any

import torch


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s state is a DTensor (FSDP2 shards, MoonEP experts)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in model.state_dict().values())


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a possibly sharded model, as CPU tensors on rank 0 (other ranks get {}).

    Each DTensor (FSDP2 shards over dp x cp, MoonEP experts over ep) is gathered whole with
    ``full_tensor()``, in state-dict order, which is the same on every rank.
    """
    if not is_sharded(model):
        return {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    keep = dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            state[name] = full.detach().to("cpu").contiguous()
    return state


def _gather(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().cpu()
    if isinstance(obj, dict):
        return {k: _gather(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_gather(v) for v in obj)
    return obj


def full_optimizer_state(optimizer: Any) -> Any:
    """``optimizer.state_dict()`` with every DTensor gathered whole, on every rank.

    Works for a torch Optimizer or a ``MultiOptimizer``; the result has the single-process layout.
    """
    return _gather(optimizer.state_dict())


__all__ = ["full_model_state", "full_optimizer_state", "is_sharded"]

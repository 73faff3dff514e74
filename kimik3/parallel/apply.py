"""``parallelize``: every parallel wrapper, applied from outside the model in one fixed order.

Order (each step wraps what the previous one left; see docs/parallel.md):

1. context parallel (cp > 1): ``kimik3.parallel.kcp.apply_context_parallel(model, cp group)`` -
   KDA/MLA layers learn to split the sequence over the cp ranks. First, because it changes what
   the token mixers compute, which everything after it wraps unchanged.
2. expert parallel (ep > 1): ``kimik3.parallel.moonep.apply_expert_parallel`` keeps each "ep"
   rank's E/ep routed experts and routes tokens through the MoonEP exchange. The expert weights are
   then left out of FSDP; their gradients, which the exchange already sums over every token of the
   ep group, are summed over the ranks holding the same shard (dp/ep x cp) and divided by dp x cp
   so that they match FSDP's averaged gradients of the other parameters.
3. activation checkpointing (optional; ``kimik3.parallel.activation_checkpoint``): none, every block
   whole ("full"), every N-th block ("every:N") or op-level inside every block ("selective"), with
   the composable ``torch.distributed._composable.checkpoint`` (hooks, no wrapper module, so
   parameter names and checkpoints stay the same). Before FSDP so the recomputation runs inside
   FSDP's unshard.
4. FSDP2 (``fully_shard``) over the dp x cp ranks, last, as it must see the final module tree and
   the parameters EP leaves alone.

Single-process (world 1) runs none of this but activation checkpointing, when asked
(``kimik3.parallel.context``: the plain ``ParallelContext`` applies only that, the distributed one
calls ``parallelize``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from kimik3.parallel.activation_checkpoint import apply_activation_checkpointing, parse_mode
from kimik3.parallel.kcp import apply_context_parallel as kcp_apply
from kimik3.parallel.mesh import ParallelDims, cp_mesh, fsdp_mesh


def apply_context_parallel(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh) -> None:
    kcp_apply(model, cp_mesh(mesh).get_group())


def apply_expert_parallel(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, planner: str = "moonep") -> None:
    import torch.distributed as dist

    from kimik3.parallel.mesh import ep_mesh, ep_replica_mesh
    from kimik3.parallel.moonep import EPRoutedExperts
    from kimik3.parallel.moonep import apply_expert_parallel as moonep_apply

    moonep_apply(model, ep_mesh(mesh), planner=planner)
    replicas = ep_replica_mesh(mesh).get_group() if dims.world // dims.ep > 1 else None
    scale = 1.0 / (dims.dp * dims.cp)

    def reduce_grad(param: nn.Parameter) -> None:
        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        if replicas is not None:
            dist.all_reduce(local, group=replicas)
        local.mul_(scale)

    for module in model.modules():
        if isinstance(module, EPRoutedExperts):
            for param in module.parameters():
                param.register_post_accumulate_grad_hook(reduce_grad)


def is_expert_module(name: str, module: nn.Module) -> bool:
    """FSDP's ``ignore`` predicate under EP: the MoonEP-sharded routed experts."""
    from kimik3.parallel.moonep import EPRoutedExperts

    return isinstance(module, EPRoutedExperts)


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None, *,
                activation_checkpointing: str | bool = "none", fsdp_ignore=None,
                ep_planner: str = "moonep") -> nn.Module:
    """Apply context parallel, expert parallel, activation checkpointing and FSDP2, in that order.

    model: a ``K3ForCausalLM`` (modified in place and returned). mesh: ``build_mesh(dims, ...)``;
    None only for world size 1 (then only activation checkpointing applies). activation_checkpointing:
    a mode of ``kimik3.parallel.activation_checkpoint`` ("none", "full", "selective", "every:N"; True /
    False mean "full" / "none"). fsdp_ignore: see ``apply_fsdp``'s ``ignore``.
    """
    parse_mode(activation_checkpointing)   # a bad mode fails before anything is applied
    if mesh is None and dims.world > 1:
        raise ValueError(f"parallelize: dims {dims} need a mesh (build_mesh)")
    if dims.cp > 1:
        apply_context_parallel(model, dims, mesh)
    if dims.ep > 1:
        apply_expert_parallel(model, dims, mesh, planner=ep_planner)
    apply_activation_checkpointing(model, activation_checkpointing)
    if mesh is not None:
        from kimik3.parallel.fsdp import apply_fsdp

        if dims.ep > 1 and fsdp_ignore is None:
            fsdp_ignore = is_expert_module
        apply_fsdp(model, fsdp_mesh(mesh), ignore=fsdp_ignore)
    return model


def is_distributed_model(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (FSDP2 / EP applied)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


__all__ = [
    "apply_activation_checkpointing",
    "apply_context_parallel",
    "apply_expert_parallel",
    "is_distributed_model",
    "parallelize",
]

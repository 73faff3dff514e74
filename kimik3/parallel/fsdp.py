"""FSDP2 (``fully_shard``) for ``K3ForCausalLM``: parameter groups, mixed precision, fp32 islands.

Groups, innermost first (each ``fully_shard`` call all-gathers its parameters as one collective
before its module runs and reduce-scatters their gradients after its backward):

1. every K3 block in ``model.layers`` (one group per layer: the unit of compute and of memory);
2. the MTP module's block, then the MTP module (its norms and 2D -> D projection);
3. the root: embedding, final AttnRes mix, final norm and the output head. The embedding and head
   stay in the root group on purpose: ``K3ForCausalLM.head`` reads ``lm_head.weight`` (or the tied
   embedding) directly rather than calling the module, and the MTP loss re-uses the embedding
   and head, so a group of their own would be resharded while still being read. The root keeps
   its parameters gathered from forward to backward (``reshard_after_forward=False``), the usual
   choice: backward starts with it.

Mixed precision: on CUDA, bf16 compute copies of the parameters and fp32 gradient reduction
(``MixedPrecisionPolicy(bf16, fp32)``); the sharded master weights stay whatever dtype the model
was built in (the trainer builds fp32). On CPU: fp32 throughout.

fp32 islands: ``FP32_PARAMS`` (KDA's ``A_log`` and ``dt_bias``) must be used in fp32 whatever the
compute dtype. FSDP casts every parameter of a group to the group's ``param_dtype``, so when that
is not fp32 the module owning such parameters is split in two groups: its children together (the
bf16 policy, one collective), then the module itself, holding only its direct parameters, with an
fp32 policy. The router's ``expert_bias`` is a buffer: FSDP neither shards nor casts buffers, so it
stays a replicated fp32 tensor, updated identically on every rank by Quantile Balancing.

Expert parallelism: ``ignore`` names modules FSDP must leave alone (e.g. routed experts that the
EP layer shards itself); their parameters are passed as ``ignored_params``, stay plain tensors
and are not reduced by FSDP.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from kimik3.model.k3 import FP32_PARAMS


def default_mp_policy(device_type: str) -> MixedPrecisionPolicy:
    """bf16 compute / fp32 reduction on CUDA; nothing cast on CPU."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _owns_fp32_params(module: nn.Module) -> bool:
    return any(name in FP32_PARAMS for name, _ in module.named_parameters(recurse=False))


def _shard_group(module: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy, reshard: bool,
                 ignored: set[nn.Parameter]) -> None:
    """fully_shard ``module``, first splitting off fp32 islands inside it when ``policy`` casts."""
    casts = policy.param_dtype is not None and policy.param_dtype != torch.float32
    if casts:
        fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                           cast_forward_inputs=False)
        for owner in [m for m in module.modules() if _owns_fp32_params(m) and not isinstance(m, FSDPModule)]:
            children = [c for c in owner.children() if not isinstance(c, FSDPModule)
                        and any(p not in ignored for p in c.parameters())]
            if children:
                fully_shard(children, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                            ignored_params=ignored or None)
            fully_shard(owner, mesh=mesh, reshard_after_forward=reshard, mp_policy=fp32_policy,
                        ignored_params=ignored or None)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                ignored_params=ignored or None)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True,
               ignore: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Shard ``model`` (a ``K3ForCausalLM``) in place with FSDP2 over the 1-D ``mesh``; returns it.

    mesh: the FSDP mesh (``kimik3.parallel.mesh.fsdp_mesh(full_mesh)``: dp x cp ranks).
    mp_policy: default ``default_mp_policy(mesh.device_type)``.
    reshard_after_forward: for the block and MTP groups (the root always keeps its parameters).
    ignore: ``ignore(qualified_name, module) -> True`` leaves that module's parameters to another
        layer (expert parallelism); they are neither sharded nor gradient-reduced by FSDP.
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_fsdp: expected the 1-D FSDP mesh (fsdp_mesh(mesh)), got {mesh.ndim} dims")
    policy = mp_policy if mp_policy is not None else default_mp_policy(mesh.device_type)
    ignored: set[nn.Parameter] = set()
    if ignore is not None:
        for name, module in model.named_modules():
            if ignore(name, module):
                ignored.update(module.parameters())

    # FSDP2 hands a wrapped module its inputs as views (its post-backward hooks), and a block passes its input on
    # in the AttnRes entries, so it warns that the block "returned a view tensor" whose in-place change would drop
    # a hook; nothing changes the entries (or the model's final hidden state) in place, and the FSDP tests compare
    # every gradient with one process'. So that warning is filtered, for these modules only.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(K3Block|K3ForCausalLM|MTPModule)\) "
                            r"returned a view tensor", category=UserWarning)
    for block in model.layers:
        _shard_group(block, mesh, policy, reshard_after_forward, ignored)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        _shard_group(mtp.block, mesh, policy, reshard_after_forward, ignored)
        _shard_group(mtp, mesh, policy, reshard_after_forward, ignored)
    _shard_group(model, mesh, policy, False, ignored)
    return model

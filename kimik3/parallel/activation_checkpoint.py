"""Activation checkpointing of the K3 blocks: which activations a training step keeps for backward.

Modes (``apply_activation_checkpointing(model, mode)``, ``kimik3 train --activation-checkpointing``):

- ``"none"``: autograd keeps everything it saves.
- ``"full"``: every block (the K3 layers and the MTP module's block) keeps only its inputs; backward
  re-runs its forward.
- ``"selective"``: inside every block, the outputs of the expensive operators are kept and the cheap
  glue between them (norms, activations, gates, casts, AttnRes mixing, the routing's sort and counts)
  is recomputed from them in backward (``torch.utils.checkpoint.create_selective_checkpoint_contexts``
  with ``selective_policy``). Kept: the outputs of matmuls (mm, addmm, bmm, grouped mm), of the fused
  scaled-dot-product attention kernels and of the router's top-k (``COMPUTE_OPS``), when run with grad
  mode on; the outputs of expert parallelism's collectives (``COMM_OPS``, not sent again); device ->
  host copies (no second wait on the device). Everything else is recomputed: the Triton / Gluon kernels
  (custom operators, ``kimik3::...``, not in ``COMPUTE_OPS``: each re-runs whole, as under ``"full"``) and
  the insides of the torch chunked KDA's ``autograd.Function`` (run with grad mode off, written by
  in-place updates that a cached copy would not follow).
- ``"every:N"``: blocks 0, N, 2N, ... (the MTP block counted after the last layer) are checkpointed
  whole, the others not.

Mechanism: the composable ``torch.distributed._composable.checkpoint`` (forward hooks, no wrapper
module), so parameter names, state-dict keys and the module tree stay those of the model; its
``context_fn`` carries the selective policy. The blocks take ``(stream, entries, state, cu_seqlens)``
with ``entries`` a list of tensors (the AttnRes block sums); non-reentrant checkpointing re-runs the
block on the very same arguments, and the model never mutates a list it passed (a block returns a
new one), so the recomputation sees the entries the forward saw.

The recomputation must run the ops of the forward (selective checkpointing matches them one by one to
what it kept), so state a block reads besides its arguments is set as the forward had it:

- KCP's segment lengths (``_forward_lengths``), which the model's hook clears after each forward;
- the routing record: the routers report their statistics to the model's ``RoutingRecord``, which
  closes when the forward returns. The recomputation reports to a record of its own that is dropped
  (``kimik3.model.moe.routing_discarded``; to none if the forward had none), even when backward is
  called inside an open record, so every token is counted once, by the forward. The router biases
  change only in the balancer's ``step()``, after backward, so the recomputed routing is the
  forward's.

Apply before FSDP (``kimik3.parallel.apply.parallelize``): FSDP's pre-forward hook is prepended, so a
block's all-gather runs before, outside the checkpointed region, and its pre-backward unshard before
the recomputation.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from kimik3.model.moe import routing_discarded, routing_recorded

MODES = ("none", "full", "selective")
"""The named modes; ``"every:N"`` (N >= 1) is accepted as well."""


def _resolve(names: tuple[str, ...], namespace: Any) -> set:
    """The ``.default`` overloads of the operators of ``names`` that this build of torch has."""
    ops = set()
    for name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _compute_ops() -> frozenset:
    return frozenset(_resolve((
        # matmuls: F.linear and matmul reach the dispatcher as mm / addmm, einsum as bmm
        "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
        # the fused SDPA kernels (the math fallback is composite: its bmm's are caught above)
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward",
        # the router's choice: a few numbers per token, kept so that the recomputed expert assignment is
        # the forward's whatever the kernel's tie-breaking
        "topk",
    ), torch.ops.aten))


def _comm_ops() -> frozenset:
    # The exchanges of expert parallelism (funcol's all_to_all_single_autograd runs the op with grad mode off,
    # inside its autograd function): kept rather than sent again in backward.
    return frozenset(_resolve(("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"),
                              torch.ops._c10d_functional))


COMPUTE_OPS = _compute_ops()
"""The operators whose outputs ``"selective"`` keeps when they run with grad mode on."""
COMM_OPS = _comm_ops()
"""The collectives whose outputs ``"selective"`` keeps, grad mode on or off."""
SAVE_OPS = COMPUTE_OPS | COMM_OPS


def _is_host_copy(func, args, kwargs) -> bool:
    """A device -> host copy (a ``.tolist()`` of split sizes or sequence offsets): kept, so that the
    recomputation does not wait on the device for it again."""
    if func is not torch.ops.aten._to_copy.default or not args or not isinstance(args[0], torch.Tensor):
        return False
    device = kwargs.get("device")
    return args[0].device.type != "cpu" and device is not None and torch.device(device).type == "cpu"


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep the outputs of ``COMPUTE_OPS`` run with grad mode on, of ``COMM_OPS`` and of device -> host copies;
    recompute everything else."""
    if func in COMM_OPS or _is_host_copy(func, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    if func in COMPUTE_OPS and torch.is_grad_enabled():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _forward_lengths(split: Any, lengths: list[int] | None):
    """KCP's per-forward segment lengths (``kimik3.parallel.kcp.ContextParallel.lengths``) as the forward had
    them: the model's hook clears them after its forward, and without them a recomputed layer would gather
    them again, a collective the forward did not make (selective checkpointing then finds ops it did not
    record)."""
    if split is None:
        yield
        return
    before, split.lengths = split.lengths, lengths
    try:
        yield
    finally:
        split.lengths = before


def _contexts(model: nn.Module, selective: bool):
    """The ``context_fn`` of a checkpointed block: called at each forward of the block, it returns the
    contexts of that forward and of its recomputation."""
    def context_fn() -> tuple[AbstractContextManager, AbstractContextManager]:
        forward, recompute = (create_selective_checkpoint_contexts(selective_policy) if selective
                              else (nullcontext(), nullcontext()))
        split = getattr(model, "context_parallel", None)
        lengths = getattr(split, "lengths", None)
        recorded = routing_recorded()

        @contextmanager
        def recomputing():
            with recompute, routing_discarded(recorded), _forward_lengths(split, lengths):
                yield

        return forward, recomputing()

    return context_fn


def parse_mode(mode: str | bool | None) -> tuple[str, int]:
    """``(kind, every)``: kind one of ``none / full / selective / every``; ``every`` the period of
    ``"every:N"`` (else 1). ``True`` / ``False`` / None mean ``"full"`` / ``"none"`` / ``"none"``."""
    if mode is None or mode is False:
        return "none", 1
    if mode is True:
        return "full", 1
    if isinstance(mode, str):
        if mode in MODES:
            return mode, 1
        if mode.startswith("every:"):
            period = mode[len("every:"):]
            if period.isascii() and period.isdigit() and int(period) >= 1:
                return "every", int(period)
    raise ValueError(f"activation checkpointing mode must be one of {', '.join(MODES)} or every:N (N >= 1), "
                     f"got {mode!r}")


def checkpoint_mode(mode: str | bool | None) -> str:
    """``mode`` checked and spelt as a string (``True`` -> ``"full"``, ``False`` / None -> ``"none"``)."""
    kind, every = parse_mode(mode)
    return f"every:{every}" if kind == "every" else kind


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks checkpointing applies to: every K3 layer, then the MTP module's block if any."""
    blocks = list(model.layers)
    if getattr(model, "mtp", None) is not None:
        blocks.append(model.mtp.block)
    return blocks


def apply_activation_checkpointing(model: nn.Module, mode: str | bool | None = "full") -> nn.Module:
    """Checkpoint ``model``'s blocks (a ``K3ForCausalLM``, in place; returned) as ``mode`` says (see the
    module docstring). Raises ValueError for an unknown mode, before touching the model."""
    from torch.distributed._composable import checkpoint

    kind, every = parse_mode(mode)
    if kind == "none":
        return model
    context_fn = _contexts(model, selective=kind == "selective")
    for index, block in enumerate(checkpointed_blocks(model)):
        if kind == "every" and index % every:
            continue
        checkpoint(block, context_fn=context_fn)
    return model


__all__ = ["COMM_OPS", "COMPUTE_OPS", "MODES", "SAVE_OPS", "apply_activation_checkpointing", "checkpoint_mode",
           "checkpointed_blocks", "parse_mode", "selective_policy"]

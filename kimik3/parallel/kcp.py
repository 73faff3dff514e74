"""KDA context parallelism (KCP, notes §7) installed into a model: one long sequence split into contiguous
segments, one per rank of a process group (every batch row split the same way).

The layers are written once, in ``kimik3/model``; KCP plugs into the seams they expose:

- ``KDA.context_parallel`` (``KDAContextParallel``): the short conv's left context and the recurrence's
  incoming state come from the earlier ranks (``kcp_conv_state``, ``kcp_kda``);
- ``GatedMLA.context_parallel`` (``MLAContextParallel``): the latents of the earlier ranks are gathered
  and masked causally (``kcp_mla_latents``);
- the model itself gets a forward pre-hook and a forward hook: every rank's segment length once per
  forward, the refusal of what KCP cannot do (caches, ``cu_seqlens``, ``generate``), and the loss shares
  (with MTP's targets across the segment borders).

The ops and their exchanges live in ``kimik3.parallel.kcp_ops``; docs/kcp.md has the math and the
communication counts. Legend: P = ranks in the group, r = this rank, B = batch rows, T = this rank's tokens.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from kimik3.model.k3 import IGNORE_INDEX, K3ForCausalLM, K3Output
from kimik3.model.kda import KDA
from kimik3.model.mla import GatedMLA
from kimik3.ops.loss import linear_cross_entropy
from kimik3.parallel.kcp_ops import (
    kcp_conv_state,
    kcp_kda,
    kcp_mla_latents,
    kcp_short_conv,
    rank_world,
    segment_lengths,
)

__all__ = [
    "ContextParallel",
    "apply_context_parallel",
    "kcp_conv_state",
    "kcp_kda",
    "kcp_mla_latents",
    "kcp_short_conv",
    "segment_lengths",
    "shard_sequence",
]


class ContextParallel:
    """One model's context parallelism over ``group``: the object behind every KDA and MLA layer's
    ``context_parallel`` seam, and the model's forward hooks (see ``apply_context_parallel``).

    ``lengths`` is every rank's segment length for the model forward in flight, set by the pre-hook and
    cleared by the hook after it; outside a model forward (a layer called alone) it is None and the
    layers' exchanges gather what they need. Activation checkpointing's recomputation in backward sets
    the forward's lengths again (``kimik3.parallel.activation_checkpoint``).
    """

    def __init__(self, group: dist.ProcessGroup | None, model: K3ForCausalLM):
        self.group = group
        self.lengths: list[int] | None = None
        self._labels: torch.Tensor | None = None
        self._forward_signature = inspect.signature(model.forward)

    # ------------------------------------------------------------------ the layers' seams
    def conv_state(self, x_BTC: torch.Tensor, width: int) -> torch.Tensor | None:
        """``KDAContextParallel.conv_state``: the previous rank's last W-1 conv inputs."""
        return kcp_conv_state(x_BTC, width, self.group, self.lengths)

    def chunk_kda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  **options) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``KDAContextParallel.chunk_kda``: ``kcp_kda`` over the group."""
        return kcp_kda(q, k, v, g, beta, self.group, **options)

    def attend(self, kv_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``MLAContextParallel.attend``: the latents of ranks 0..r and this rank's causal mask."""
        return kcp_mla_latents(kv_BTC, self.group, self.lengths)

    # ------------------------------------------------------------------ the model's hooks
    def before_forward(self, model: K3ForCausalLM, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook: refuse what KCP cannot run (before any communication), gather every rank's
        segment length, and hold the labels back so that the forward computes no single-process loss (nor the
        [B, T, V] logits: it runs with ``last_only``, and the hook drops that one position's logits)."""
        call = self._forward_signature.bind(*args, **kwargs)
        given = call.arguments
        if given.get("cache") is not None:
            raise ValueError("context parallel: a cache is not supported (context parallelism is for training "
                             "and full-sequence forwards; generate() and cached decoding need the single-process "
                             "model)")
        if given.get("cu_seqlens") is not None:
            raise ValueError("context parallel: packed cu_seqlens are not supported; split one unpacked "
                             "sequence (per batch row) into contiguous segments")
        input_ids, labels = given["input_ids"], given.get("labels")
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if labels is not None:
            if given.get("last_only"):
                raise ValueError("labels need every position: drop last_only / logits_at")
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids "
                                 f"{tuple(input_ids.shape)}")

        _, world = rank_world(self.group)
        meta = torch.tensor([input_ids.shape[1], input_ids.shape[0]], dtype=torch.int64, device=input_ids.device)
        metas = [torch.empty_like(meta) for _ in range(world)]
        dist.all_gather(metas, meta, group=self.group)
        lengths, batches = [int(m[0]) for m in metas], {int(m[1]) for m in metas}
        if len(batches) != 1:
            raise ValueError(f"context parallel: every rank needs the same batch size, got {sorted(batches)}")
        if min(lengths) < 1:
            raise ValueError(f"context parallel: every rank needs at least one token, got lengths {lengths}")

        self.lengths, self._labels = lengths, labels
        if labels is not None:
            given["labels"] = None
            given["last_only"] = True   # the loss comes from the hidden (``_loss_shares``), not from logits
        return call.args, call.kwargs

    def after_forward(self, model: K3ForCausalLM, args: tuple, kwargs: dict, out: K3Output | None) -> None:
        """Forward hook (always called, also when the forward raised, with ``out`` None): this rank's loss
        shares when labels were given (and ``logits`` None, as the single-process model gives); the per-forward
        lengths and labels are cleared either way."""
        try:
            if out is not None and self._labels is not None:
                out.logits = None
                self._loss_shares(model, out, self._labels, self.lengths)   # MTP's layers still see the lengths
        finally:
            self._labels = self.lengths = None

    def _loss_shares(self, model: K3ForCausalLM, out: K3Output, labels: torch.Tensor, lengths: list[int]) -> None:
        """Set ``out.loss`` / ``main_loss`` / ``mtp_loss`` to this rank's shares: sum over local tokens /
        number of counted tokens in the whole group. The head and the cross-entropy run fused over token chunks
        (``linear_cross_entropy``) on the final hidden state, as the single-process forward does."""
        rank, world = rank_world(self.group)
        main_sum = linear_cross_entropy(model.norm(out.hidden), model.head_weight, labels,
                                        ignore_index=IGNORE_INDEX, reduction="sum")
        counts = torch.stack([(labels != IGNORE_INDEX).sum(), labels.new_zeros(())]).to(torch.float64)

        use_mtp = model.mtp is not None and sum(lengths) > 1
        if use_mtp:
            # Position t sees h_t and x_{t+1} (= labels[t]) and predicts x_{t+2} (= labels[t+1]). The
            # last local position's target is the next rank's first label; the global last position
            # has none (single-process drops it; here it is kept with an ignored target, which
            # changes nothing else: every layer is causal and the MoE is per token).
            first = labels[:, :1].contiguous()
            firsts = [torch.empty_like(first) for _ in range(world)]
            dist.all_gather(firsts, first, group=self.group)
            after = firsts[rank + 1] if rank + 1 < world else torch.full_like(first, IGNORE_INDEX)
            targets = torch.cat([labels[:, 1:], after], dim=1).masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX)
            mtp_hidden = model.mtp(out.hidden, model.embed(labels.clamp(min=0)), None)
            mtp_sum = linear_cross_entropy(mtp_hidden, model.head_weight, targets, ignore_index=IGNORE_INDEX,
                                           reduction="sum")
            counts[1] = (targets != IGNORE_INDEX).sum()
        dist.all_reduce(counts, group=self.group)  # counted tokens over the whole group (no gradient)
        out.main_loss = main_sum / counts[0].to(main_sum.dtype)
        out.loss = out.main_loss
        if use_mtp:
            out.mtp_loss = mtp_sum / counts[1].to(mtp_sum.dtype)
            out.loss = out.main_loss + model.config.mtp.loss_weight * out.mtp_loss


def apply_context_parallel(model: K3ForCausalLM, group: dist.ProcessGroup | None = None) -> K3ForCausalLM:
    """Make ``model`` run context parallel over ``group``, in place, without touching model code.

    Mechanism: one ``ContextParallel`` object is set as the ``context_parallel`` seam of every ``KDA``
    and ``GatedMLA`` module (the MTP block's included) and as ``model.context_parallel``, and the model
    gets a forward pre-hook and an always-called forward hook (segment lengths, labels held back from
    the single-process loss, loss shares with MTP's border targets). No class changes; parameters,
    buffers and state-dict keys are untouched, so checkpoints and optimizers see the same model. Apply
    it first (before expert parallelism, activation checkpointing and FSDP2, which wrap what they find).

    Contract per rank: ``model(input_ids_local, labels_local)`` with the rank's contiguous segment of
    every row (``shard_sequence``); ``labels`` must be shifted on the *global* sequence before splitting
    (``labels[t]`` is the target of global position t, so the last token of rank r carries the first
    input of rank r+1). ``loss`` (and ``main_loss``, ``mtp_loss``) is the rank's *share*: sum over local
    tokens / number of counted tokens in the whole group, so the shares add up to the single-process
    loss; backpropagate it on every rank and SUM parameter gradients over ``group`` (not average).
    Caches, ``cu_seqlens`` and ``generate`` raise ValueError before any communication.
    """
    if not isinstance(model, K3ForCausalLM):
        raise TypeError(f"apply_context_parallel expects a K3ForCausalLM, got {type(model).__name__}")
    if getattr(model, "context_parallel", None) is not None:
        raise ValueError("apply_context_parallel: the model is already context parallel")
    if not dist.is_initialized():
        raise RuntimeError("apply_context_parallel: torch.distributed is not initialised")
    split = ContextParallel(group, model)
    for module in model.modules():
        if isinstance(module, (KDA, GatedMLA)):
            module.context_parallel = split
    model.register_forward_pre_hook(split.before_forward, with_kwargs=True)
    model.register_forward_hook(split.after_forward, with_kwargs=True, always_call=True)
    model.context_parallel = split
    return model


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1,
                   lengths: list[int] | None = None) -> torch.Tensor:
    """This rank's contiguous segment of ``x`` along ``dim`` (tokens): ``lengths`` per rank, or as even
    as possible (the first T % P ranks get one more). Shift labels on the global sequence first."""
    rank, world = rank_world(group)
    total = x.shape[dim]
    if lengths is None:
        lengths = [total // world + (1 if r < total % world else 0) for r in range(world)]
    if len(lengths) != world or sum(lengths) != total:
        raise ValueError(f"shard_sequence: lengths {lengths} must be {world} numbers summing to {total}")
    return x.narrow(dim, sum(lengths[:rank]), lengths[rank])

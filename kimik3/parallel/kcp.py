"""KDA context parallelism (KCP, notes §7): one long sequence split into contiguous segments, one per rank.

Legend: P = ranks in the context-parallel group, r = this rank, B = batch rows (every row split the
same way), T = this rank's tokens, S = tokens this rank's MLA queries may attend to (all tokens of
ranks 0..r), H = heads, K = key dim, V = value dim, C = channels (conv) or latent width (MLA),
W = conv width. See docs/kcp.md for the math and the communication counts.

KDA is affine in its incoming state: a segment maps S_in to S_out = M S_in + S~ (M [K, K] the product
of the per-token transitions (I - beta k k^T) Diag(exp g), S~ [K, V] the segment's state from zero),
and each output gains q~_t^T S_in with q~_t = scale * P_t^T q_t (P_t the transition product up to t).
One ``chunk_kda`` call on the augmented values [v, 0] from the augmented state [0, I] ([K, V + K])
returns both: the first V output columns are the zero-state outputs, the last K are q~_t; the final
state is [S~ | M]. One fixed-size all-gather of [B, H, K, V + K] fp32 per rank, then each rank scans
S_in = M_{r-1}(...(M_0 0 + S~_0)...) + S~_{r-1} and adds q~_t^T S_in.

Short convolutions: each rank receives the previous rank's last W-1 inputs (point-to-point, and the
gradient goes back the same way). Gated MLA: the latents [B, T, C + R] are all-gathered (576 values
per token in K3) and queries at global positions offset_r + t attend to keys at positions <= that.

Every exchange is a differentiable autograd Function whose backward is the matching collective, so
the backward must run on every rank of the group (it always does when each rank backpropagates its
own loss share; see ``apply_context_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kimik3.model.conv import short_conv
from kimik3.model.k3 import IGNORE_INDEX, K3ForCausalLM, K3Output
from kimik3.model.kda import KDA
from kimik3.model.mla import GatedMLA
from kimik3.ops.kda import bounded_gate, chunk_kda, l2_normalize

__all__ = [
    "KCPKDA",
    "KCPForCausalLM",
    "KCPGatedMLA",
    "apply_context_parallel",
    "kcp_kda",
    "kcp_mla_latents",
    "kcp_short_conv",
    "segment_lengths",
    "shard_sequence",
]


# ---------------------------------------------------------------------------------------------
# differentiable exchanges
# ---------------------------------------------------------------------------------------------


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class _AllGather(torch.autograd.Function):
    """x [...] on every rank -> [P, ...]; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):  # type: ignore[override]
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world,) + tuple(x.shape))
        dist.all_gather(list(out.unbind(0)), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        group = ctx.group
        rank, _ = _rank_world(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=group)
        else:  # gloo has no reduce-scatter: all-reduce and keep this rank's slice
            summed = grad.clone()
            dist.all_reduce(summed, group=group)
            out = summed[rank]
        return out, None


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


class _ShiftRight(torch.autograd.Function):
    """Rank r sends x to rank r+1 and returns what rank r-1 sent (zeros on rank 0); the gradient
    travels back the other way. Point-to-point, x the same shape on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        received = torch.zeros_like(x)
        _exchange(send=x, to=+1, recv=received, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad_x = torch.zeros_like(grad)
        _exchange(send=grad.contiguous(), to=-1, recv=grad_x, group=ctx.group)
        return grad_x, None


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, group) -> None:
    """Send ``send`` to rank r+to and receive into ``recv`` from rank r-to (where they exist)."""
    rank, world = _rank_world(group)
    ops = []
    if 0 <= rank + to < world:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group or dist.group.WORLD, rank + to),
                              group))
    if 0 <= rank - to < world:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group or dist.group.WORLD, rank - to),
                              group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _anchor(x: torch.Tensor) -> torch.Tensor:
    """A zero scalar that depends on x. A rank that uses none of a gathered tensor (rank 0 needs no
    predecessor) must still reach the gather's backward, which is a collective."""
    return x.reshape(-1)[:1].sum() * 0


def segment_lengths(length: int, group=None, device: torch.device | None = None) -> list[int]:
    """Every rank's segment length (one tiny int64 all-gather), in rank order."""
    _, world = _rank_world(group)
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


# ---------------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------------


def kcp_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Context-parallel ``chunk_kda``: this rank holds tokens [offset_r, offset_r + T) of every row.

    Args:
        q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (fla layout, as ``chunk_kda``).
            Segment lengths may differ between ranks (any T >= 0); B, H, K, V may not.
        group: the context-parallel process group (None: the default group).
        scale: multiplier on q, default K ** -0.5.
        initial_state: optional [B, H, K, V] state entering the *whole* sequence (rank 0's
            incoming state); pass the same tensor on every rank. Each rank's copy receives the
            gradient of that rank's outputs only: sum it over the group for the total.
        output_final_state: also return the state after the last rank's segment, [B, H, K, V] fp32,
            on every rank (its gradient, like ``initial_state``'s, is per rank: backpropagate it
            from one rank, or divide).
        cu_seqlens: not supported (packed sequences would need per-sequence segment bookkeeping).

    Returns:
        (o [B, T, H, V] in v's dtype, final state or None). Equal to ``chunk_kda`` on the
        concatenated sequence; differentiable in q, k, v, g, beta (and initial_state).

    Communication: one all-gather of [B, H, K, V + K] fp32 per rank (fixed size, independent of T);
    the backward reduce-scatters its gradient.
    """
    if cu_seqlens is not None:
        raise ValueError("kcp_kda: packed cu_seqlens are not supported under context parallelism; "
                         "give each rank a contiguous segment of unpacked rows")
    if q.ndim != 4 or v.ndim != 4:
        raise ValueError(f"kcp_kda: q and v must be [B, T, H, K] / [B, T, H, V], got {tuple(q.shape)}, "
                         f"{tuple(v.shape)}")
    rank, world = _rank_world(group)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        raise ValueError(f"kcp_kda: initial_state must be [B, H, K, V] = {(B, H, K, V)}, "
                         f"got {tuple(initial_state.shape)}")

    # Zero-state outputs and q~ in one call: the value columns are independent, so [v, 0] from
    # [0, I] carries the segment's own writes in the first V columns and the transition in the last K.
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    eye = torch.eye(K, device=q.device, dtype=torch.float32).expand(B, H, K, K)
    state_aug = torch.cat([eye.new_zeros(B, H, K, V), eye], dim=-1)
    o_aug, final_aug = chunk_kda(q, k, v_aug, g, beta, scale=scale, initial_state=state_aug,
                                 output_final_state=True)
    o_local, q_tilde = o_aug.split([V, K], dim=-1)

    gathered = _all_gather(final_aug, group)                      # [P, B, H, K, V + K] fp32
    s_tilde, trans = gathered[..., :V], gathered[..., V:]

    state = initial_state.float() if initial_state is not None else final_aug.new_zeros(B, H, K, V)
    state = state + _anchor(gathered)
    for j in range(rank):                                         # the prefix scan
        state = trans[j] @ state + s_tilde[j]
    o = (o_local.float() + torch.einsum("bthk,bhkv->bthv", q_tilde.float(), state)).to(v.dtype)

    final = None
    if output_final_state:
        final = state
        for j in range(rank, world):
            final = trans[j] @ final + s_tilde[j]
    return o, final


# ---------------------------------------------------------------------------------------------
# short convolution and MLA latents
# ---------------------------------------------------------------------------------------------


def kcp_short_conv(
    x_BTC: torch.Tensor,
    weight_CW: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    activation: bool = True,
    lengths: list[int] | None = None,
) -> torch.Tensor:
    """Context-parallel ``short_conv``: the causal depthwise conv of this rank's segment, seeded with
    the previous rank's last W-1 inputs (sent point-to-point; the gradient returns the same way).

    x_BTC [B, T, C], weight_CW [C, W] -> y [B, T, C] in x's dtype. Every rank but the last needs
    T >= W-1 (the W-1 inputs before a segment then all lie on the previous rank); ``lengths`` (every
    rank's T, as from ``segment_lengths``) lets all ranks check that together, else each checks its own.
    """
    width = weight_CW.shape[1]
    if width == 1:
        return short_conv(x_BTC, weight_CW, activation=activation)[0]
    rank, world = _rank_world(group)
    need = width - 1
    too_short = ([r for r, n in enumerate(lengths[:-1]) if n < need] if lengths is not None
                 else ([rank] if rank < world - 1 and x_BTC.shape[1] < need else []))
    if too_short:
        raise ValueError(f"kcp_short_conv: ranks {too_short} hold fewer than W-1 = {need} tokens; every "
                         "rank but the last needs at least W-1 tokens")
    # The last min(T, W-1) inputs, left-padded: the last rank sends nothing, but its tail still
    # depends on x so that the exchange's backward (which sends to rank r-1) runs there too.
    tail_BWC = x_BTC[:, max(x_BTC.shape[1] - need, 0):]
    if tail_BWC.shape[1] < need:
        tail_BWC = torch.cat([tail_BWC.new_zeros(x_BTC.shape[0], need - tail_BWC.shape[1], x_BTC.shape[2]),
                              tail_BWC], dim=1)
    prev_BWC = _ShiftRight.apply(tail_BWC, group)
    y, _ = short_conv(x_BTC, weight_CW, prev_BWC.transpose(1, 2), activation=activation)
    return y


def kcp_mla_latents(
    kv_BTC: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    lengths: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the MLA latents and build this rank's causal mask.

    kv_BTC [B, T, C] (this rank's latents, C = kv_lora_rank + rope slice) -> (kv_BSC [B, S, C], the
    latents of ranks 0..r in order, S = offset_r + T; mask [T, S] bool, True = may attend: the query
    at global position offset_r + t sees keys at positions <= offset_r + t). ``lengths``: every
    rank's T (gathered when None); uneven lengths are padded to the longest for the all-gather.
    Differentiable: the backward reduce-scatters the latents' gradient.
    """
    rank, _ = _rank_world(group)
    if lengths is None:
        lengths = segment_lengths(kv_BTC.shape[1], group, kv_BTC.device)
    longest = max(lengths)
    padded = kv_BTC
    if kv_BTC.shape[1] < longest:
        padded = torch.cat([kv_BTC, kv_BTC.new_zeros(kv_BTC.shape[0], longest - kv_BTC.shape[1],
                                                     kv_BTC.shape[2])], dim=1)
    gathered = _all_gather(padded, group)                         # [P, B, longest, C]
    kv_BSC = torch.cat([gathered[j, :, : lengths[j]] for j in range(rank + 1)], dim=1)
    offset = sum(lengths[:rank])
    query = torch.arange(kv_BTC.shape[1], device=kv_BTC.device) + offset
    key = torch.arange(kv_BSC.shape[1], device=kv_BTC.device)
    return kv_BSC, key[None, :] <= query[:, None]


# ---------------------------------------------------------------------------------------------
# model: class swap
# ---------------------------------------------------------------------------------------------


@dataclass
class _KCPContext:
    """Shared by the swapped modules of one model: the group, and every rank's segment length for
    the forward in flight (None outside ``KCPForCausalLM.forward``: the mixers then gather it)."""

    group: dist.ProcessGroup | None
    lengths: list[int] | None = None


def _check_plain(kind: str, state, cu_seqlens) -> None:
    if state is not None:
        raise ValueError(f"context-parallel {kind}: a cache / carried state is not supported "
                         "(context parallelism is for training and full-sequence forwards)")
    if cu_seqlens is not None:
        raise ValueError(f"context-parallel {kind}: packed cu_seqlens are not supported; split one "
                         "unpacked sequence (per batch row) into contiguous segments")


class KCPKDA(KDA):
    """``KDA`` whose forward runs context parallel (the module's class is swapped in place by
    ``apply_context_parallel``; parameters and state-dict names are unchanged)."""

    _kcp: _KCPContext

    def forward(self, x_BTD: torch.Tensor, state=None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        _check_plain("KDA", state, cu_seqlens)
        group, lengths = self._kcp.group, self._kcp.lengths
        batch, length, _ = x_BTD.shape
        heads, head_dim = self.num_heads, self.head_dim

        # Same arithmetic as KDA.forward; only the conv boundary and the recurrence are exchanged.
        qkv_BTC = torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], dim=-1)
        conv_weight = torch.cat([self.q_conv, self.k_conv, self.v_conv], dim=0).to(qkv_BTC.dtype)
        qkv_BTC = kcp_short_conv(qkv_BTC, conv_weight, group, lengths=lengths)
        q_BTHK, k_BTHK, v_BTHV = (t.unflatten(-1, (heads, head_dim)) for t in qkv_BTC.chunk(3, dim=-1))
        q_BTHK, k_BTHK = l2_normalize(q_BTHK), l2_normalize(k_BTHK)
        raw_gate = self.forget_b(self.forget_a(x_BTD)).unflatten(-1, (heads, head_dim))
        g_BTHK = bounded_gate(raw_gate, self.A_log, self.dt_bias, self.g_min)
        beta_BTH = torch.sigmoid(self.beta_proj(x_BTD).float())
        o_BTHV, _ = kcp_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, group)

        gate_BTHV = self.output_gate(x_BTD).unflatten(-1, (heads, head_dim))
        normed = F.rms_norm(o_BTHV.float(), (head_dim,), self.output_norm_weight.float(), self.norm_eps)
        out = (normed * torch.sigmoid(gate_BTHV.float())).to(x_BTD.dtype)
        return self.o_proj(out.reshape(batch, length, heads * head_dim))


class KCPGatedMLA(GatedMLA):
    """``GatedMLA`` attending over the all-gathered latents of ranks 0..r (class swapped in place)."""

    _kcp: _KCPContext

    def forward(self, x_BTD: torch.Tensor, state=None, cu_seqlens: torch.Tensor | None = None,
                absorbed: bool | None = None) -> torch.Tensor:
        _check_plain("MLA", state, cu_seqlens)
        q_BTHK = self.wq_b(self.q_norm(self.wq_a(x_BTD))).unflatten(-1, (self.num_heads, -1))
        kv_BSC, mask_TS = kcp_mla_latents(self.latents(x_BTD), self._kcp.group, self._kcp.lengths)
        attend = self._absorbed if absorbed else self._naive
        out_BTHV = attend(q_BTHK, kv_BSC, mask_TS)
        return self.wo(out_BTHV.flatten(-2) * torch.sigmoid(self.gate(x_BTD)))


class KCPForCausalLM(K3ForCausalLM):
    """``K3ForCausalLM`` on one contiguous segment per rank (class swapped in place).

    ``labels`` must be shifted on the *global* sequence before splitting (``labels[t]`` is the target
    of global position t, so the last token of rank r carries the first input of rank r+1); use
    ``shard_sequence`` on both. The losses returned are this rank's *shares* of the global losses:
    sum over local tokens / number of counted tokens in the whole group, so the group's shares add
    up to the single-process loss and gradients must be SUMMED over the group (not averaged).
    """

    _kcp: _KCPContext

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, cache=None,
                cu_seqlens: torch.Tensor | None = None, last_only: bool = False) -> K3Output:
        _check_plain("model", cache, cu_seqlens)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        group = self._kcp.group
        _, world = _rank_world(group)
        meta = torch.tensor([input_ids.shape[1], input_ids.shape[0]], dtype=torch.int64, device=input_ids.device)
        metas = [torch.empty_like(meta) for _ in range(world)]
        dist.all_gather(metas, meta, group=group)
        lengths, batches = [int(m[0]) for m in metas], {int(m[1]) for m in metas}
        if len(batches) != 1:
            raise ValueError(f"context parallel: every rank needs the same batch size, got {sorted(batches)}")
        if min(lengths) < 1:
            raise ValueError(f"context parallel: every rank needs at least one token, got lengths {lengths}")
        self._kcp.lengths = lengths
        try:
            out = super().forward(input_ids, cache=None, cu_seqlens=None, last_only=last_only)
            if labels is not None:
                if last_only:
                    raise ValueError("labels need logits for every position: drop last_only")
                self._losses(out, input_ids, labels, lengths)
        finally:
            self._kcp.lengths = None
        return out

    def _losses(self, out: K3Output, input_ids: torch.Tensor, labels: torch.Tensor, lengths: list[int]) -> None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}")
        group = self._kcp.group
        rank, world = _rank_world(group)
        main_sum = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        counts = torch.stack([(labels != IGNORE_INDEX).sum(), labels.new_zeros(())]).to(torch.float64)

        use_mtp = self.mtp is not None and sum(lengths) > 1
        if use_mtp:
            # Position t sees h_t and x_{t+1} (= labels[t]) and predicts x_{t+2} (= labels[t+1]). The
            # last local position's target is the next rank's first label; the global last position
            # has none (single-process drops it; here it is kept with an ignored target, which
            # changes nothing else: every layer is causal and the MoE is per token).
            first = labels[:, :1].contiguous()
            firsts = [torch.empty_like(first) for _ in range(world)]
            dist.all_gather(firsts, first, group=group)
            after = firsts[rank + 1] if rank + 1 < world else torch.full_like(first, IGNORE_INDEX)
            targets = torch.cat([labels[:, 1:], after], dim=1).masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX)
            mtp_hidden = self.mtp(out.hidden, self.embed(labels.clamp(min=0)), None)
            mtp_sum = F.cross_entropy(self.head(mtp_hidden).flatten(0, 1).float(), targets.flatten(),
                                      ignore_index=IGNORE_INDEX, reduction="sum")
            counts[1] = (targets != IGNORE_INDEX).sum()
        dist.all_reduce(counts, group=group)  # counted tokens over the whole group (no gradient)
        out.main_loss = main_sum / counts[0].to(main_sum.dtype)
        out.loss = out.main_loss
        if use_mtp:
            out.mtp_loss = mtp_sum / counts[1].to(mtp_sum.dtype)
            out.loss = out.main_loss + self.config.mtp.loss_weight * out.mtp_loss

    def generate(self, *args, **kwargs):  # type: ignore[override]
        raise ValueError("context parallel: generate() needs a cache, which KCP does not support; "
                         "decode with the single-process model")


def apply_context_parallel(model: K3ForCausalLM, group: dist.ProcessGroup | None = None) -> K3ForCausalLM:
    """Make ``model`` run context parallel over ``group``, in place, without touching model code.

    Mechanism: class swap. Every ``KDA`` and ``GatedMLA`` module (the MTP block's included) gets its
    ``__class__`` replaced by the subclass ``KCPKDA`` / ``KCPGatedMLA`` whose forward does the KCP
    exchanges, and the model itself becomes ``KCPForCausalLM`` (global segment lengths, border labels
    for MTP, loss shares). Parameters, buffers and state-dict keys are untouched, so checkpoints and
    optimizers see the same model. Apply it first (before expert parallelism, activation checkpointing
    and FSDP2, which wrap or subclass whatever class they find).

    Contract per rank: ``model(input_ids_local, labels_local)`` with the rank's contiguous segment of
    every row (``shard_sequence``); ``loss`` is the rank's share, backpropagate it on every rank and
    sum parameter gradients over ``group``. Caches, ``cu_seqlens`` and ``generate`` raise ValueError.
    """
    if not isinstance(model, K3ForCausalLM):
        raise TypeError(f"apply_context_parallel expects a K3ForCausalLM, got {type(model).__name__}")
    if getattr(model, "_kcp", None) is not None:
        raise ValueError("apply_context_parallel: the model is already context parallel")
    if not dist.is_initialized():
        raise RuntimeError("apply_context_parallel: torch.distributed is not initialised")
    ctx = _KCPContext(group)
    for module in model.modules():
        if type(module) is KDA:
            module.__class__ = KCPKDA
        elif type(module) is GatedMLA:
            module.__class__ = KCPGatedMLA
        else:
            continue
        module._kcp = ctx
    model.__class__ = KCPForCausalLM
    model._kcp = ctx
    return model


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1,
                   lengths: list[int] | None = None) -> torch.Tensor:
    """This rank's contiguous segment of ``x`` along ``dim`` (tokens): ``lengths`` per rank, or as even
    as possible (the first T % P ranks get one more). Shift labels on the global sequence first."""
    rank, world = _rank_world(group)
    total = x.shape[dim]
    if lengths is None:
        lengths = [total // world + (1 if r < total % world else 0) for r in range(world)]
    if len(lengths) != world or sum(lengths) != total:
        raise ValueError(f"shard_sequence: lengths {lengths} must be {world} numbers summing to {total}")
    return x.narrow(dim, sum(lengths[:rank]), lengths[rank])

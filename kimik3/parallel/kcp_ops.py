"""The KDA context-parallel ops (KCP, notes §7): one rank's share of KDA, the short conv and MLA's latents
when every sequence is split into contiguous segments, one per rank. ``kimik3.parallel.kcp`` installs them
into a model; they also work on bare tensors.

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
own loss share; see ``kimik3.parallel.kcp.apply_context_parallel``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kimik3.model.conv import short_conv
from kimik3.ops.kda import chunk_kda

__all__ = ["kcp_conv_state", "kcp_kda", "kcp_mla_latents", "kcp_short_conv", "rank_world", "segment_lengths"]


# ---------------------------------------------------------------------------------------------
# differentiable exchanges
# ---------------------------------------------------------------------------------------------


def rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(this rank's index in ``group``, the group's size); None is the default group."""
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
        rank, _ = rank_world(group)
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
    rank, world = rank_world(group)
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
    _, world = rank_world(group)
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
    **options,
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
        options: passed on to ``chunk_kda`` (``chunk_size``, ``backend``, and the fused pre-activations:
            ``A_log``, ``dt_bias``, ``lower_bound``, ``use_gate_in_kernel``, ``use_qk_l2norm_in_kernel``,
            ``use_beta_sigmoid_in_kernel``). They act per token, so they commute with the split.

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
    rank, world = rank_world(group)
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
                                 output_final_state=True, **options)
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


def kcp_conv_state(
    x_BTC: torch.Tensor,
    width: int,
    group: dist.ProcessGroup | None = None,
    lengths: list[int] | None = None,
) -> torch.Tensor | None:
    """The short conv's state entering this rank's segment: the previous rank's last W-1 inputs,
    [B, C, W-1] in x's dtype (zeros on rank 0; None when W = 1, where there is nothing to exchange).

    Sent point-to-point; the gradient returns the same way. Every rank but the last needs T >= W-1
    (the W-1 inputs before a segment then all lie on the previous rank); ``lengths`` (every rank's T,
    as from ``segment_lengths``) lets all ranks check that together, else each checks its own.
    """
    if width == 1:
        return None
    rank, world = rank_world(group)
    need = width - 1
    too_short = ([r for r, n in enumerate(lengths[:-1]) if n < need] if lengths is not None
                 else ([rank] if rank < world - 1 and x_BTC.shape[1] < need else []))
    if too_short:
        raise ValueError(f"context-parallel short conv: ranks {too_short} hold fewer than W-1 = {need} "
                         "tokens; every rank but the last needs at least W-1 tokens")
    # The last min(T, W-1) inputs, left-padded: the last rank sends nothing, but its tail still
    # depends on x so that the exchange's backward (which sends to rank r-1) runs there too.
    tail_BWC = x_BTC[:, max(x_BTC.shape[1] - need, 0):]
    if tail_BWC.shape[1] < need:
        tail_BWC = torch.cat([tail_BWC.new_zeros(x_BTC.shape[0], need - tail_BWC.shape[1], x_BTC.shape[2]),
                              tail_BWC], dim=1)
    return _ShiftRight.apply(tail_BWC, group).transpose(1, 2)


def kcp_short_conv(
    x_BTC: torch.Tensor,
    weight_CW: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    activation: bool = True,
    lengths: list[int] | None = None,
) -> torch.Tensor:
    """Context-parallel ``short_conv``: the causal depthwise conv of this rank's segment, seeded with
    ``kcp_conv_state`` (the previous rank's last W-1 inputs).

    x_BTC [B, T, C], weight_CW [C, W] -> y [B, T, C] in x's dtype.
    """
    state_BCW = kcp_conv_state(x_BTC, weight_CW.shape[1], group, lengths)
    return short_conv(x_BTC, weight_CW, state_BCW, activation=activation)[0]


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
    rank, _ = rank_world(group)
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

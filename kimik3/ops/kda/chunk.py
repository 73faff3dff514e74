"""Chunkwise-parallel Kimi Delta Attention (KDA) in plain torch.

The token recurrence (see ``naive.py``) is re-expressed per chunk of C tokens.
Let S0 be the state entering a chunk and Gamma_t = sum_{s <= t in chunk} g_s
the per-channel cumulative log-decay. Unrolling the recurrence gives per-token
"delta values" u_s (rows of U) with

    u_s = beta_s (v_s - S0^T (exp(Gamma_s) * k_s) - sum_{r<s} A[s, r] u_r),
    A[s, r] = sum_c k_s[c] k_r[c] exp(Gamma_s[c] - Gamma_r[c]),

i.e. (I + diag(beta) A_strict) U = diag(beta) (V - K_gamma S0), and then

    o_t   = S0^T (exp(Gamma_t) * q_t) + sum_{s <= t} Aqk[t, s] u_s
    S_end = diag(exp(Gamma_C)) S0 + sum_s (exp(Gamma_C - Gamma_s) * k_s) u_s^T

with Aqk[t, s] = sum_c q_t[c] k_s[c] exp(Gamma_t[c] - Gamma_s[c]) and q already
scaled. One unit-lower-triangular solve per chunk gives
T = (I + diag(beta) A_strict)^-1 diag(beta), W = T K_gamma and U0 = T V, so
U = U0 - W S0.

Everything except S0 is local to a chunk, so it is computed for all chunks of
all sequences in one batch (padded per sequence so no chunk straddles two).
The only sequential work is a loop over the chunk index j: u = U0 - W S0,
then S0 <- diag(exp(Gamma_C)) S0 + K_dec^T u. The outputs
o = Q_gamma S0 + Aqk U are formed afterwards in one batched matmul.

Overflow and the bounded gate
-----------------------------
exp(Gamma_t - Gamma_s) for s <= t is <= 1, but factoring it into a row term
times a column term (so the intra-chunk products become dense matmuls) can
overflow. Each chunk is split into sub-tiles of ``SUBTILE`` = 16 tokens; row
sub-tile i gets the reference rho_i = Gamma at its first token. Rows carry
q_t exp(Gamma_t - rho_i) in (e^-75, 1]; column s (tiles <= i only: the
exponent of later tiles is set to -inf before exponentiating, so they are
exactly zero) carries k_s exp(rho_i - Gamma_s), which is <= e^75 on the
diagonal tile and <= 1 on earlier tiles j, where it is evaluated as
exp(rho_i - eps_j) * exp(eps_j - Gamma_s) (eps_j = Gamma at the last token of
tile j, both factors <= 1) so only a small per-tile-pair factor depends on i.
One batched matmul of [.., I row tiles, R, K] x [.., I, K, C] then gives all of
Aqk (and of A with k rows); the causal mask is applied afterwards.

Kimi K3 bounds the log-decay as g = g_min * sigmoid(.) with g_min = -5, so a
16-token tile accumulates at most -80 and every factor above is finite in
float32 (max ~e^88.7), which is what this module computes in whatever the
input dtype. That bound is the caller's contract and is not enforced: gates
well below g_min (about -88/15 ~ -5.9 sustained over a tile) overflow the
diagonal-tile factor to inf and produce NaN, and g = -inf always does. NaN or
+inf in g is rejected with ValueError. The inter-chunk factors exp(Gamma_t),
exp(Gamma_C - Gamma_s) and exp(Gamma_C) are <= 1 and never overflow.

Shape legend (suffixes on tensor names):
    B  batch size                      T  sequence length
    H  heads                           K  key / query head dim
    V  value head dim                  N  independent sequences
    C  chunk size (tokens)             n  total number of chunks, all sequences
    I  sub-tiles per chunk (C / 16)    R  rows per sub-tile (16)
    J  column tiles (same range as I)  P  packed tokens (B * T)
    X  flattened (sequence, head) pairs of one chunk step
"""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .naive import check_kda_inputs

__all__ = ["chunk_kda_torch", "SUBTILE"]

# Rows of one intra-chunk sub-tile. With gates >= g_min = -5, 16 tokens
# accumulate at most -80 in log space, so every factor built against a tile
# reference stays within [e^-80, e^80] (the diagonal tile's column factor is
# at most e^75): finite in float32, and in bf16 too (same exponent range).
# Larger tiles break the bound (32 tokens -> e^155); smaller ones only add
# matmul overhead.
SUBTILE = 16

# exp() of a float32 below ~-87.3 is subnormal or zero, and torch's CPU
# vectorised exp falls back to a ~10-30x slower path there. Exponents of
# factors that only ever *shrink* a term (all <= 1) are floored here: e^-80 is
# far below float32 resolution of the order-one terms they are summed with.
_LOG_FLOOR = -80.0


class _Layout(NamedTuple):
    """Where every packed token goes among the padded chunks, and back.

    Chunks are ordered step-major: all sequences' chunk 0, then chunk 1, ...
    Sequences are sorted by chunk count (descending) so the sequences still
    running at step j are always a prefix; the sequential loop then works on
    contiguous slices with no per-step gathers.
    """

    gather_nHC: torch.Tensor  # index into [(P + 1) * H] rows; pad token = P
    scatter_PH: torch.Tensor  # index into [n * H * C] rows for every real (token, head)
    seq_order_N: torch.Tensor  # sorted position -> original sequence index
    seq_rank_N: torch.Tensor  # original sequence index -> sorted position
    step_counts: Tuple[int, ...]  # sequences still running at each chunk step
    has_pad: bool
    identity_order: bool


@functools.lru_cache(maxsize=64)
def _build_layout(
    seq_starts: Tuple[int, ...], seq_lens: Tuple[int, ...], P: int, H: int, C: int, device: torch.device
) -> _Layout:
    N = len(seq_lens)
    starts_N = torch.tensor(seq_starts, dtype=torch.long)
    lens_N = torch.tensor(seq_lens, dtype=torch.long)
    chunks_N = (lens_N + C - 1) // C
    order_N = torch.argsort(chunks_N, descending=True, stable=True)
    rank_N = torch.empty_like(order_N)
    rank_N[order_N] = torch.arange(N)
    sorted_chunks_N = chunks_N[order_N]
    max_chunks = int(sorted_chunks_N[0]) if N else 0
    counts_J = (sorted_chunks_N[None, :] > torch.arange(max_chunks)[:, None]).sum(1)
    n = int(counts_J.sum())

    step_of_n = torch.repeat_interleave(torch.arange(max_chunks), counts_J)
    rank_of_n = torch.arange(n) - (torch.cumsum(counts_J, 0) - counts_J)[step_of_n]
    seq_of_n = order_N[rank_of_n]
    pos_nC = step_of_n[:, None] * C + torch.arange(C)[None, :]
    real_nC = pos_nC < lens_N[seq_of_n][:, None]
    tok_nC = torch.where(real_nC, starts_N[seq_of_n][:, None] + pos_nC, torch.full_like(pos_nC, P))
    gather_nHC = tok_nC[:, None, :] * H + torch.arange(H)[None, :, None]

    # Inverse map: real token p sits in chunk c at slot i -> row (c * H + h) * C + i.
    chunk_slot_P = torch.empty(P, dtype=torch.long)
    slot_nC = torch.arange(n)[:, None] * (H * C) + torch.arange(C)[None, :]
    chunk_slot_P[tok_nC[real_nC]] = slot_nC[real_nC]
    scatter_PH = chunk_slot_P[:, None] + torch.arange(H)[None, :] * C

    return _Layout(
        gather_nHC.reshape(-1).to(device),
        scatter_PH.reshape(-1).to(device),
        order_N.to(device),
        rank_N.to(device),
        tuple(int(c) for c in counts_J),
        bool((~real_nC).any()),
        bool(torch.equal(order_N, torch.arange(N))),
    )


def _to_chunks(x_PHD: torch.Tensor, layout: _Layout, n: int, C: int) -> torch.Tensor:
    """[P, H, D] packed tokens -> [n, H, C, D] chunks (zero rows in padded slots)."""
    P, H, D = x_PHD.shape
    x_rows = x_PHD.reshape(P * H, D)
    if layout.has_pad:
        x_rows = torch.cat([x_rows, x_rows.new_zeros(H, D)])
    return x_rows.index_select(0, layout.gather_nHC).view(n, H, C, D)


class _ExpPair(torch.autograd.Function):
    """(exp(x), exp(-x)) for the price of one exp: the second is 1 / the first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        e = torch.exp(x)
        r = torch.reciprocal(e)
        ctx.save_for_backward(e, r)
        return e, r

    @staticmethod
    def backward(ctx, grad_e: torch.Tensor, grad_r: torch.Tensor) -> torch.Tensor:
        e, r = ctx.saved_tensors
        return grad_e * e - grad_r * r


def _intra_chunk(
    q_nHCK: torch.Tensor,
    k_nHCK: torch.Tensor,
    v_nHCV: torch.Tensor,
    g_nHCK: torch.Tensor,
    beta_nHC: torch.Tensor,
) -> Tuple[torch.Tensor, ...]:
    """Per-chunk quantities, all chunks at once (float32, q pre-scaled).

    Returns:
        q_gam [n,H,C,K]: exp(Gamma_t) * q_t.
        aqk [n,H,C,C]: Aqk (lower triangular, diagonal included).
        w [n,H,C,K], u0 [n,H,C,V]: a chunk entered with S0 has u = u0 - w S0.
        k_dec [n,H,C,K]: exp(Gamma_C - Gamma_s) * k_s.
        decay_end [n,H,K]: exp(Gamma_C).
    Then o = q_gam S0 + Aqk u and S_end = decay_end * S0 + k_dec^T u.

    Temporaries are dropped as soon as they are consumed: without autograd
    that keeps the working set small, and fresh multi-megabyte allocations are
    slow on CPU (first-touch page faults).
    """
    n, H, C, K = q_nHCK.shape
    I, R = C // SUBTILE, SUBTILE
    dev = q_nHCK.device
    ii = torch.arange(I, device=dev)
    not_before_IJ1 = (ii[:, None] <= ii[None, :]).unsqueeze(-1)  # tile pairs with j >= i
    strict_IRC = torch.ones(C, C, device=dev, dtype=q_nHCK.dtype).tril(-1).view(I, R, C)

    # Log-decays relative to tile boundaries come from a within-tile cumsum
    # and exact segment sums of tile totals, never from differences of the
    # chunk-long running sum (magnitude up to C * 5): those would put ~1e-5
    # absolute rounding into exponents that are small exactly when their term
    # matters. Every quantity a row tile uses depends only on tokens up to
    # that row, so causality holds bit for bit, not just up to rounding.
    g_nHIRK = g_nHCK.view(n, H, I, R, K)
    lc_nHIRK = torch.cumsum(g_nHIRK, dim=3)
    first_nHI1K = g_nHIRK[:, :, :, :1]  # g at each tile's first token
    tot_nHI1K = lc_nHIRK[:, :, :, -1:].clone()  # each tile's total log-decay (a copy: lc is freed early)
    tot_nHIK = tot_nHI1K.squeeze(3)
    # seg[i, j] = sum of tot_m over j < m <= i (zero unless j < i);
    # prev_seg[i, j] = sum over j < m < i.
    seg_nHIJK = torch.cumsum(tot_nHIK.unsqueeze(3).expand(n, H, I, I, K).masked_fill(not_before_IJ1, 0.0), dim=2)
    prev_seg_nHIJK = F.pad(seg_nHIJK[:, :, :-1], (0, 0, 0, 0, 1, 0))
    rho_nHIK = (  # Gamma at each tile's first token
        first_nHI1K.squeeze(3) + prev_seg_nHIJK[:, :, :, 0] + torch.where((ii > 0)[:, None], tot_nHIK[:, :, :1], 0.0)
    )
    decay_end_nHK = torch.exp((seg_nHIJK[:, :, -1, 0] + tot_nHIK[:, :, 0]).clamp_min(_LOG_FLOOR))
    to_end_nHJK = seg_nHIJK[:, :, -1].clamp_min(_LOG_FLOOR)  # Gamma_C - eps_j

    # Per-token factors. Rows: exp(Gamma_t - rho_i) in (e^-75, 1]. Columns
    # within their own tile: exp(rho_i - Gamma_s) in [1, e^75]. Columns seen
    # from later tiles and by the state update: exp(eps_j - Gamma_s) in
    # [e^-75, 1], eps_j = Gamma at the last token of tile j.
    row_f_nHIRK, diag_f_nHIRK = _ExpPair.apply(lc_nHIRK - first_nHI1K)
    q_nHIRK = q_nHCK.view(n, H, I, R, K)
    k_nHIRK = k_nHCK.view(n, H, I, R, K)
    qk_dot_nHIR = (q_nHIRK * k_nHIRK).sum(-1)
    # q rows and k rows of a tile share one matmul against its columns.
    rows_nHI2RK = torch.stack([q_nHIRK, k_nHIRK], dim=3).mul_(row_f_nHIRK.unsqueeze(3))
    k_diag_nHIRK = k_nHIRK * diag_f_nHIRK
    k_cols_nHJRK = k_nHIRK * (tot_nHI1K - lc_nHIRK).exp_()
    del lc_nHIRK, row_f_nHIRK, diag_f_nHIRK

    # Columns for row tile i: k_s exp(rho_i - Gamma_s) over tiles j <= i.
    # Earlier tiles get it as exp(rho_i - eps_j) * exp(eps_j - Gamma_s), both
    # <= 1 (the floor only touches the first and can only shrink a term);
    # tile i itself uses k_diag. Pairs j >= i of the tile-pair factor are set
    # to -inf *before* exp: future tiles are exactly zero, nothing overflows.
    shift_nHIJK = (first_nHI1K + prev_seg_nHIJK).clamp_min(_LOG_FLOOR)  # rho_i - eps_j
    shift_nHIJK = shift_nHIJK.masked_fill_(not_before_IJ1, float("-inf")).exp_()
    cols_nHIJRK = shift_nHIJK.unsqueeze(4) * k_cols_nHJRK.unsqueeze(2)
    cols_nHIJRK.diagonal(dim1=2, dim2=3).add_(k_diag_nHIRK.permute(0, 1, 3, 4, 2))
    del shift_nHIJK, k_diag_nHIRK
    # One batched matmul: [n,H, I row tiles, q and k rows, R, K] x [n,H, I, K, C].
    a_nHI2RC = rows_nHI2RK.view(n, H, I, 2 * R, K) @ cols_nHIJRK.view(n, H, I, C, K).transpose(-1, -2)
    del cols_nHIJRK
    a_nHI2RC = a_nHI2RC.view(n, H, I, 2, R, C).mul_(strict_IRC.unsqueeze(1))  # causal: s < t
    aqk_nHCC = a_nHI2RC[:, :, :, 0].reshape(n, H, C, C)
    # Aqk[t, t] = q_t . k_t carries no decay: taking it directly, not as
    # exp(x) * exp(-x), keeps its zero dependence on g exact (dg is tiny when
    # gates are strong, and that rounding would dominate it).
    aqk_nHCC.diagonal(dim1=-2, dim2=-1).add_(qk_dot_nHIR.view(n, H, C))
    lkk_nHCC = (a_nHI2RC[:, :, :, 1] * beta_nHC.view(n, H, I, R, 1)).view(n, H, C, C)  # diag(beta) A_strict
    del a_nHI2RC

    # Inter-chunk factors relative to the chunk start / end, all <= 1.
    dec_start_nHI1K = torch.exp(rho_nHIK.clamp_min(_LOG_FLOOR)).unsqueeze(3)  # exp(rho_i)
    q_gam_nHCK = (rows_nHI2RK[:, :, :, 0] * dec_start_nHI1K).view(n, H, C, K)
    k_gam_nHCK = (rows_nHI2RK[:, :, :, 1] * dec_start_nHI1K).view(n, H, C, K)
    del rows_nHI2RK
    k_dec_nHCK = (k_cols_nHJRK * torch.exp(to_end_nHJK).unsqueeze(3)).view(n, H, C, K)
    del k_cols_nHJRK

    # T = (I + diag(beta) A_strict)^-1 diag(beta) (unit lower triangular
    # solve; the identity is implied, never materialised), then the two
    # right-hand sides as plain matmuls: W = T K_gamma, U0 = T V.
    eye_CC = torch.eye(C, device=dev, dtype=lkk_nHCC.dtype)
    t_nHCC = torch.linalg.solve_triangular(lkk_nHCC, eye_CC.expand_as(lkk_nHCC), upper=False, unitriangular=True)
    t_nHCC = t_nHCC * beta_nHC.unsqueeze(-2)
    w_nHCK = t_nHCC @ k_gam_nHCK
    u0_nHCV = t_nHCC @ v_nHCV
    return q_gam_nHCK, aqk_nHCC, w_nHCK, u0_nHCV, k_dec_nHCK, decay_end_nHK


def _inter_chunk(
    w_nHCK: torch.Tensor,
    u0_nHCV: torch.Tensor,
    k_dec_nHCK: torch.Tensor,
    decay_end_nHK: torch.Tensor,
    state_NHKV: torch.Tensor,
    step_counts: Tuple[int, ...],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Carry the state through the chunks: the only sequential loop.

    Chunks are step-major and sequences sorted so that the ones still running
    at step j are the first step_counts[j]; the others keep their state.

    Returns (u [n,H,C,V], entry state of every chunk [n,H,K,V], final
    states [N,H,K,V]).
    """
    n, H, C, K = w_nHCK.shape
    V = u0_nHCV.shape[-1]
    N = state_NHKV.shape[0]
    X = N * H
    if all(m == N for m in step_counts):
        # Every sequence has every chunk: plain per-step views, no slicing.
        w_steps = w_nHCK.view(-1, X, C, K).unbind(0)
        u0_steps = u0_nHCV.view(-1, X, C, V).unbind(0)
        k_dec_T_steps = k_dec_nHCK.view(-1, X, C, K).transpose(-1, -2).unbind(0)
        decay_steps = decay_end_nHK.view(-1, X, K, 1).unbind(0)
    else:
        w_steps = [x.reshape(-1, C, K) for x in w_nHCK.split(step_counts)]
        u0_steps = [x.reshape(-1, C, V) for x in u0_nHCV.split(step_counts)]
        k_dec_T_steps = [x.reshape(-1, C, K).transpose(-1, -2) for x in k_dec_nHCK.split(step_counts)]
        decay_steps = [x.reshape(-1, K, 1) for x in decay_end_nHK.split(step_counts)]

    u_list: List[torch.Tensor] = []
    entry_list: List[torch.Tensor] = []
    state_XKV = state_NHKV.reshape(X, K, V)
    for j, m in enumerate(step_counts):
        s_XKV = state_XKV if m == N else state_XKV[: m * H]
        entry_list.append(s_XKV)
        u_XCV = torch.baddbmm(u0_steps[j], w_steps[j], s_XKV, alpha=-1.0)
        u_list.append(u_XCV)
        s_new = torch.baddbmm(s_XKV * decay_steps[j], k_dec_T_steps[j], u_XCV)
        state_XKV = s_new if m == N else torch.cat([s_new, state_XKV[m * H :]])
    u_nHCV = torch.cat(u_list).view(n, H, C, V)
    entry_nHKV = torch.cat(entry_list).view(n, H, K, V)
    return u_nHCV, entry_nHKV, state_XKV.view(N, H, K, V)


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunkwise-parallel KDA in torch (any device), differentiable by autograd.

    Args:
        q, k: [B, T, H, K] queries / keys (any float dtype).
        v: [B, T, H, V] values.
        g: [B, T, H, K] per-channel log-decay (natural log). Must satisfy the
            K3 bound g >= -5 (see module docstring); NaN / +inf rejected.
        beta: [B, T, H] write strength in (0, 1).
        scale: multiplier on q; default K ** -0.5.
        initial_state: optional [N, H, K, V] entry state per sequence (cast to
            float32); zeros when omitted.
        output_final_state: also return the per-sequence final state.
        cu_seqlens: optional [N + 1] integer offsets of packed sequences
            (requires B == 1); the state restarts at every sequence start.
        chunk_size: tokens per chunk, a positive multiple of 16.

    Returns:
        o: [B, T, H, V] in v's dtype.
        final_state: [N, H, K, V] float32, or None unless output_final_state.

    Arithmetic is float32. Gradients flow to q, k, v, g, beta, initial_state.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % SUBTILE:
        raise ValueError(f"chunk_size must be a positive multiple of {SUBTILE}, got {chunk_size!r}")
    p = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K, V, N = p.B, p.T, p.H, p.K, p.V, p.N
    C, P = chunk_size, p.B * p.T
    if scale is None:
        scale = K**-0.5

    if cu_seqlens is None:
        seq_starts = tuple(b * T for b in range(B))
    else:
        seq_starts = tuple(bos for bos, _ in p.seq_bounds)
    seq_lens = tuple(eos - bos for bos, eos in p.seq_bounds)
    layout = _build_layout(seq_starts, seq_lens, P, H, C, q.device)
    n = sum(layout.step_counts)

    if initial_state is not None:
        state_NHKV = initial_state.float()
        if not layout.identity_order:
            state_NHKV = state_NHKV.index_select(0, layout.seq_order_N)
    else:
        state_NHKV = q.new_zeros(N, H, K, V, dtype=torch.float32)

    if n == 0:  # every sequence is empty
        o_BTHV = v.new_zeros(B, T, H, V)
        return o_BTHV, (state_NHKV.clone() if output_final_state else None)

    # Padded slots get q = k = v = beta = 0 and g = 0: no decay and no write,
    # so padding leaves every sequence's final state exact.
    q_nHCK = _to_chunks(q.reshape(P, H, K).float(), layout, n, C).mul_(scale)
    k_nHCK = _to_chunks(k.reshape(P, H, K).float(), layout, n, C)
    v_nHCV = _to_chunks(v.reshape(P, H, V).float(), layout, n, C)
    g_nHCK = _to_chunks(g.reshape(P, H, K).float(), layout, n, C)
    beta_nHC = _to_chunks(beta.reshape(P, H, 1).float(), layout, n, C).squeeze(-1)

    q_gam_nHCK, aqk_nHCC, w_nHCK, u0_nHCV, k_dec_nHCK, decay_end_nHK = _intra_chunk(
        q_nHCK, k_nHCK, v_nHCV, g_nHCK, beta_nHC
    )
    del q_nHCK, k_nHCK, v_nHCV, g_nHCK, beta_nHC  # free early (see _intra_chunk)
    u_nHCV, entry_nHKV, final_NHKV = _inter_chunk(
        w_nHCK, u0_nHCV, k_dec_nHCK, decay_end_nHK, state_NHKV, layout.step_counts
    )
    del w_nHCK, u0_nHCV, k_dec_nHCK

    o_XCV = torch.baddbmm(
        (aqk_nHCC @ u_nHCV).view(n * H, C, V), q_gam_nHCK.view(n * H, C, K), entry_nHKV.view(n * H, K, V)
    )
    o_PHV = o_XCV.view(n * H * C, V).index_select(0, layout.scatter_PH)
    o_BTHV = o_PHV.view(B, T, H, V).to(v.dtype)

    final_state = None
    if output_final_state:
        final_state = final_NHKV
        if not layout.identity_order:
            final_state = final_state.index_select(0, layout.seq_rank_N)
    return o_BTHV, final_state

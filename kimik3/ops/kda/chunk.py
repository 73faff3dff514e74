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

with Aqk[t, s] = sum_c q_t[c] k_s[c] exp(Gamma_t[c] - Gamma_s[c]) and q
unscaled (the output is multiplied by ``scale`` at the end). With
L = I + diag(beta) A_strict (unit lower triangular), [W, U0] =
L^-1 [diag(beta) K_gamma, diag(beta) V] gives U = U0 - W S0, so a chunk's
action on the state is one affine map, computed for all chunks at once:

    S_end = M S0 + B,    M = diag(exp(Gamma_C)) - K_dec^T W,    B = K_dec^T U0

(K_dec = exp(Gamma_C - Gamma_s) * k_s). The only sequential work across
chunks is one batched [K, K] x [K, V] matmul-add per chunk step.

Sub-tiles and tile-level states
-------------------------------
exp(Gamma_t - Gamma_s) for s <= t is <= 1, but factoring it into a row term
times a column term (so that products become dense matmuls) can overflow.
Each chunk is split into I sub-tiles of ``SUBTILE`` = 16 tokens; eps_i is
Gamma at the last token of tile i (eps_-1 = 0) and tau_i = eps_i - eps_{i-1}
the tile's total. Per token:

    rows          x_t exp(Gamma_t - eps_{i-1})   in [e^-80, 1] |x_t|   (x = q, beta k)
    own-tile cols k_s exp(eps_{j-1} - Gamma_s)   in [1, e^80] |k_s|
    kc2           k_s exp(eps_j - Gamma_s)       in [e^-80, 1] |k_s|

Aqk and A are only ever formed on the diagonal tiles (rows x own-tile
columns, one batched 16 x 16 matmul, masked). Everything left of the
diagonal tiles enters through tile-level states that follow an I-step
recurrence per chunk (batched over all chunks), each step a product with
exp(tau_i) <= 1:

  * the triangular solve, by block forward substitution: tile i needs
    rk_i F_i with F_i = sum_{j<i} exp(eps_{i-1} - eps_j) kc2_j^T Y_j,
    F_{i+1} = exp(tau_i) F_i + kc2_i^T Y_i; the 16 x 16 diagonal tiles of L
    are inverted by a 15-step forward substitution vectorised over all tiles;
  * the outputs: H_0 = S0, H_{i+1} = exp(tau_i) H_i + kc2_i^T u_i gives
    o_t = (q_t exp(Gamma_t - eps_{i-1})) H_i + own-tile Aqk u.

So the dense intra-chunk products are 16 x 16 x K and K x 16 x V matmuls;
no C x C matrix is ever built. The tile exponents (eps_{i-1}, Gamma_C - eps_j,
Gamma_C, tau_j) are sums of tile totals of one sign, computed exactly (no
differences of the chunk-long running sum, whose rounding would land in
exponents that are small exactly when their term matters), with one small
matmul. Every quantity a row uses depends only on tokens up to that row, so
causality holds bit for bit.

Kimi K3 bounds the log-decay as g = g_min * sigmoid(.) with g_min = -5, so a
16-token tile accumulates at most -80 and every factor above is finite and
normal in float32 (max ~e^88.7), which is what this module computes in
whatever the input dtype. That bound is the caller's contract and is not
enforced: gates well below g_min (about -88/16 = -5.5 sustained over a tile)
overflow the own-tile column factor to inf and produce NaN, and g = -inf
always does. NaN or +inf in g is rejected with ValueError. Inter-tile factors
are <= 1 and never overflow; those that only ever shrink a term are floored
at e^-80 (see ``_LOG_FLOOR``).

Log-decays are kept in base 2 internally (one rounding of g * log2(e) per
element, folded into the cumsum matmul) because torch's CPU exp2 is several
times faster than exp at the same accuracy; gradient formulas are in natural
units. Aqk[t, t] = (q_t e_t) . (k_t / e_t) equals q_t . k_t up to rounding,
and the backward treats it as exactly that, with no dependence on g.

Layout: chunks of all sequences are processed in one batch, step-major
(padded per sequence so that no chunk straddles two). With no cu_seqlens and
T a multiple of the chunk size, the inputs are read through strided views
(the layout change is fused into the first elementwise pass); otherwise each
input is gathered with one index_select.

Backward
--------
``_ChunkKDAFunction`` has a hand-written first-order backward that reuses
the forward's tile quantities. Backwards through the chunks, the gradient of
each chunk's entry state is dS = M^T dS_end + Q_eff^T dO, Q_eff = Q_gamma - Aqk W
(again one matmul-add per step). Aqk^T dO and Q_gamma^T dO come from the
transposed tile states (P_{j-1} = Y_j + exp(tau_j) P_j, Y_j = rows_j^T dO_j).
Then, with U = T R (T = L^-1, R = diag(beta) (V - K_gamma S0)):

    dU = Aqk^T dO + K_dec dS_end,     d(diag(beta) V) = T^T dU (block back substitution),
    d(diag(beta) K_gamma) = -T^T dU S0^T,     d(diag(beta) A_strict) = -(T^T dU) U^T,
    dAqk = dO U^T,     dK_dec = U dS_end^T,

where the products with Aqk, A and their gradients again go through tile
states (forward: H_i; backward: P'_{j-1} = g_j^T rows_j + exp(tau_j) P'_j).
The decay gradient is closed-form: every product depends on g only through
exp(Gamma_t - Gamma_s), so with rows X_t = x_t exp(Gamma_t - ref) and columns
k'_s = k_s exp(ref - Gamma_s) (any reference), dGamma_t = X_t * dX_t on the row
side and -k'_s * dk'_s on the column side (the references cancel exactly and
are not differentiated); dg is the suffix sum of dGamma over the chunk.
K_dec's column-side share is taken as exactly the products that also enter
dGamma_C, so where the two cancel (no decay dependence) they cancel exactly.

Shape legend (suffixes on tensor names):
    B  batch size                      T  sequence length
    H  heads                           K  key / query head dim
    V  value head dim                  N  independent sequences
    C  chunk size (tokens)             n  total number of chunks, all sequences
    I  sub-tiles per chunk (C / 16)    R  rows per sub-tile (16)
    J  column tiles (same range as I)  P  packed tokens (B * T)
    X  (chunk, head) pairs: n * H      Y  (sequence, head) pairs of one step
    Z  16 x 16 tiles: X * I            D  right-hand-side width
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from kimik3.ops.precision import no_autocast

from .chunk_backward import _backward
from .chunk_forward import _forward
from .chunk_layout import SUBTILE, _build_layout, _chunk_view, _Plan, _unchunk
from .naive import check_kda_inputs

__all__ = ["chunk_kda_torch", "SUBTILE"]


# --------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------


class _ChunkKDAFunction(torch.autograd.Function):
    """Forward and hand-written first-order backward over chunk-layout tensors.

    Inputs q, k, v, g, beta, state0 (float32 [Y, K, V] in sorted sequence
    order), then scale and the _Plan. Returns o [B, T, H, V] (v's dtype) and
    the final states [N, H, K, V] (float32, sorted order).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state0, scale, plan):  # type: ignore[override]
        keep = any(ctx.needs_input_grad[:6])
        with no_autocast(q.device):  # the chunk arithmetic is fp32 by design, also under autocast
            o, final, saved = _forward(q, k, v, g, beta, state0, plan, keep)
        if keep:
            ctx.plan, ctx.scale = plan, scale
            ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, state0.dtype)
            if plan.fast:
                # The input views alias the inputs: keep the inputs themselves,
                # so autograd's version check catches in-place edits before backward.
                ctx.save_for_backward(q, k, v, beta)
                saved = saved._replace(q=None, k=None, v=None, beta=None)
            ctx.saved = saved
        return _unchunk(o, plan, v.dtype, scale), final.view(-1, plan.H, plan.K, plan.V)

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dfinal):  # type: ignore[override]
        plan, scale, f = ctx.plan, ctx.scale, ctx.saved
        if plan.fast:
            # read once: under activation checkpointing each read of saved_tensors unpacks (recomputes) again, and a
            # second unpack of the same tensors is an error
            q, k, v, beta = ctx.saved_tensors
            f = f._replace(q=_chunk_view(q, plan), k=_chunk_view(k, plan), v=_chunk_view(v, plan),
                           beta=_chunk_view(beta, plan))
        H, K, V, C = plan.H, plan.K, plan.V, plan.C
        X = plan.n * H
        dev = f.e.device
        if do is None:
            dO = torch.zeros(X, C, V, device=dev)
        else:
            dO = torch.empty(X, C, V, device=dev)
            src = _chunk_view(do, plan)
            torch.mul(src, scale, out=dO.view(src.shape))
        if dfinal is None:
            dfinal = torch.zeros(plan.N * H, K, V, device=dev)
        dfinal = dfinal.float().reshape(-1, K, V)
        with no_autocast(dev):
            dq, dk, dv, dg, dbeta, dstate0 = _backward(f, dO, dfinal, plan)
        dt = ctx.dtypes
        grads = [
            _unchunk(dq, plan, dt[0]),
            _unchunk(dk, plan, dt[1]),
            _unchunk(dv, plan, dt[2]),
            _unchunk(dg, plan, dt[3]),
            _unchunk(dbeta.unsqueeze(-1), plan, dt[4]).squeeze(-1),
            dstate0.view(-1, H, K, V).to(dt[5]),
        ]
        need = ctx.needs_input_grad[:6]
        return tuple(x if nd else None for x, nd in zip(grads, need)) + (None, None)


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
    """Chunkwise-parallel KDA in torch (any device), with a hand-written backward.

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

    Arithmetic is float32. Gradients flow to q, k, v, g, beta, initial_state
    (first order: the backward is not itself differentiable).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % SUBTILE:
        raise ValueError(f"chunk_size must be a positive multiple of {SUBTILE}, got {chunk_size!r}")
    p = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K, V, N = p.B, p.T, p.H, p.K, p.V, p.N
    C, P = chunk_size, p.B * p.T
    if scale is None:
        scale = K**-0.5

    order = rank = None
    if cu_seqlens is None and T > 0 and T % C == 0:
        plan = _Plan(B, T, H, K, V, N, C, B * (T // C), True, None, (B,) * (T // C))
    else:
        if cu_seqlens is None:
            seq_starts = tuple(b * T for b in range(B))
        else:
            seq_starts = tuple(bos for bos, _ in p.seq_bounds)
        seq_lens = tuple(eos - bos for bos, eos in p.seq_bounds)
        layout = _build_layout(seq_starts, seq_lens, P, H, C, q.device)
        plan = _Plan(B, T, H, K, V, N, C, sum(layout.step_counts), False, layout, layout.step_counts)
        if not layout.identity_order:
            order, rank = layout.seq_order_N, layout.seq_rank_N

    if initial_state is not None:
        state0 = initial_state if order is None else initial_state.index_select(0, order)
        state0 = state0.float()
    else:
        state0 = q.new_zeros(N, H, K, V, dtype=torch.float32)

    if plan.n == 0:  # every sequence is empty
        o_BTHV = v.new_zeros(B, T, H, V)
        final = initial_state.float().clone() if initial_state is not None else state0
        return o_BTHV, (final if output_final_state else None)

    o_BTHV, final = _ChunkKDAFunction.apply(q, k, v, g, beta, state0, float(scale), plan)
    final_state = None
    if output_final_state:
        final_state = final if rank is None else final.index_select(0, rank)
    return o_BTHV, final_state

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

import functools
import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from kimik3.ops.precision import no_autocast

from .naive import check_kda_inputs

__all__ = ["chunk_kda_torch", "SUBTILE"]

# Rows of one intra-chunk sub-tile. With gates >= g_min = -5, 16 tokens
# accumulate at most -80 in log space, so every factor built against a tile
# reference stays within [e^-80, e^80]: finite and normal in float32. Larger
# tiles break the bound (32 tokens -> e^160); smaller ones only add overhead.
SUBTILE = 16

# exp() of a float32 below ~-87.3 is subnormal or zero, and torch's CPU
# vectorised exp falls back to a ~10-30x slower path there. Exponents of
# factors that only ever *shrink* a term (all <= 1) are floored here: e^-80 is
# far below float32 resolution of the order-one terms they are summed with.
_LOG_FLOOR = -80.0
_LOG2E = 1.0 / math.log(2.0)
_LOG2_FLOOR = _LOG_FLOOR * _LOG2E  # the same floor in base 2


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


class _Consts(NamedTuple):
    tri_RR: torch.Tensor  # [R, R]: log2(e) * inclusive cumsum within a tile
    coef: torch.Tensor  # [3I + 1, I]: the tile-level exponents from the tile totals
    triu_RR: torch.Tensor  # reverse (suffix) cumsum matrix over a tile
    sup_II: torch.Tensor  # [I, I] 1.0 where m > i (tiles after tile i)
    strict_RR: torch.Tensor  # [R, R] 1.0 strictly below the diagonal
    lower_RR: torch.Tensor  # [R, R] 1.0 on and below the diagonal


@functools.lru_cache(maxsize=16)
def _consts(C: int, device: torch.device) -> _Consts:
    R, I = SUBTILE, C // SUBTILE
    # Exponents (base 2) as sums of tile totals tau_m (all <= 0, so no
    # cancellation); eps_i = Gamma at the last token of tile i, eps_-1 = 0:
    #   start i: eps_{i-1} = sum_{m<i} tau_m
    #   to_end j: Gamma_C - eps_j = sum_{m>j} tau_m
    #   decay: Gamma_C = sum_m tau_m
    #   total j: eps_j - eps_{j-1} = tau_j (last: never floored, it multiplies columns up to e^80)
    coef = torch.zeros(3 * I + 1, I)
    for i in range(I):
        coef[i, :i] = 1.0
        coef[I + i, i + 1 :] = 1.0
        coef[2 * I + 1 + i, i] = 1.0
    coef[2 * I] = 1.0
    return _Consts(
        (torch.ones(R, R).tril() * _LOG2E).to(device),
        coef.to(device),
        torch.ones(R, R).triu().to(device),
        torch.ones(I, I).triu(1).to(device),
        torch.ones(R, R).tril(-1).to(device),
        torch.ones(R, R).tril().to(device),
    )


# --------------------------------------------------------------------------
# layout: packed [B, T, H, D] tokens <-> chunk-major [n * H, C, D] float32
# --------------------------------------------------------------------------


class _Plan(NamedTuple):
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    C: int
    n: int  # chunks, all sequences
    fast: bool  # no cu_seqlens and T % C == 0: strided views, no gather
    layout: Optional[_Layout]
    step_counts: Tuple[int, ...]

    @property
    def pre(self) -> Tuple[int, ...]:
        """Leading dims of the chunk views: (steps, B, H) on the fast path, else (n * H,)."""
        return (self.T // self.C, self.B, self.H) if self.fast else (self.n * self.H,)


def _chunk_view(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[B, T, H, D] (or [B, T, H]) -> float32 chunks [*pre, C, D] (or [*pre, C]).

    The fast path returns a strided view (no copy for float32 input): its
    elementwise consumers write chunk-major outputs, fusing the layout change.
    Otherwise the tokens are gathered, padded slots zero.
    """
    x = x.float()
    squeeze = x.dim() == 3
    if squeeze:
        x = x.unsqueeze(-1)
    B, T, H, D = x.shape
    C = plan.C
    if plan.fast:
        out = x.unflatten(1, (T // C, C)).permute(1, 0, 3, 2, 4)  # [steps, B, H, C, D]
    else:
        layout, n = plan.layout, plan.n
        rows = x.reshape(B * T * H, D)
        if layout.has_pad:
            rows = torch.cat([rows, rows.new_zeros(H, D)])
        out = rows.index_select(0, layout.gather_nHC).view(n * H, C, D)
    return out.squeeze(-1) if squeeze else out


def _unchunk(x_XCD: torch.Tensor, plan: _Plan, dtype: torch.dtype, mul: Optional[float] = None) -> torch.Tensor:
    """[n * H, C, D] float32 chunks -> [B, T, H, D] in dtype (padding dropped), times mul."""
    B, T, H, C = plan.B, plan.T, plan.H, plan.C
    D = x_XCD.shape[-1]
    if plan.fast:
        out = torch.empty(B, T, H, D, dtype=dtype, device=x_XCD.device)
        dst = out.view(B, T // C, C, H, D).permute(1, 0, 3, 2, 4)
        src = x_XCD.view(T // C, B, H, C, D)
        if mul is None:
            dst.copy_(src)
        elif dtype == torch.float32:
            torch.mul(src, mul, out=dst)
        else:
            dst.copy_(src * mul)
        return out
    x_PHD = x_XCD.reshape(-1, D).index_select(0, plan.layout.scatter_PH)
    if mul is not None:
        x_PHD = x_PHD.mul_(mul)
    return x_PHD.view(B, T, H, D).to(dtype)


def _decay_logs(g: torch.Tensor, plan: _Plan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Within-tile cumulative decays from the gates, base 2.

    Returns the row factor e = exp(Gamma_t - eps_{i-1}) [X, C, K] (eps_{i-1}:
    Gamma just before t's tile) and the tile totals [I, X, K] (base 2).
    """
    B, T, H, K, C = plan.B, plan.T, plan.H, plan.K, plan.C
    R, I = SUBTILE, C // SUBTILE
    X = plan.n * H
    c = _consts(C, g.device)
    g32 = g.float()
    e = torch.empty(X, C, K, device=g.device)
    tot = torch.empty(I, X, K, device=g.device)
    if plan.fast:
        # One matmul in token layout (16-token tiles never straddle chunks);
        # the exp2 pass then writes chunk-major.
        nc = T // C
        g_rows = g32.reshape(B * T // R, R, H * K)
        lc = torch.bmm(c.tri_RR.expand(g_rows.shape[0], R, R), g_rows).view(B, nc, I, R, H, K)
        torch.exp2(lc.permute(1, 0, 4, 2, 3, 5), out=e.view(nc, B, H, I, R, K))
        tot.view(I, nc, B, H, K).copy_(lc[:, :, :, R - 1].permute(2, 1, 0, 3, 4))
    else:
        gc = _chunk_view(g32, plan).view(X * I, R, K)
        lc = torch.bmm(c.tri_RR.expand(X * I, R, R), gc).view(X, I, R, K)
        torch.exp2(lc, out=e.view(X, I, R, K))
        tot.copy_(lc[:, :, R - 1].transpose(0, 1))
    return e, tot


# --------------------------------------------------------------------------
# per-chunk algebra
# --------------------------------------------------------------------------


def _tile_inverses(n_ZRR: torch.Tensor) -> torch.Tensor:
    """(I + N)^-1 for strictly lower triangular 16 x 16 tiles N [Z, R, R].

    Forward substitution, vectorised over the tiles: 15 rank-1 updates of
    whole rows (row m of every inverse is final once the rows above it have
    been removed from it). Returns [Z, R, R], zeros above the diagonal exactly.
    """
    Z, R, _ = n_ZRR.shape
    y_ZRR = torch.zeros(Z, R, R, device=n_ZRR.device)
    y_ZRR.diagonal(dim1=1, dim2=2).fill_(1.0)
    for m in range(R - 1):
        y_ZRR[:, m + 1 :].addcmul_(n_ZRR[:, m + 1 :, m : m + 1], y_ZRR[:, m : m + 1], value=-1.0)
    return y_ZRR


def _solve_lower_(
    rk: torch.Tensor, kc2: torch.Tensor, lastf: torch.Tensor, dinv: torch.Tensor, rhs: torch.Tensor
) -> torch.Tensor:
    """rhs <- (I + L)^-1 rhs in place, L = diag(beta) A_strict of every chunk.

    Block forward substitution over the 16-row tiles. The diagonal tiles'
    inverses are dinv [X, I, R, R]; the part of L left of the diagonal tiles
    is never formed: with kc2_j = k exp(eps_j - Gamma_s), tile i's product
    with the solved rows is rk_i F_i, where the state
    F_i = sum_{j<i} exp(eps_{i-1} - eps_j) kc2_j^T Y_j follows
    F_{i+1} = exp(tau_i) F_i + kc2_i^T Y_i.
    Shapes: rk, kc2 [X, I, R, K]; lastf [X, I, K] = exp(tau); rhs [X, C, D].
    """
    I, R = dinv.shape[1], dinv.shape[2]
    f = None
    for i in range(I):
        a, b = i * R, (i + 1) * R
        z = rhs[:, a:b]
        if i:
            z = torch.baddbmm(z, rk[:, i], f, alpha=-1.0)
        y = torch.bmm(dinv[:, i], z)
        rhs[:, a:b] = y
        if i < I - 1:
            f_next = torch.bmm(kc2[:, i].transpose(1, 2), y)
            if i:
                f_next.addcmul_(f, lastf[:, i].unsqueeze(-1))
            f = f_next
    return rhs


def _solve_upper_(
    rk: torch.Tensor, kc2: torch.Tensor, lastf: torch.Tensor, dinv: torch.Tensor, rhs: torch.Tensor
) -> torch.Tensor:
    """rhs <- (I + L)^-T rhs in place: block back substitution, as ``_solve_lower_``.

    Tile i's product with the later solved rows is kc2_i P_i, with
    P_i = sum_{m>i} exp(eps_{m-1} - eps_i) rk_m^T Y_m, P_{i-1} = rk_i^T Y_i + exp(tau_i) P_i.
    """
    I, R = dinv.shape[1], dinv.shape[2]
    p = None
    for i in range(I - 1, -1, -1):
        a, b = i * R, (i + 1) * R
        z = rhs[:, a:b]
        if i < I - 1:
            z = torch.baddbmm(z, kc2[:, i], p, alpha=-1.0)
        y = torch.bmm(dinv[:, i].transpose(1, 2), z)
        rhs[:, a:b] = y
        if i:
            p_next = torch.bmm(rk[:, i].transpose(1, 2), y)
            if i < I - 1:
                p_next.addcmul_(p, lastf[:, i].unsqueeze(-1))
            p = p_next
    return rhs


class _Saved(NamedTuple):
    """Forward chunk quantities kept for the backward pass (float32)."""

    q: torch.Tensor  # [*pre, C, K] chunk views of the inputs
    k: torch.Tensor
    v: torch.Tensor  # [*pre, C, V]
    beta: torch.Tensor  # [*pre, C]
    e: torch.Tensor  # [X, C, K] exp(Gamma_t - eps_{i-1})
    rows: torch.Tensor  # [X, I, 2, R, K] per row tile: q * e, then beta * k * e
    kcd: torch.Tensor  # [X, I, R, K] own-tile columns k * exp(eps_{i-1} - Gamma_s) = k / e
    kc2: torch.Tensor  # [X, I, R, K] columns seen from later tiles: k_s exp(eps_i - Gamma_s)
    lastf: torch.Tensor  # [X, I, K] exp(tau_i), tau_i the tile's total log-decay
    to_end: torch.Tensor  # [X, I, K] exp(Gamma_C - eps_i)
    decay: torch.Tensor  # [X, K] exp(Gamma_C)
    ad: torch.Tensor  # [X * I, 2, R, R] Aqk (lower) and diag(beta) A (strict) on the diagonal tiles
    dinv: torch.Tensor  # [X, I, R, R] inverses of the diagonal tiles of I + diag(beta) A_strict
    wu0: torch.Tensor  # [X, C, K + V] [W, U0]
    kdec: torch.Tensor  # [X, C, K] exp(Gamma_C - Gamma_s) * k_s
    m: torch.Tensor  # [X, K, K] chunk transition
    entry: torch.Tensor  # [X, K, V] state entering every chunk
    u: torch.Tensor  # [X, C, V] delta values
    hst: torch.Tensor  # [X, I, K, V] tile-level states H_i


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state0: torch.Tensor, plan: _Plan, keep: bool,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[_Saved]]:
    """o (unscaled q) [X, C, V], final states [Y, K, V] and, if keep, the saved quantities."""
    H, K, V, C = plan.H, plan.K, plan.V, plan.C
    R, I = SUBTILE, C // SUBTILE
    X = plan.n * H
    pre = plan.pre
    c = _consts(C, q.device)
    qv, kv, vv, bv = (_chunk_view(x, plan) for x in (q, k, v, beta))
    e, tot = _decay_logs(g, plan)

    # Tile-level factors from one small matmul (see _consts), floored where
    # they only ever shrink a term, then one exp2.
    ex = torch.mm(c.coef, tot.view(I, X * K)).view(-1, X, K)
    ex[: 2 * I + 1].clamp_min_(_LOG2_FLOOR)
    ex = torch.exp2(ex, out=ex)
    start = ex[:I].transpose(0, 1)  # [X, I, K] exp(eps_{i-1})
    to_end = ex[I : 2 * I].transpose(0, 1)  # [X, I, K] exp(Gamma_C - eps_i)
    decay = ex[2 * I]  # [X, K] exp(Gamma_C)
    lastf = ex[2 * I + 1 :].transpose(0, 1)  # [X, I, K] exp(tau_i) >= e^-80
    del tot

    def new(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=q.device)

    def tiles(x: torch.Tensor) -> torch.Tensor:  # chunk buffer [X, .., D] -> [*pre, I, R, D]
        return x.view(*pre, I, R, x.shape[-1])

    def src_tiles(x: torch.Tensor) -> torch.Tensor:  # input view [*pre, C, D] -> [*pre, I, R, D]
        return x.unflatten(-2, (I, R))

    # Per-token factors. Rows: exp(Gamma_t - eps_{i-1}) in [e^-80, 1]; own-tile
    # columns exp(eps_{i-1} - Gamma_s) in [1, e^80]; columns seen from later
    # tiles and by the state update: exp(eps_i - Gamma_s) in [e^-80, 1].
    e_t = tiles(e)
    rows = new(X, I, 2, R, K)  # q and k rows of each tile side by side
    rq, rk = rows[:, :, 0], rows[:, :, 1]  # [X, I, R, K] views
    torch.mul(src_tiles(qv), e_t, out=rq.view(*pre, I, R, K))
    torch.mul(src_tiles(kv), src_tiles(bv.unsqueeze(-1)), out=rk.view(*pre, I, R, K)).mul_(e_t)
    kcd = new(X, I, R, K)
    torch.div(src_tiles(kv), e_t, out=tiles(kcd))
    kc2 = torch.mul(kcd, lastf.unsqueeze(2), out=new(X, I, R, K))
    kdec = torch.mul(kc2, to_end.unsqueeze(2), out=new(X, I, R, K)).view(X, C, K)

    # Only the diagonal tiles of Aqk and A are ever formed (one small matmul):
    # the rest enters through tile-level states. Aqk[t, t] = (q_t e_t) . (k_t / e_t)
    # = q_t . k_t up to rounding; the backward treats it as exactly q_t . k_t.
    ad = torch.bmm(rows.view(X * I, 2 * R, K), kcd.view(X * I, R, K).transpose(1, 2)).view(X * I, 2, R, R)
    ad[:, 0].mul_(c.lower_RR)
    ad[:, 1].mul_(c.strict_RR)  # diag(beta) A_strict
    dinv = _tile_inverses(ad[:, 1]).view(X, I, R, R)
    if not keep:
        del e, e_t, kcd

    # [W, U0] = (I + diag(beta) A_strict)^-1 [beta * K_gamma, beta * V], in place.
    wu0 = new(X, C, K + V)
    torch.mul(rk, start.unsqueeze(2), out=wu0[..., :K].view(X, I, R, K))
    torch.mul(src_tiles(vv), src_tiles(bv.unsqueeze(-1)), out=tiles(wu0[..., K:]))
    _solve_lower_(rk, kc2, lastf, dinv, wu0)
    if not keep:
        del dinv
    w, u0 = wu0[..., :K], wu0[..., K:]
    mb = torch.bmm(kdec.transpose(1, 2), wu0)  # [K_dec^T W, K_dec^T U0]
    m = mb[..., :K].neg()
    m.diagonal(dim1=1, dim2=2).add_(decay)
    if not keep:
        del kdec

    entry, final = _state_loop(m, mb[..., K:], state0.reshape(-1, K, V), plan.step_counts, H)
    del mb
    u = torch.baddbmm(u0, w, entry, alpha=-1.0)

    # Outputs from tile-level states H_i = exp(eps_{i-1}) S + sum_{j<i} exp(eps_{i-1} - eps_j) kc2_j^T u_j
    # (H_0 = S, H_{i+1} = exp(tau_i) H_i + kc2_i^T u_i): o_t = (q_t e_t) H_i + own-tile Aqk times u.
    u_t = u.view(X * I, R, V)
    hst = new(X, I, K, V)
    z = torch.bmm(kc2.view(X * I, R, K).transpose(1, 2), u_t).view(X, I, K, V)  # (last tile's unused)
    hst[:, 0] = entry
    for i in range(I - 1):
        torch.addcmul(z[:, i], hst[:, i], lastf[:, i].unsqueeze(-1), out=hst[:, i + 1])
    del z
    o = torch.bmm(rq.reshape(X * I, R, K), hst.view(X * I, K, V))
    o.baddbmm_(ad[:, 0], u_t)
    saved = None
    if keep:
        saved = _Saved(
            qv, kv, vv, bv, e, rows, kcd, kc2, lastf, to_end, decay, ad, dinv, wu0, kdec, m, entry, u, hst
        )
    return o.view(X, C, V), final, saved


def _state_loop(
    m_XKK: torch.Tensor, add_XKV: torch.Tensor, state_YKV: torch.Tensor, step_counts: Tuple[int, ...], H: int,
    reverse: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sequential part: S <- m S + add, one chunk step at a time.

    Forward (reverse=False): state_YKV enters step 0; returns the state
    entering every chunk [X, K, V] and the states after each sequence's last
    chunk [Y, K, V]. Reverse: m is applied transposed, state_YKV is the
    gradient of the final states; returns the gradient of every chunk's exit
    state [X, K, V] and of the initial states [Y, K, V].

    Chunks are step-major and sequences sorted so that the ones still running
    at step j are the first step_counts[j]; the others keep their state.
    """
    Y, K, V = state_YKV.shape
    X = m_XKK.shape[0]
    steps = range(len(step_counts) - 1, -1, -1) if reverse else range(len(step_counts))
    if all(cnt * H == Y for cnt in step_counts):
        # Every sequence has every chunk: states live in one buffer, no copies.
        J = len(step_counts)
        buf = torch.empty(J + 1, Y, K, V, device=state_YKV.device)
        m_J = m_XKK.view(J, Y, K, K)
        if reverse:
            m_J = m_J.transpose(-1, -2)
        add_J = add_XKV.view(J, Y, K, V).unbind(0)
        m_J = m_J.unbind(0)
        buf[J if reverse else 0] = state_YKV
        bufs = buf.unbind(0)
        for j in steps:
            src, dst = (j + 1, j) if reverse else (j, j + 1)
            torch.baddbmm(add_J[j], m_J[j], bufs[src], out=bufs[dst])
        if reverse:
            return buf[1:].view(X, K, V), buf[0]
        return buf[:J].view(X, K, V), buf[J]

    offsets = [0]
    for cnt in step_counts:
        offsets.append(offsets[-1] + cnt * H)
    cur = state_YKV.clone()
    per_chunk = torch.empty(X, K, V, device=state_YKV.device)
    for j in steps:
        lo, hi = offsets[j], offsets[j + 1]
        rows = hi - lo
        snap = per_chunk[lo:hi]
        snap.copy_(cur[:rows])
        m = m_XKK[lo:hi].transpose(-1, -2) if reverse else m_XKK[lo:hi]
        torch.baddbmm(add_XKV[lo:hi], m, snap, out=cur[:rows])
    return per_chunk, cur


def _backward(f: _Saved, dO: torch.Tensor, dfinal: torch.Tensor, plan: _Plan) -> Tuple[torch.Tensor, ...]:
    """Gradients in chunk layout: dq, dk, dv, dg [X, C, D], dbeta [X, C], dstate0 [Y, K, V].

    dO [X, C, V] is the gradient of the unscaled-q output (already times scale).
    """
    H, K, V, C = plan.H, plan.K, plan.V, plan.C
    R, I = SUBTILE, C // SUBTILE
    X = plan.n * H
    pre = plan.pre
    c = _consts(C, dO.device)
    S, u = f.entry, f.u
    w = f.wu0[..., :K]
    rq = f.rows[:, :, 0]
    do_t = dO.view(X * I, R, V)

    # Aqk^T dO and Q_gamma^T dO from tile-level states (the transpose of the
    # forward's): with Y_i = (q_i e_i)^T dO_i, P_j = sum_{i>j} exp(eps_{i-1} - eps_j) Y_i
    # (P_{I-1} = 0, P_{j-1} = Y_j + exp(tau_j) P_j) and P_{-1} = Q_gamma^T dO:
    # (Aqk^T dO)_s = kc2_s P_j + own-tile Aqk^T dO.
    yq = torch.bmm(rq.reshape(X * I, R, K).transpose(1, 2), do_t).view(X, I, K, V)
    pst = torch.empty(X, I, K, V, device=dO.device)
    pst[:, I - 1].zero_()
    for j in range(I - 1, 0, -1):
        torch.addcmul(yq[:, j], pst[:, j], f.lastf[:, j].unsqueeze(-1), out=pst[:, j - 1])
    qg_t_do = torch.addcmul(yq[:, 0], pst[:, 0], f.lastf[:, 0].unsqueeze(-1))
    del yq
    aqk_t_do = torch.bmm(f.kc2.view(X * I, R, K), pst.view(X * I, K, V))
    aqk_t_do.baddbmm_(f.ad[:, 0].transpose(1, 2), do_t)
    aqk_t_do = aqk_t_do.view(X, C, V)
    del pst

    # Sequential: gradient of every chunk's exit state and of the initial state,
    # dS = M^T dS_end + Q_eff^T dO with Q_eff = Q_gamma - Aqk W.
    qdo = qg_t_do.baddbmm_(w.transpose(1, 2), aqk_t_do, alpha=-1.0)
    dexit, dstate0 = _state_loop(f.m, qdo, dfinal, plan.step_counts, H, reverse=True)
    del qdo

    # dU, then d(beta V) = T^T dU (in place), d(beta K_gamma) = -T^T dU S^T and
    # d(diag(beta) A_strict) = -(T^T dU) U^T  (U = T R, R = beta (V - K_gamma S)).
    dvb = aqk_t_do.baddbmm_(f.kdec, dexit)
    _solve_upper_(f.rows[:, :, 1], f.kc2, f.lastf, f.dinv, dvb)
    # q and k sides of each row tile side by side: g = [dO, -d(beta V)] per tile.
    g = torch.empty(X, I, 2, R, V, device=dO.device)
    g[:, :, 0] = dO.view(X, I, R, V)
    torch.neg(dvb.view(X, I, R, V), out=g[:, :, 1])
    g_t = g.view(X * I, 2 * R, V)
    rows_t = f.rows.view(X * I, 2 * R, K)
    u_t = u.view(X * I, R, V)
    dkdec = torch.bmm(u, dexit.transpose(1, 2))
    ddecay = torch.linalg.vecdot(dexit, S)  # [X, K]

    # Own tiles: [dAqk, d(diag(beta) A_strict)] on the diagonal tiles.
    da_d = torch.bmm(g_t, u_t.transpose(1, 2)).view(X * I, 2, R, R)
    daqk_diag = torch.empty(X * I, R, device=dO.device)  # dAqk[t, t]
    daqk_diag.copy_(da_d[:, 0].diagonal(dim1=1, dim2=2))
    daqk_diag = daqk_diag.view(X, C, 1)
    da_d.mul_(c.strict_RR)
    da_d = da_d.view(X * I, 2 * R, R)
    # Rows (q and k together): everything before the tile, inter-chunk state
    # included, is in H_i (Q_gamma = rq exp(eps_{i-1}), beta K_gamma = rk exp(eps_{i-1})).
    drows = torch.bmm(g_t, f.hst.view(X * I, K, V).transpose(1, 2))
    drows.baddbmm_(da_d, f.kcd.view(X * I, R, K))
    drows = drows.view(X, I, 2, R, K)
    # Columns: own tile kcd = k / e; later tiles kc2 = k exp(eps_j - Gamma_s) times
    # exp(eps_{i-1} - eps_j), through states P'_j = sum_{i>j} exp(eps_{i-1} - eps_j) g_i^T rows_i
    # (P'_{I-1} = 0, P'_{j-1} = Y_j + exp(tau_j) P'_j).
    yt = torch.bmm(g_t.transpose(1, 2), rows_t).view(X, I, V, K)
    pst2 = torch.empty(X, I, V, K, device=dO.device)
    pst2[:, I - 1].zero_()
    for j in range(I - 1, 0, -1):
        torch.addcmul(yt[:, j], pst2[:, j], f.lastf[:, j].unsqueeze(1), out=pst2[:, j - 1])
    del yt, g, g_t
    dkc2 = torch.bmm(u_t, pst2.view(X * I, V, K)).view(X, C, K)
    del pst2
    dkcd = torch.bmm(da_d.transpose(1, 2), rows_t).view(X, C, K)

    # d Gamma (natural log units): rows add, columns subtract; then dg = suffix
    # sums over the chunk. K_dec's share is taken as the same products that
    # enter dGamma_C, so the two cancel exactly where they should.
    dgam = torch.linalg.vecdot(f.rows, drows, dim=2).view(X, C, K)
    dgam.addcmul_(f.kcd.view(X, C, K), dkcd, value=-1.0)
    dgam.addcmul_(f.kc2.view(X, C, K), dkc2, value=-1.0)
    kdk = torch.mul(f.kdec, dkdec)
    dgam.sub_(kdk)
    dgam[:, -1].add_(kdk.sum(1)).addcmul_(f.decay, ddecay)
    del kdk
    # Suffix sums: within each tile, then the totals of the later tiles.
    dg = torch.bmm(c.triu_RR.expand(X * I, R, R), dgam.view(X * I, R, K)).view(X, I, R, K)
    later = torch.bmm(c.sup_II.expand(X, I, I), dg[:, :, 0])  # [X, I, K]
    dg = dg.add_(later.unsqueeze(2)).view(X, C, K)
    del dgam, later

    def tiles(x: torch.Tensor) -> torch.Tensor:  # chunk buffer [X, C, D] -> [*pre, C, D]
        return x.view(*pre, C, x.shape[-1])

    e = f.e
    # [dq, d(beta * k)] from the rows: times e.
    dqk = drows.mul_(e.view(X, I, 1, R, K))
    dq = dqk[:, :, 0].reshape(X, C, K)
    tiles(dq).addcmul_(tiles(daqk_diag), f.k)
    dk_rows = dqk[:, :, 1].view(*pre, I, R, K)
    dbeta = torch.linalg.vecdot(dk_rows, f.k.unflatten(-2, (I, R))).reshape(X, C)
    dk = torch.empty(X, C, K, device=dO.device)
    torch.mul(dk_rows, f.beta.unflatten(-1, (I, R)).unsqueeze(-1), out=dk.view(*pre, I, R, K))
    dk.addcdiv_(dkcd, e)
    # kc2 and K_dec = kc2 exp(Gamma_C - eps_j): d k = (dkc2 + to_end dK_dec) exp(eps_j - Gamma_s).
    dkc2.view(X, I, R, K).addcmul_(dkdec.view(X, I, R, K), f.to_end.unsqueeze(2))
    fk = torch.div(f.lastf.unsqueeze(2), e.view(X, I, R, K), out=torch.empty(X, I, R, K, device=dO.device))
    dk.addcmul_(dkc2, fk.view(X, C, K))
    tiles(dk).addcmul_(tiles(daqk_diag), f.q)
    dbeta += torch.linalg.vecdot(tiles(dvb), f.v).reshape(X, C)
    dv = torch.empty(X, C, V, device=dO.device)
    torch.mul(tiles(dvb), f.beta.unsqueeze(-1), out=tiles(dv))
    return dq, dk, dv, dg, dbeta, dstate0


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
            f = f._replace(**{name: _chunk_view(x, plan) for name, x in zip("qkv", ctx.saved_tensors)},
                           beta=_chunk_view(ctx.saved_tensors[3], plan))
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

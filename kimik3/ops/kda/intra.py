"""Stage 2 of the KDA forward (Triton): the intra-chunk matrices of each 64-token chunk.

Aqk (lower, diagonal included) and diag(beta) Akk (strictly lower) as dense tl.dot products, one 64 x 16 column
tile j at a time against the reference eps_j = Gamma at the tile's last token: column factors exp(eps_j - Gamma_s)
are in [e^-75, 1] and row factors exp(Gamma_t - eps_j) in (0, e^75] for the rows that are not in tile j's future
(rows before the tile are masked to zero *in the exponent*, before exp, so nothing overflows and no tile reads a
future token). This is where K3's gate bound (g >= -5) is used: a 16-token tile accumulates at most 15 * 5 = 75 in
log space, so the diagonal tiles need no position-pair loop. One program per (chunk, head, column tile); A goes to
the scratch buffer that ``solve.py`` inverts in place.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import _chunk_beta, _chunk_part, part_grid

WARPS = 4  # num_warps of the phase-A kernel


@triton.jit
def _a_tile(j, q_ptr, k_ptr, G_ptr, aqk_ptr, tinv_ptr, a_base, t0, L, beta, i_h, H,
            K: tl.constexpr, BK: tl.constexpr, DTA: tl.constexpr, PREC: tl.constexpr):
    """Phase A for the 64 x 16 column tile j: Aqk (lower) and diag(beta) Akk (strictly lower), against the
    reference eps_j = Gamma at the tile's last valid token (the gate bound keeps both factors finite)."""
    r = tl.arange(0, 64)
    r16 = tl.arange(0, 16)
    rv = r < L
    NEG = float("-inf")
    s = j * 16 + r16  # columns of tile j
    sv = s < L
    ref = tl.minimum(j * 16 + 15, L - 1)  # eps_j: Gamma at the tile's last (valid) token
    row_ok = rv & (r >= j * 16)  # rows before tile j are in its past: never read
    acc_q = tl.zeros([64, 16], dtype=tl.float32)
    acc_k = tl.zeros([64, 16], dtype=tl.float32)
    for kb in tl.static_range(0, K, BK):
        c = kb + tl.arange(0, BK)
        cm = c < K
        g_ref = tl.load(G_ptr + (t0 + ref) * (H * K) + i_h * K + c, mask=cm, other=0.0)
        mr = row_ok[:, None] & cm[None, :]  # rows in tile j's past are not loaded
        ro = (t0 + r)[:, None] * (H * K) + i_h * K + c[None, :]
        Gr = tl.load(G_ptr + ro, mask=mr, other=0.0)
        qr = tl.load(q_ptr + ro, mask=mr, other=0.0).to(tl.float32)
        kr = tl.load(k_ptr + ro, mask=mr, other=0.0).to(tl.float32)
        ms = sv[:, None] & cm[None, :]
        so = (t0 + s)[:, None] * (H * K) + i_h * K + c[None, :]
        Gs = tl.load(G_ptr + so, mask=ms, other=0.0)
        ks = tl.load(k_ptr + so, mask=ms, other=0.0).to(tl.float32)
        e_r = tl.exp(tl.where(mr, Gr - g_ref[None, :], NEG))  # (0, e^75]
        e_s = tl.exp(tl.where(ms, g_ref[None, :] - Gs, NEG))  # [e^-75, 1]
        kc = tl.trans((ks * e_s).to(DTA))
        acc_q += tl.dot((qr * e_r).to(DTA), kc, input_precision=PREC)
        acc_k += tl.dot((kr * e_r).to(DTA), kc, input_precision=PREC)
    o2 = a_base + r[:, None] * 64 + s[None, :]
    tl.store(aqk_ptr + o2, tl.where(r[:, None] >= s[None, :], acc_q, 0.0))
    tl.store(tinv_ptr + o2, tl.where(r[:, None] > s[None, :], acc_k * beta[:, None], 0.0))

@triton.jit
def _intra_a_kernel(q_ptr, k_ptr, G_ptr, beta_ptr, aqk_ptr, tinv_ptr, cu_ptr, cidx_ptr, H,
                    K: tl.constexpr, BK: tl.constexpr, DTA: tl.constexpr, PREC: tl.constexpr):
    """Phase A, one program per (chunk, head, column tile)."""
    i_t, i_h, j = _chunk_part(4)
    t0, L, r, beta = _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H)
    _a_tile(j, q_ptr, k_ptr, G_ptr, aqk_ptr, tinv_ptr, (i_t * H + i_h) * 4096, t0, L, beta, i_h, H, K, BK, DTA,
            PREC)

def launch(qn, kn, G, betan, aqk, tinv, plan, H, K, BK, DTA, PREC) -> None:
    """Aqk into aqk and diag(beta) Akk into tinv ([NT, H, 64, 64] fp32, chunk-major), one program per (chunk, head,
    column tile)."""
    _intra_a_kernel[part_grid(plan.NT, H, 4)](qn, kn, G, betan, aqk, tinv, plan.cu, plan.chunk_idx, H,
                                              K=K, BK=BK, DTA=DTA, PREC=PREC, num_warps=WARPS)

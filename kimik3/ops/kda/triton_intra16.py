"""Intra-chunk KDA kernel on 16-row tiles (``KIMIK3_KDA_INTRA=tiles16``).

Same outputs as ``triton_forward._intra_kernel`` (Aqk, T = (I + diag(beta) Akk)^-1, W, U and the scan
operands qg, kg, exp(Gamma_C)), computed with every matrix held as [16, 16] blocks in registers instead of
[64, 64] tiles passed through global scratch: the fused kernel sits at 255 registers with one program
per SM (NOTES-kda.md), so its many dependent steps have nothing to hide their latency behind. Here a
program keeps the 10 lower blocks of Aqk and Akk as 20 small accumulators.

Measured on the H200 (BENCHMARKS.md): no faster than the fused kernel (3.92 vs 3.90 ms at K3's shape,
BK 64 / 8 warps), so not the default. The reason, from the sm_90 compile: Triton lays a 16-row dot out as
mma v2 with every warp along M, so the warps of a program all compute the same 16 rows; each thread
holds a whole warp's share of every accumulator and the kernel sits at 255 registers at any warp count.
``INTRA16_CONFIG`` can also split the work in three kernels (fla's decomposition): the diagonal blocks
(``_diag16_kernel``, one 1-warp program per 16-row tile), the off-diagonal blocks with the solve, and
phase C (``triton_forward._intra_wy_kernel``); not yet timed.

One program per (chunk, head); rows of the chunk fall in four tiles i = 0..3 of 16 tokens. With
E_j = Gamma at the last valid token of tile j (Gamma = within-chunk cumulative log-decay, decreasing):

    A(i, j) = (x_i * exp(Gamma_i - E_j)) (k_j * exp(E_j - Gamma_j))^T      for i >= j, x = q or k

Column factors exp(E_j - Gamma_j) lie in [e^-75, 1] by the gate bound g >= -5 (15 steps inside a tile);
row factors exp(Gamma_i - E_j) are <= 1 for i > j and in [1, e^75] on the diagonal (i == j): the bound
is what lets the diagonal blocks be one dense matmul each. Rows past the chunk end are masked in the
exponent (-inf before exp), so nothing overflows and no block reads a token from its future.

T: diagonal blocks inverted by 16-step forward substitution (the four blocks' chains interleaved in
one loop, their rows read back from the tinv buffer), then the off-diagonal blocks by block forward
substitution in registers: T(i, j) = -T(i, i) sum_{j <= m < i} A(i, m) T(m, j).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_scan import _chunk_bounds


@triton.jit
def _rows16(i, t0, L, i_h, H, c, cm, D: tl.constexpr):
    """Token-layout offsets [16, BK] of tile i's rows at columns c, the mask, and the valid-row mask."""
    rr = i * 16 + tl.arange(0, 16)
    rv = rr < L
    return (t0 + rr)[:, None] * (H * D) + i_h * D + c[None, :], rv[:, None] & cm[None, :], rv


@triton.jit
def _ref16(G_ptr, i, t0, L, i_h, H, c, cm, K: tl.constexpr):
    """E_i: Gamma at tile i's last valid token (any finite value when the tile is past the chunk end)."""
    last = tl.minimum(i * 16 + 15, L - 1)
    return tl.load(G_ptr + (t0 + last) * (H * K) + i_h * K + c, mask=cm, other=0.0)


@triton.jit
def _col16(k_ptr, G_ptr, j, t0, L, i_h, H, c, cm, K: tl.constexpr, DTA: tl.constexpr):
    """Tile j's column operand (k_j * exp(E_j - Gamma_j))^T [BK, 16] and E_j."""
    o, m, rv = _rows16(j, t0, L, i_h, H, c, cm, K)
    e = _ref16(G_ptr, j, t0, L, i_h, H, c, cm, K)
    kj = tl.load(k_ptr + o, mask=m, other=0.0).to(tl.float32)
    Gj = tl.load(G_ptr + o, mask=m, other=0.0)
    f = tl.exp(tl.where(m, e[None, :] - Gj, float("-inf")))
    return tl.trans((kj * f).to(DTA)), e


@triton.jit
def _row_tile16(i, q_ptr, k_ptr, G_ptr, t0, L, i_h, H, c, cm, K: tl.constexpr):
    """Tile i's rows of q, k (fp32) and Gamma at columns c, and their mask."""
    o, m, rv = _rows16(i, t0, L, i_h, H, c, cm, K)
    qi = tl.load(q_ptr + o, mask=m, other=0.0).to(tl.float32)
    ki = tl.load(k_ptr + o, mask=m, other=0.0).to(tl.float32)
    return qi, ki, tl.load(G_ptr + o, mask=m, other=0.0), m


@triton.jit
def _pair16(aq, ak, qi, ki, Gi, mi, ej, kcj, DTA: tl.constexpr, PREC: tl.constexpr):
    """Accumulate block (i, j) of Aqk and Akk for one K block: row factor exp(Gamma_i - E_j)."""
    f = tl.exp(tl.where(mi, Gi - ej[None, :], float("-inf")))
    aq += tl.dot((qi * f).to(DTA), kcj, input_precision=PREC)
    ak += tl.dot((ki * f).to(DTA), kcj, input_precision=PREC)
    return aq, ak


@triton.jit
def _store16(ptr, base, i, j, x):
    """Block (i, j) of a chunk-major [64, 64] buffer."""
    r = tl.arange(0, 16)
    tl.store(ptr + base + (i * 16 + r)[:, None] * 64 + (j * 16 + r)[None, :], x)


@triton.jit
def _store_diag16(ptr, base, x0, x1, x2, x3):
    """The four diagonal blocks of a chunk-major [64, 64] buffer."""
    _store16(ptr, base, 0, 0, x0)
    _store16(ptr, base, 1, 1, x1)
    _store16(ptr, base, 2, 2, x2)
    _store16(ptr, base, 3, 3, x3)


@triton.jit
def _store_lower16(ptr, base, x10, x20, x21, x30, x31, x32):
    """The six blocks below the diagonal of a chunk-major [64, 64] buffer."""
    _store16(ptr, base, 1, 0, x10)
    _store16(ptr, base, 2, 0, x20)
    _store16(ptr, base, 2, 1, x21)
    _store16(ptr, base, 3, 0, x30)
    _store16(ptr, base, 3, 1, x31)
    _store16(ptr, base, 3, 2, x32)


@triton.jit
def _load16(ptr, base, i):
    """Diagonal block (i, i) of a chunk-major [64, 64] buffer."""
    r = tl.arange(0, 16)
    return tl.load(ptr + base + (i * 16 + r)[:, None] * 64 + (i * 16 + r)[None, :])


@triton.jit
def _diag16_kernel(q_ptr, k_ptr, G_ptr, beta_ptr, aqk_ptr, tinv_ptr, cu_ptr, cidx_ptr, H,
                   K: tl.constexpr, BK: tl.constexpr, DTA: tl.constexpr, PREC: tl.constexpr):
    """Diagonal blocks, one program per (chunk, head, tile i): Aqk(i, i) (lower, diagonal included) and
    diag(beta) Akk(i, i) (strictly lower) -- one dense matmul each, by the gate bound."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i = tl.program_id(2)
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    base = (i_t * H + i_h) * 4096
    r = tl.arange(0, 16)
    b = tl.load(beta_ptr + (t0 + i * 16 + r) * H + i_h, mask=i * 16 + r < L, other=0.0).to(tl.float32)
    aq = tl.zeros([16, 16], dtype=tl.float32)
    ak = tl.zeros([16, 16], dtype=tl.float32)
    for kb in tl.static_range(0, K, BK):
        c = kb + tl.arange(0, BK)
        cm = c < K
        kc, e = _col16(k_ptr, G_ptr, i, t0, L, i_h, H, c, cm, K, DTA)
        qi, ki, Gi, m = _row_tile16(i, q_ptr, k_ptr, G_ptr, t0, L, i_h, H, c, cm, K)
        aq, ak = _pair16(aq, ak, qi, ki, Gi, m, e, kc, DTA, PREC)
    _store16(aqk_ptr, base, i, i, tl.where(r[:, None] >= r[None, :], aq, 0.0))
    _store16(tinv_ptr, base, i, i, tl.where(r[:, None] > r[None, :], ak * b[:, None], 0.0))


@triton.jit
def _subst_step(b, tinv_ptr, base, i, rr):
    """Row rr of the forward substitution for diagonal block i (b starts as minus its strict lower part)."""
    r = tl.arange(0, 16)
    a = -tl.load(tinv_ptr + base + (i * 16 + rr) * 64 + i * 16 + r)
    a = tl.where(r < rr, a, 0.0)
    a = a + tl.sum(a[:, None] * b, 0)
    return tl.where((r == rr)[:, None], a[None, :], b)


@triton.jit
def diag_inverses16(t_ptr, base, a00, a11, a22, a33):
    """(I + A(i, i))^-1 of the four strictly lower diagonal 16 x 16 blocks of the chunk-major [64, 64] A at
    t_ptr + base (given in registers as a_ii too): the four forward substitutions interleaved in one loop,
    so each step has four independent chains; their rows are read back from memory."""
    d0, d1, d2, d3 = -a00, -a11, -a22, -a33
    for rr in range(2, 16):
        d0 = _subst_step(d0, t_ptr, base, 0, rr)
        d1 = _subst_step(d1, t_ptr, base, 1, rr)
        d2 = _subst_step(d2, t_ptr, base, 2, rr)
        d3 = _subst_step(d3, t_ptr, base, 3, rr)
    r = tl.arange(0, 16)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    return d0 + eye, d1 + eye, d2 + eye, d3 + eye


@triton.jit
def _mm16(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def block_subst16(d0, d1, d2, d3, a10, a20, a21, a30, a31, a32, PREC: tl.constexpr):
    """Off-diagonal blocks of T = (I + A)^-1 for a strictly lower 64 x 64 A in 16 x 16 blocks a_ij, given
    the diagonal blocks' inverses d_i: T(i, j) = -d_i sum_{j <= m < i} A(i, m) T(m, j)."""
    t10 = -_mm16(d1, _mm16(a10, d0, PREC), PREC)
    t21 = -_mm16(d2, _mm16(a21, d1, PREC), PREC)
    t20 = -_mm16(d2, _mm16(a20, d0, PREC) + _mm16(a21, t10, PREC), PREC)
    t32 = -_mm16(d3, _mm16(a32, d2, PREC), PREC)
    t31 = -_mm16(d3, _mm16(a31, d1, PREC) + _mm16(a32, t21, PREC), PREC)
    t30 = -_mm16(d3, _mm16(a30, d0, PREC) + _mm16(a31, t10, PREC) + _mm16(a32, t20, PREC), PREC)
    return t10, t20, t21, t30, t31, t32


@triton.jit
def _wy_rows16(x_ptr, out_ptr, t0, L, i_h, H, c, cm, D: tl.constexpr, b0, b1, b2, b3,
               t00, t10, t11, t20, t21, t22, t30, t31, t32, t33, DTC: tl.constexpr, PREC: tl.constexpr,
               G_ptr, SCALE_G: tl.constexpr):
    """out_i = sum_{j <= i} T(i, j) (beta_j x_j [* exp(Gamma_j)]) for the four tiles at columns c."""
    o0, m0, rv0 = _rows16(0, t0, L, i_h, H, c, cm, D)
    o1, m1, rv1 = _rows16(1, t0, L, i_h, H, c, cm, D)
    o2, m2, rv2 = _rows16(2, t0, L, i_h, H, c, cm, D)
    o3, m3, rv3 = _rows16(3, t0, L, i_h, H, c, cm, D)
    x0 = tl.load(x_ptr + o0, mask=m0, other=0.0).to(tl.float32) * b0[:, None]
    x1 = tl.load(x_ptr + o1, mask=m1, other=0.0).to(tl.float32) * b1[:, None]
    x2 = tl.load(x_ptr + o2, mask=m2, other=0.0).to(tl.float32) * b2[:, None]
    x3 = tl.load(x_ptr + o3, mask=m3, other=0.0).to(tl.float32) * b3[:, None]
    if SCALE_G:
        x0 *= tl.exp(tl.load(G_ptr + o0, mask=m0, other=0.0))
        x1 *= tl.exp(tl.load(G_ptr + o1, mask=m1, other=0.0))
        x2 *= tl.exp(tl.load(G_ptr + o2, mask=m2, other=0.0))
        x3 *= tl.exp(tl.load(G_ptr + o3, mask=m3, other=0.0))
    x0, x1, x2, x3 = x0.to(DTC), x1.to(DTC), x2.to(DTC), x3.to(DTC)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + o0, _mm16(t00, x0, PREC).to(ty), mask=m0)
    tl.store(out_ptr + o1, (_mm16(t10, x0, PREC) + _mm16(t11, x1, PREC)).to(ty), mask=m1)
    tl.store(out_ptr + o2, (_mm16(t20, x0, PREC) + _mm16(t21, x1, PREC) + _mm16(t22, x2, PREC)).to(ty), mask=m2)
    w3 = _mm16(t30, x0, PREC) + _mm16(t31, x1, PREC) + _mm16(t32, x2, PREC) + _mm16(t33, x3, PREC)
    tl.store(out_ptr + o3, w3.to(ty), mask=m3)


@triton.jit
def _scan_operands16(i, q_ptr, k_ptr, G_ptr, qg_ptr, kg_ptr, g_last, t0, L, i_h, H, c, cm, K: tl.constexpr):
    """Tile i of q exp(Gamma) and k exp(Gamma_C - Gamma) (the scan's state-independent operands)."""
    o, m, rv = _rows16(i, t0, L, i_h, H, c, cm, K)
    G = tl.load(G_ptr + o, mask=m, other=0.0)
    qi = tl.load(q_ptr + o, mask=m, other=0.0).to(tl.float32)
    ki = tl.load(k_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(qg_ptr + o, (qi * tl.exp(G)).to(qg_ptr.dtype.element_ty), mask=m)
    tl.store(kg_ptr + o, (ki * tl.exp(g_last[None, :] - G)).to(kg_ptr.dtype.element_ty), mask=m)


@triton.jit
def _intra16_kernel(
    q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, aqk_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr, kg_ptr, eg_ptr,
    cu_ptr, cidx_ptr, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DTA: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, WITH_WY: tl.constexpr,
    DIAG: tl.constexpr,
):
    """One program per (chunk, head). WITH_WY False: phases A and B only (Aqk, T); the caller then runs
    phase C as its own kernel (``triton_forward._intra_wy_kernel``). DIAG False: the diagonal blocks of
    Aqk and diag(beta) Akk were written by ``_diag16_kernel`` (this program computes the 12 off-diagonal
    accumulators only and reads A(i, i) back for the substitution)."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    base = (i_t * H + i_h) * 4096  # chunk-major 64 x 64 buffers of this (chunk, head)
    r = tl.arange(0, 16)
    b0 = tl.load(beta_ptr + (t0 + r) * H + i_h, mask=r < L, other=0.0).to(tl.float32)
    b1 = tl.load(beta_ptr + (t0 + 16 + r) * H + i_h, mask=16 + r < L, other=0.0).to(tl.float32)
    b2 = tl.load(beta_ptr + (t0 + 32 + r) * H + i_h, mask=32 + r < L, other=0.0).to(tl.float32)
    b3 = tl.load(beta_ptr + (t0 + 48 + r) * H + i_h, mask=48 + r < L, other=0.0).to(tl.float32)

    # ---- phase A: the ten lower blocks of Aqk and Akk
    z = tl.zeros([16, 16], dtype=tl.float32)
    q00, q10, q11, q20, q21, q22, q30, q31, q32, q33 = z, z, z, z, z, z, z, z, z, z
    k00, k10, k11, k20, k21, k22, k30, k31, k32, k33 = z, z, z, z, z, z, z, z, z, z
    for kb in tl.static_range(0, K, BK):
        c = kb + tl.arange(0, BK)
        cm = c < K
        kc0, e0 = _col16(k_ptr, G_ptr, 0, t0, L, i_h, H, c, cm, K, DTA)
        kc1, e1 = _col16(k_ptr, G_ptr, 1, t0, L, i_h, H, c, cm, K, DTA)
        kc2, e2 = _col16(k_ptr, G_ptr, 2, t0, L, i_h, H, c, cm, K, DTA)
        kc3, e3 = _col16(k_ptr, G_ptr, 3, t0, L, i_h, H, c, cm, K, DTA)
        qi, ki, Gi, m = _row_tile16(0, q_ptr, k_ptr, G_ptr, t0, L, i_h, H, c, cm, K)
        if DIAG:
            q00, k00 = _pair16(q00, k00, qi, ki, Gi, m, e0, kc0, DTA, PREC)
        qi, ki, Gi, m = _row_tile16(1, q_ptr, k_ptr, G_ptr, t0, L, i_h, H, c, cm, K)
        q10, k10 = _pair16(q10, k10, qi, ki, Gi, m, e0, kc0, DTA, PREC)
        if DIAG:
            q11, k11 = _pair16(q11, k11, qi, ki, Gi, m, e1, kc1, DTA, PREC)
        qi, ki, Gi, m = _row_tile16(2, q_ptr, k_ptr, G_ptr, t0, L, i_h, H, c, cm, K)
        q20, k20 = _pair16(q20, k20, qi, ki, Gi, m, e0, kc0, DTA, PREC)
        q21, k21 = _pair16(q21, k21, qi, ki, Gi, m, e1, kc1, DTA, PREC)
        if DIAG:
            q22, k22 = _pair16(q22, k22, qi, ki, Gi, m, e2, kc2, DTA, PREC)
        qi, ki, Gi, m = _row_tile16(3, q_ptr, k_ptr, G_ptr, t0, L, i_h, H, c, cm, K)
        q30, k30 = _pair16(q30, k30, qi, ki, Gi, m, e0, kc0, DTA, PREC)
        q31, k31 = _pair16(q31, k31, qi, ki, Gi, m, e1, kc1, DTA, PREC)
        q32, k32 = _pair16(q32, k32, qi, ki, Gi, m, e2, kc2, DTA, PREC)
        if DIAG:
            q33, k33 = _pair16(q33, k33, qi, ki, Gi, m, e3, kc3, DTA, PREC)

    # Aqk: lower blocks (diagonal included), zeros above
    low = r[:, None] >= r[None, :]
    if DIAG:
        _store_diag16(aqk_ptr, base, tl.where(low, q00, 0.0), tl.where(low, q11, 0.0), tl.where(low, q22, 0.0),
                      tl.where(low, q33, 0.0))
    _store_lower16(aqk_ptr, base, q10, q20, q21, q30, q31, q32)
    for i in tl.static_range(4):
        for j in tl.static_range(i + 1, 4):
            _store16(aqk_ptr, base, i, j, z)
            _store16(tinv_ptr, base, i, j, z)

    # ---- phase B: T = (I + A)^-1, A = diag(beta) Akk strictly lower
    strict = r[:, None] > r[None, :]
    if DIAG:
        a00 = tl.where(strict, k00 * b0[:, None], 0.0)
        a11 = tl.where(strict, k11 * b1[:, None], 0.0)
        a22 = tl.where(strict, k22 * b2[:, None], 0.0)
        a33 = tl.where(strict, k33 * b3[:, None], 0.0)
    else:
        a00, a11 = _load16(tinv_ptr, base, 0), _load16(tinv_ptr, base, 1)
        a22, a33 = _load16(tinv_ptr, base, 2), _load16(tinv_ptr, base, 3)
    a10, a20, a21 = k10 * b1[:, None], k20 * b2[:, None], k21 * b2[:, None]
    a30, a31, a32 = k30 * b3[:, None], k31 * b3[:, None], k32 * b3[:, None]
    # the diagonal blocks' rows are read back from memory by the substitution (their final place: T(i, i))
    if DIAG:
        _store_diag16(tinv_ptr, base, a00, a11, a22, a33)
        tl.debug_barrier()
    d0, d1, d2, d3 = diag_inverses16(tinv_ptr, base, a00, a11, a22, a33)
    t10, t20, t21, t30, t31, t32 = block_subst16(d0, d1, d2, d3, a10, a20, a21, a30, a31, a32, SPREC)
    tl.debug_barrier()  # every row of A(i, i) read before T(i, i) overwrites it
    _store_diag16(tinv_ptr, base, d0, d1, d2, d3)
    _store_lower16(tinv_ptr, base, t10, t20, t21, t30, t31, t32)

    # ---- phase C: W = T (beta k exp(Gamma)), U = T (beta v), and the scan operands
    if not WITH_WY:
        return
    s00, s10, s11, s20, s21 = d0.to(DTC), t10.to(DTC), d1.to(DTC), t20.to(DTC), t21.to(DTC)
    s22, s30, s31, s32, s33 = d2.to(DTC), t30.to(DTC), t31.to(DTC), t32.to(DTC), d3.to(DTC)
    for kb in tl.static_range(0, K, BK):
        c = kb + tl.arange(0, BK)
        cm = c < K
        _wy_rows16(k_ptr, w_ptr, t0, L, i_h, H, c, cm, K, b0, b1, b2, b3,
                   s00, s10, s11, s20, s21, s22, s30, s31, s32, s33, DTC, PREC, G_ptr, True)
        g_last = tl.load(G_ptr + (t0 + L - 1) * (H * K) + i_h * K + c, mask=cm, other=0.0)
        for i in tl.static_range(4):
            _scan_operands16(i, q_ptr, k_ptr, G_ptr, qg_ptr, kg_ptr, g_last, t0, L, i_h, H, c, cm, K)
        tl.store(eg_ptr + (i_t * H + i_h) * K + c, tl.exp(g_last), mask=cm)
    for vb in tl.static_range(0, V, BV):
        c = vb + tl.arange(0, BV)
        cm = c < V
        _wy_rows16(v_ptr, u_ptr, t0, L, i_h, H, c, cm, V, b0, b1, b2, b3,
                   s00, s10, s11, s20, s21, s22, s30, s31, s32, s33, DTC, PREC, G_ptr, False)


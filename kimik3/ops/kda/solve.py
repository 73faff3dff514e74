"""Stage 3 of the KDA forward (Triton): T = (I + A)^-1 for each chunk's strictly lower 64 x 64 A = diag(beta) Akk,
in place in the scratch buffer ``intra.py`` wrote A to (``wy.py`` and the backward read T there). One program per
(chunk, head), one warp: the [16, 16] products lay out one warp's rows, so more warps would repeat them.
"""

from __future__ import annotations

import triton
import triton.language as tl

WARPS = 1


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
def _solve_blocks(t_ptr, base, PREC: tl.constexpr):
    """T = (I + A)^-1 for the strictly lower 64 x 64 A stored at t_ptr + base (row-major), by 16 x 16 blocks held in
    registers: the diagonal inverses by the four blocks' forward substitutions interleaved in one loop
    (``diag_inverses16``), then the block rows T_ij = -D_i sum_{j <= m < i} A_im T_mj (``block_subst16``). Writes T
    over A (one barrier) and returns it as 64 x 64."""
    r16 = tl.arange(0, 16)
    o = r16[:, None] * 64 + r16[None, :]
    a10 = tl.load(t_ptr + base + o + 16 * 64)
    a20 = tl.load(t_ptr + base + o + 32 * 64)
    a21 = tl.load(t_ptr + base + o + 32 * 64 + 16)
    a30 = tl.load(t_ptr + base + o + 48 * 64)
    a31 = tl.load(t_ptr + base + o + 48 * 64 + 16)
    a32 = tl.load(t_ptr + base + o + 48 * 64 + 32)
    d0, d1, d2, d3 = diag_inverses16(
        t_ptr, base, tl.load(t_ptr + base + o), tl.load(t_ptr + base + o + 16 * 64 + 16),
        tl.load(t_ptr + base + o + 32 * 64 + 32), tl.load(t_ptr + base + o + 48 * 64 + 48))
    t10, t20, t21, t30, t31, t32 = block_subst16(d0, d1, d2, d3, a10, a20, a21, a30, a31, a32, PREC)
    tl.debug_barrier()  # every block of A is read before T overwrites it (upper blocks stay zero)
    tl.store(t_ptr + base + o, d0)
    tl.store(t_ptr + base + o + 16 * 64, t10)
    tl.store(t_ptr + base + o + 16 * 64 + 16, d1)
    tl.store(t_ptr + base + o + 32 * 64, t20)
    tl.store(t_ptr + base + o + 32 * 64 + 16, t21)
    tl.store(t_ptr + base + o + 32 * 64 + 32, d2)
    tl.store(t_ptr + base + o + 48 * 64, t30)
    tl.store(t_ptr + base + o + 48 * 64 + 16, t31)
    tl.store(t_ptr + base + o + 48 * 64 + 32, t32)
    tl.store(t_ptr + base + o + 48 * 64 + 48, d3)
    tl.debug_barrier()
    r = tl.arange(0, 64)
    return tl.load(t_ptr + base + r[:, None] * 64 + r[None, :])

@triton.jit
def _solve_kernel(tinv_ptr, H, PREC: tl.constexpr):
    """One program per (chunk, head): T written over A."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    _solve_blocks(tinv_ptr, (i_t * H + i_h) * 4096, PREC)


def launch(tinv, plan, H, PREC) -> None:
    """T = (I + A)^-1 over every chunk and head of tinv ([NT, H, 64, 64] fp32), in place."""
    _solve_kernel[(plan.NT, H)](tinv, H, PREC=PREC, num_warps=WARPS)

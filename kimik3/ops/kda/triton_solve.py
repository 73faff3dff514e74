"""Phase B of the Triton KDA forward: T = (I + A)^-1 for a chunk's strictly lower 64 x 64 A (A = diag(beta) Akk),
in place in the scratch buffer phase A wrote A to (the Triton backward reads T there). ``triton_forward`` runs it
inside the fused intra kernel or as ``_intra_solve_kernel`` (one program per chunk and head); ``SOLVE`` there picks
the form (``_solve``)."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_intra16 import block_subst16, diag_inverses16


@triton.jit
def _inv16(a, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower 16 x 16 block (nilpotent, a^16 = 0), in registers:
    (I + n)(I + n^2)(I + n^4)(I + n^8) with n = -a -- six dense 16 x 16 products, no serial row loop."""
    r16 = tl.arange(0, 16)
    n = -a
    p = n + (r16[:, None] == r16[None, :]).to(tl.float32)
    for _ in tl.static_range(3):
        n = tl.dot(n, n, input_precision=PREC)
        p += tl.dot(p, n, input_precision=PREC)
    return p


@triton.jit
def _solve_blocks(t_ptr, base, PREC: tl.constexpr, SUBST: tl.constexpr):
    """SOLVE 3 / 4: T = (I + A)^-1 for the strictly lower 64 x 64 A stored at t_ptr + base (row-major), by
    16 x 16 blocks held in registers: the diagonal inverses by ``_inv16`` (SUBST False) or by the four
    blocks' forward substitutions interleaved in one loop (SUBST True; ``triton_intra16.diag_inverses16``),
    then the block rows T_ij = -D_i sum_{j <= m < i} A_im T_mj. Writes T over A (one barrier) and returns
    it as 64 x 64."""
    r16 = tl.arange(0, 16)
    o = r16[:, None] * 64 + r16[None, :]
    a10 = tl.load(t_ptr + base + o + 16 * 64)
    a20 = tl.load(t_ptr + base + o + 32 * 64)
    a21 = tl.load(t_ptr + base + o + 32 * 64 + 16)
    a30 = tl.load(t_ptr + base + o + 48 * 64)
    a31 = tl.load(t_ptr + base + o + 48 * 64 + 16)
    a32 = tl.load(t_ptr + base + o + 48 * 64 + 32)
    if SUBST:
        d0, d1, d2, d3 = diag_inverses16(
            t_ptr, base, tl.load(t_ptr + base + o), tl.load(t_ptr + base + o + 16 * 64 + 16),
            tl.load(t_ptr + base + o + 32 * 64 + 32), tl.load(t_ptr + base + o + 48 * 64 + 48))
    else:
        d0 = _inv16(tl.load(t_ptr + base + o), PREC)
        d1 = _inv16(tl.load(t_ptr + base + o + 16 * 64 + 16), PREC)
        d2 = _inv16(tl.load(t_ptr + base + o + 32 * 64 + 32), PREC)
        d3 = _inv16(tl.load(t_ptr + base + o + 48 * 64 + 48), PREC)
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
def _solve(tinv_ptr, a_base, SOLVE: tl.constexpr, SPREC: tl.constexpr, ABLATE: tl.constexpr):
    """Phase B: T = (I + A)^-1 for the strictly lower A at tinv_ptr + a_base, written over A (the Triton
    backward reads T there); returns T as a 64 x 64 fp32 tile. SOLVE 0: 16 x 16 forward substitution on
    the diagonal blocks and block forward substitution over the row tiles; 3: ``_solve_blocks``."""
    r = tl.arange(0, 64)
    r16 = tl.arange(0, 16)
    if ABLATE == 1:
        t_all = tl.load(tinv_ptr + a_base + r[:, None] * 64 + r[None, :])
    elif SOLVE == 3 or SOLVE == 4:
        t_all = _solve_blocks(tinv_ptr, a_base, SPREC, SOLVE == 4)
    else:
        for i in tl.static_range(4):
            rows = i * 16 + r16
            # diagonal block inverse by forward substitution (fla's solve_tril 16 x 16)
            d_off = a_base + rows[:, None] * 64 + (i * 16 + r16)[None, :]
            b = -tl.where(r16[:, None] > r16[None, :], tl.load(tinv_ptr + d_off), 0.0)
            for rr in range(2, 16):
                a = -tl.load(tinv_ptr + a_base + (i * 16 + rr) * 64 + i * 16 + r16)
                a = tl.where(r16 < rr, a, 0.0)
                a = a + tl.sum(a[:, None] * b, 0)
                b = tl.where((r16 == rr)[:, None], a[None, :], b)
            dinv = b + (r16[:, None] == r16[None, :]).to(tl.float32)
            # T_i = Dinv_i (E_i - A_{i,<i} T_{<i})
            rhs = (r[None, :] == rows[:, None]).to(tl.float32)
            if i > 0:
                a_row = tl.load(tinv_ptr + a_base + rows[:, None] * 64 + r[None, :],
                                mask=(r < i * 16)[None, :], other=0.0)
                t_prev = tl.load(tinv_ptr + a_base + r[:, None] * 64 + r[None, :],
                                 mask=(r < i * 16)[:, None], other=0.0)
                rhs -= tl.dot(a_row, t_prev, input_precision="tf32x3")
            t_i = tl.dot(dinv, rhs, input_precision="tf32x3")
            tl.debug_barrier()
            tl.store(tinv_ptr + a_base + rows[:, None] * 64 + r[None, :], t_i)
            tl.debug_barrier()
        t_all = tl.load(tinv_ptr + a_base + r[:, None] * 64 + r[None, :])
    return t_all

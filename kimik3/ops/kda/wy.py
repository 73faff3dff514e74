"""Stage 4 of the KDA forward (Triton): the WY / UT representation of each chunk, and the scan's operands.

With T = (I + diag(beta) Akk)^-1 from ``solve.py``: W = T (beta k exp(Gamma)), U = T (beta v), and the operands of
the state scan that do not depend on the state (so they stay off its serial path): qg = q exp(Gamma),
kg = k exp(Gamma_C - Gamma) and the chunk decay exp(Gamma_C). One program per (chunk, head, 64-column K block or
V block). On Hopper the Gluon kernel ``gluon/wy.py`` computes the same (``dispatch.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import _chunk_beta, _chunk_part, part_grid

WARPS = 4


@triton.jit
def _wy_k_block(kb, t_all, q_ptr, k_ptr, G_ptr, w_ptr, qg_ptr, kg_ptr, eg_ptr, beta, t0, L, i_t, i_h, H,
                K: tl.constexpr, BK: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr):
    """Phase C, key columns [kb, kb + BK): W = T (beta k exp(Gamma)) and the scan operands, which do not
    depend on the state (so they stay off the scan's serial path): q exp(Gamma), k exp(Gamma_C - Gamma)
    and the chunk decay exp(Gamma_C)."""
    r = tl.arange(0, 64)
    c = kb + tl.arange(0, BK)
    mr = (r < L)[:, None] & (c < K)[None, :]
    ro = (t0 + r)[:, None] * (H * K) + i_h * K + c[None, :]
    Gr = tl.load(G_ptr + ro, mask=mr, other=0.0)
    kr = tl.load(k_ptr + ro, mask=mr, other=0.0).to(tl.float32)
    eG = tl.exp(Gr)
    rk = tl.where(mr, kr * beta[:, None] * eG, 0.0)
    w = tl.dot(t_all, rk.to(DTC), input_precision=PREC)
    tl.store(w_ptr + ro, w.to(w_ptr.dtype.element_ty), mask=mr)
    g_last = tl.load(G_ptr + (t0 + L - 1) * (H * K) + i_h * K + c, mask=c < K, other=0.0)
    qr = tl.load(q_ptr + ro, mask=mr, other=0.0).to(tl.float32)
    tl.store(qg_ptr + ro, tl.where(mr, qr * eG, 0.0).to(qg_ptr.dtype.element_ty), mask=mr)
    kg = tl.where(mr, kr * tl.exp(g_last[None, :] - Gr), 0.0)
    tl.store(kg_ptr + ro, kg.to(kg_ptr.dtype.element_ty), mask=mr)
    tl.store(eg_ptr + (i_t * H + i_h) * K + c, tl.exp(g_last), mask=c < K)


@triton.jit
def _wy_v_block(vb, t_all, v_ptr, u_ptr, beta, t0, L, i_h, H,
                V: tl.constexpr, BV: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr):
    """Phase C, value columns [vb, vb + BV): U = T (beta v)."""
    r = tl.arange(0, 64)
    c = vb + tl.arange(0, BV)
    mr = (r < L)[:, None] & (c < V)[None, :]
    ro = (t0 + r)[:, None] * (H * V) + i_h * V + c[None, :]
    vr = tl.load(v_ptr + ro, mask=mr, other=0.0).to(tl.float32)
    u = tl.dot(t_all, (vr * beta[:, None]).to(DTC), input_precision=PREC)
    tl.store(u_ptr + ro, u.to(u_ptr.dtype.element_ty), mask=mr)


@triton.jit
def _intra_wy_kernel(q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr, kg_ptr, eg_ptr,
                     cu_ptr, cidx_ptr, H,
                     K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NKB: tl.constexpr,
                     NP: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr):
    """Phase C, one program per (chunk, head, K block or V block)."""
    i_t, i_h, p = _chunk_part(NP)
    t0, L, r, beta = _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H)
    t_all = tl.load(tinv_ptr + (i_t * H + i_h) * 4096 + r[:, None] * 64 + r[None, :]).to(DTC)
    if p < NKB:
        _wy_k_block(p * BK, t_all, q_ptr, k_ptr, G_ptr, w_ptr, qg_ptr, kg_ptr, eg_ptr, beta, t0, L, i_t, i_h, H,
                    K, BK, DTC, PREC)
    else:
        _wy_v_block((p - NKB) * BV, t_all, v_ptr, u_ptr, beta, t0, L, i_h, H, V, BV, DTC, PREC)


# --------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------

def launch(qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan, H, K, V, BK, BV, DTC, PREC) -> None:
    """W, U, qg, kg (token layout) and eg ([NT, H, K]) from the chunk's T in tinv."""
    nkb = triton.cdiv(K, BK)
    nparts = nkb + triton.cdiv(V, BV)
    _intra_wy_kernel[part_grid(plan.NT, H, nparts)](
        qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan.cu, plan.chunk_idx, H,
        K=K, V=V, BK=BK, BV=BV, NKB=nkb, NP=nparts, DTC=DTC, PREC=PREC, num_warps=WARPS,
    )

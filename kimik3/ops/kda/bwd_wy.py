"""Stage 2 of the KDA backward (Triton): the WY backward, the V-contractions of each chunk.

With dRv = T^T dv_new from ``bwd_scan.py``, the stored states S and their gradients dS' (per chunk):
    dqg = dO S^T, dkg = v_new dS'^T, deg = rowsum(S * dS'), dAqk = dO v_new^T,
    dRk = -dRv S^T, dA = -(dRk W^T + dRv U^T) (strict lower), dv = beta dRv,
then the chain rule through the exponentials (dGamma = x * dx for every x = y e^(+-Gamma)). One program per (chunk,
head, part): a part per 64-column key block and one for the K-independent products, each with its partial dA and
dbeta, which the intra backward sums. On Hopper the Gluon kernel ``gluon/bwd_wy.py`` does one (chunk, head) per item
(``dispatch.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import _chunk_beta, _chunk_part, _load_rows, part_grid

# The kept V loops' pipeline stages for 16-bit stored states (1: none; 3: the next V block's tiles load while this
# one's products run; 184 KB of shared memory and 255 registers on sm_90, no spill). fp32 states: 1 (three stages
# would take 224 of the H200's 227 KB and spill anyway).
STAGES_16BIT = 3


@triton.jit
def _wy_v_side(v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, beta, rv, vbase, H, scale,
               V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr):
    """The K-independent products over every V block: dAqk = dO v_new^T, the U part of dA (-dRv U^T), dv = beta dRv
    (stored) and the v part of dbeta, with dRv = T^T dv_new from memory (over dv_new). The V blocks in a loop the
    compiler keeps, pipelined over STAGES stages."""
    r = tl.arange(0, 64)
    daqk = tl.zeros([64, 64], dtype=tl.float32)
    da = tl.zeros([64, 64], dtype=tl.float32)
    dbeta = tl.zeros([64], dtype=tl.float32)
    for vb in tl.range(0, V, BV, num_stages=STAGES):
        daqk, da, dbeta = _wy_v_step(vb, v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, beta, daqk, da, dbeta, r, rv,
                                     vbase, H, scale, V, BV, PREC)
    return daqk, da, dbeta


@triton.jit
def _wy_v_step(vb, v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, beta, daqk, da, dbeta, r, rv, vbase, H,
               scale, V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """One V block of ``_wy_v_side``'s products, added to its accumulators (dv stored)."""
    cv = vb + tl.arange(0, BV)
    mv = rv[:, None] & (cv < V)[None, :]
    vo = vbase + r[:, None] * (H * V) + cv[None, :]
    row_off = vbase + r * (H * V)
    do = tl.load(do_ptr + vo, mask=mv, other=0.0).to(tl.float32) * scale
    vn = _load_rows(vn_ptr, row_off, rv, vb, V, BV)
    drv = _load_rows(dvn_ptr, row_off, rv, vb, V, BV)  # dRv
    u = _load_rows(u_ptr, row_off, rv, vb, V, BV).to(tl.float32)
    vv = tl.load(v_ptr + vo, mask=mv, other=0.0).to(tl.float32)
    daqk += tl.dot(do, tl.trans(vn), input_precision=PREC)
    da -= tl.dot(drv, tl.trans(u), input_precision=PREC)
    tl.store(dv_ptr + vo, (drv * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mv)
    dbeta += tl.sum(drv * vv, axis=1)
    return daqk, da, dbeta


@triton.jit
def _wy_k_step(vb, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, dqg, dkg, drk, deg, r, rv, ck, km, vbase, hb, H,
               V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DQ16: tl.constexpr):
    """One V block of ``_wy_k_side``'s products, added to its accumulators."""
    cv = vb + tl.arange(0, BV)
    vm = cv < V
    mv = rv[:, None] & vm[None, :]
    vo = vbase + r[:, None] * (H * V) + cv[None, :]
    hoff = hb + ck[:, None] * V + cv[None, :]
    hm = km[:, None] & vm[None, :]
    hs16 = tl.load(h_ptr + hoff, mask=hm, other=0.0)
    hs = hs16.to(tl.float32)
    dhs = _load_rows(dh_ptr, hb + ck * V, km, vb, V, BV)
    row_off = vbase + r * (H * V)
    vn = _load_rows(vn_ptr, row_off, rv, vb, V, BV)
    drv = _load_rows(dvn_ptr, row_off, rv, vb, V, BV)  # dRv
    hsT = tl.trans(hs)
    if DQ16:
        dqg += tl.dot(tl.load(do_ptr + vo, mask=mv, other=0.0), tl.trans(hs16))
    else:
        dqg += tl.dot(tl.load(do_ptr + vo, mask=mv, other=0.0).to(tl.float32), hsT, input_precision=PREC)
    dkg += tl.dot(vn, tl.trans(dhs), input_precision=PREC)
    drk -= tl.dot(drv, hsT, input_precision=PREC)
    deg += tl.sum(hs * dhs, axis=1)
    return dqg, dkg, drk, deg


@triton.jit
def _wy_k_side(kb, q_ptr, k_ptr, G_ptr, w_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, dq_ptr, dk_ptr, dG_ptr,
               beta, rv, L, t0, i_h, kbase, vbase, hb, H, scale,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
               DQ16: tl.constexpr, STAGES: tl.constexpr):
    """Key columns [kb, kb + BK): dqg = dO S^T, dkg = v_new dS'^T, dRk = -dRv S^T and deg over every V block (a loop
    the compiler keeps, pipelined over STAGES stages: the kernel runs one CTA per SM, so only in-program prefetching
    hides its loads), then the chain rule through the exponentials; stores dq, dk and dGamma (partials the intra
    backward completes) and returns this block's part of dA (-dRk W^T) and of dbeta. DQ16: dO and the stored states
    S share a 16-bit dtype, so dO S^T takes them as they are (exact products, fp32 sums)."""
    r = tl.arange(0, 64)
    ck = kb + tl.arange(0, BK)
    km = ck < K
    dqg = tl.zeros([64, BK], dtype=tl.float32)
    dkg = tl.zeros([64, BK], dtype=tl.float32)
    drk = tl.zeros([64, BK], dtype=tl.float32)
    deg = tl.zeros([BK], dtype=tl.float32)
    for vb in tl.range(0, V, BV, num_stages=STAGES):
        dqg, dkg, drk, deg = _wy_k_step(vb, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, dqg, dkg, drk, deg, r, rv, ck, km,
                                        vbase, hb, H, V, BV, PREC, DQ16)
    dqg *= scale
    mk = rv[:, None] & km[None, :]
    ko = kbase + r[:, None] * (H * K) + ck[None, :]
    q = tl.load(q_ptr + ko, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + ko, mask=mk, other=0.0).to(tl.float32)
    G = _load_rows(G_ptr, kbase + r * (H * K), rv, kb, K, BK)
    w = tl.load(w_ptr + ko, mask=mk, other=0.0).to(tl.float32)
    g_last = tl.load(G_ptr + (t0 + L - 1) * (H * K) + i_h * K + ck, mask=km, other=0.0)
    eG = tl.where(mk, tl.exp(G), 0.0)
    eC = tl.where(mk, tl.exp(g_last[None, :] - G), 0.0)
    dG = dqg * (q * eG) - dkg * (k * eC) + drk * (beta[:, None] * k * eG)
    dgc = tl.sum(dkg * (k * eC), axis=0) + deg * tl.exp(g_last)
    dG += tl.where((r == L - 1)[:, None], dgc[None, :], 0.0)
    tl.store(dq_ptr + ko, dqg * eG, mask=mk)
    tl.store(dk_ptr + ko, dkg * eC + beta[:, None] * eG * drk, mask=mk)
    tl.store(dG_ptr + ko, dG, mask=mk)
    return -tl.dot(drk, tl.trans(w), input_precision=PREC), tl.sum(drk * k * eG, axis=1)


@triton.jit
def _bwd_wy_kernel(
    q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, w_ptr, u_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr,
    dq_ptr, dk_ptr, dG_ptr, dv_ptr, dbeta_ptr, daqk_ptr, da_ptr,
    cu_ptr, cidx_ptr, H, scale, part_beta, part_a,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    NPART: tl.constexpr, DQ16: tl.constexpr, STAGES: tl.constexpr,
):
    """One (chunk, head, part): part p < cdiv(K, BK) (``_chunk_part``) does key block p alone and p = cdiv(K, BK) the
    K-independent products; each writes its own partial dA and dbeta (part_a / part_beta elements apart), which the
    intra backward (``bwd_intra.py``) sums."""
    i_t, i_h, i_p = _chunk_part(NPART)
    t0, L, r, beta = _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H)
    rv = r < L
    # 64-bit offsets only in the scalar bases; the tiles' offsets stay 32-bit (fewer registers)
    a_base = (i_t * H + i_h) * 4096
    kbase = (t0 * H + i_h) * K  # token t0 + row, head i_h, in a [.., H, K] tensor: kbase + row * H * K
    vbase = (t0 * H + i_h) * V
    hb = (i_t * H + i_h) * (K * V)
    o2 = a_base + r[:, None] * 64 + r[None, :]
    NKB: tl.constexpr = (K + BK - 1) // BK
    if i_p == NKB:
        daqk, da, dbeta = _wy_v_side(v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, beta, rv, vbase, H, scale, V, BV,
                                     PREC, STAGES)
        tl.store(daqk_ptr + o2, tl.where(r[:, None] >= r[None, :], daqk, 0.0))
    else:
        da, dbeta = _wy_k_side(i_p * BK, q_ptr, k_ptr, G_ptr, w_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr,
                               dq_ptr, dk_ptr, dG_ptr, beta, rv, L, t0, i_h, kbase, vbase, hb, H, scale,
                               K, V, BK, BV, PREC, DQ16, STAGES)
    i_p64 = i_p.to(tl.int64)  # partial offsets can pass 2^31
    tl.store(da_ptr + i_p64 * part_a + o2, tl.where(r[:, None] > r[None, :], da, 0.0))
    tl.store(dbeta_ptr + i_p64 * part_beta + (t0 + r) * H + i_h, dbeta, mask=rv)


def launch(q, k, v, G, beta, w, u, h, dh, vn, drv, do, dq, dk, dG, dv, dbeta_parts, daqk, da, plan, H, K, V, BKF, BK,
           BV, scale, PREC) -> int:
    """The WY backward; da [npart, NT, H, 64, 64] and dbeta_parts [npart, B, T, H] take the parts' partials. Returns
    npart (``parts``)."""
    NT = plan.NT
    npart = parts(K, BK)
    h16 = h.dtype in (torch.bfloat16, torch.float16)
    warps = 8 if BKF >= 128 else 4  # sm_90 compile: 176 B spilled at 8 warps, 1.7 KB at 4
    _bwd_wy_kernel[part_grid(NT, H, npart)](
        q, k, v, G, beta, w, u, h, dh, vn, drv, do, dq, dk, dG, dv, dbeta_parts, daqk, da, plan.cu, plan.chunk_idx, H,
        float(scale), dbeta_parts.shape[1:].numel(), NT * H * 4096,
        K=K, V=V, BK=BK, BV=BV, PREC=PREC, NPART=npart, DQ16=h16 and do.dtype == h.dtype,
        STAGES=STAGES_16BIT if h16 else 1, num_warps=warps,
    )
    return npart


def parts(K: int, BK: int) -> int:
    """Programs per (chunk, head): one per BK-column key block and one for the K-independent products."""
    return triton.cdiv(K, BK) + 1

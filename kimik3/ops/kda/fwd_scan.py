"""Stage 5 of the KDA forward (Triton): the inter-chunk state scan, then the chunks' outputs in parallel.

Per chunk (C = 64 tokens; W, U, qg, kg, eg from ``wy.py`` and Aqk from ``intra.py``), with S the state entering it:
    v_new = U - W S,   o = scale (qg S + Aqk v_new),   S <- eg * S + kg^T v_new.
``_fwd_h_kernel`` per (V block, sequence x head) runs the serial part: it stores each chunk's entry state h
[NT, H, K, V] and v_new (the backward reads both) and the final state. ``_output_kernel`` then computes o in parallel
over (V block, chunk, head), off the scan's serial path. Stored states take the scan operands' dtype (16-bit for
16-bit inputs). For 16-bit inputs every product takes 16-bit operands, with v_new and Aqk split into high and low
parts (``_split16``): near-fp32 products at 16-bit operand width. On Hopper the Gluon scan (``gluon/scan.py``)
replaces both kernels where it applies (``dispatch.py``).
"""

from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl

from .plan import INTERPRET, next_pow2
from .triton_common import _chunk_bounds, _chunk_tiles, _scan_program, _split16, _state_tile

# The scan's (V block, num_warps, num_stages): at 64 / 4 / 2 it takes 234 registers and 104 KB on sm_90, two CTAs per
# SM, so K3's 192 chains (H 96, two V blocks) run in one wave.
SCAN_CONFIG: Tuple[int, int, int] = (64, 4, 2)
# The output kernel's (V block, num_warps): it streams qg, Aqk, h and v_new once per V block, so a wider block reads
# qg and Aqk fewer times.
OUTPUT_CONFIG: Tuple[int, int] = (64, 4)


@triton.jit
def _fwd_h_step(kg_ptr, eg_ptr, w_ptr, u_ptr, h_ptr, vn_ptr, h, i_c, bos, eos, coff, i_h, H,
                K: tl.constexpr, V: tl.constexpr, ck, cv, PREC: tl.constexpr, DT: tl.constexpr,
                HILO: tl.constexpr):
    """One chunk of the scan: store its entry state and v_new, return the state after it. DT 16-bit: W and the state
    as 16-bit operands, v_new split into high and low parts when HILO."""
    r, rv, mk, mv, ko, vo = _chunk_tiles(i_c, bos, eos, i_h, H, K, V, ck, cv)
    km = ck < K
    hoff = ((coff + i_c) * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :]
    tl.store(h_ptr + hoff, h.to(h_ptr.dtype.element_ty), mask=km[:, None] & (cv < V)[None, :])
    w = tl.load(w_ptr + ko, mask=mk, other=0.0).to(DT)
    u = tl.load(u_ptr + vo, mask=mv, other=0.0).to(tl.float32)
    kgT = tl.trans(tl.load(kg_ptr + ko, mask=mk, other=0.0).to(DT))
    eg = tl.load(eg_ptr + ((coff + i_c) * H + i_h) * K + ck, mask=km, other=0.0)
    v_new = u - tl.dot(w, h.to(DT), input_precision=PREC)
    tl.store(vn_ptr + vo, v_new, mask=mv)
    v_hi, v_lo = _split16(v_new, DT)  # fp32 DT: v_hi is v_new
    h = h * eg[:, None] + tl.dot(kgT, v_hi, input_precision=PREC)
    if HILO and DT != tl.float32:
        h += tl.dot(kgT, v_lo, input_precision=PREC)
    return h


@triton.jit
def _fwd_h_kernel(kg_ptr, eg_ptr, w_ptr, u_ptr, h0_ptr, h_ptr, vn_ptr, ht_ptr, cu_ptr, coff_ptr, H,
                  K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
                  PREC: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, INTERP: tl.constexpr,
                  DT: tl.constexpr, HILO: tl.constexpr):
    i_h, bos, eos, coff, ck, cv, s_off, sm = _scan_program(cu_ptr, coff_ptr, H, K, V, BKF, BV)
    h = _state_tile(h0_ptr, s_off, sm, HAS_H0, BKF, BV)
    NC = tl.cdiv(eos - bos, 64)
    if INTERP:  # the interpreter cannot range() over a loaded scalar (NOTES-kda.md)
        i_c = 0
        while i_c < NC:
            h = _fwd_h_step(kg_ptr, eg_ptr, w_ptr, u_ptr, h_ptr, vn_ptr, h, i_c, bos, eos, coff, i_h, H,
                            K, V, ck, cv, PREC, DT, HILO)
            i_c += 1
    else:
        for i_c in range(0, NC):
            h = _fwd_h_step(kg_ptr, eg_ptr, w_ptr, u_ptr, h_ptr, vn_ptr, h, i_c, bos, eos, coff, i_h, H,
                            K, V, ck, cv, PREC, DT, HILO)
    if STORE_HT:
        tl.store(ht_ptr + s_off, h, mask=sm)



@triton.jit
def _output_kernel(qg_ptr, aqk_ptr, h_ptr, vn_ptr, o_ptr, cu_ptr, cidx_ptr, H, scale,
                   K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
                   PREC: tl.constexpr, DT: tl.constexpr, HILO: tl.constexpr):
    """o = scale (qg S + Aqk v_new) for one chunk, from the entry state S and v_new the states-only
    scan stored: the output leaves the scan's serial path. DT 16-bit: 16-bit operands, with Aqk and
    v_new split into high and low parts when HILO, as the scan's own products are."""
    i_v = tl.program_id(0)
    i_t = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    r = tl.arange(0, 64)
    ck = tl.arange(0, BKF)
    cv = i_v * BV + tl.arange(0, BV)
    rv = r < L
    km = ck < K
    vm = cv < V
    mv = rv[:, None] & vm[None, :]
    vo = (t0 + r)[:, None] * (H * V) + i_h * V + cv[None, :]
    qg = tl.load(qg_ptr + (t0 + r)[:, None] * (H * K) + i_h * K + ck[None, :], mask=rv[:, None] & km[None, :],
                 other=0.0).to(DT)
    h = tl.load(h_ptr + (i_t * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :],
                mask=km[:, None] & vm[None, :], other=0.0).to(DT)
    a = tl.load(aqk_ptr + (i_t * H + i_h) * 4096 + r[:, None] * 64 + r[None, :])
    vn = tl.load(vn_ptr + vo, mask=mv, other=0.0)
    a_hi, a_lo = _split16(a, DT)  # fp32 DT: a_hi is a
    vn_hi, vn_lo = _split16(vn, DT)
    o = tl.dot(qg, h, input_precision=PREC) + tl.dot(a_hi, vn_hi, input_precision=PREC)
    if HILO and DT != tl.float32:
        o += tl.dot(a_hi, vn_lo) + tl.dot(a_lo, vn_hi)
    tl.store(o_ptr + vo, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)


def launch(kg, eg, w, u, h0, h, vn, ht, qg, aqk, o, plan, H, K, V, scale, PREC, DT, hilo) -> None:
    """The scan (h, v_new and the final state ht, when not None; h0: the initial state or None), then the output."""
    BKF = next_pow2(K)
    BV, warps, stages = SCAN_CONFIG
    BV = min(BV, next_pow2(V))
    dummy = w
    _fwd_h_kernel[(triton.cdiv(V, BV), plan.N * H)](
        kg, eg, w, u, h0 if h0 is not None else dummy, h, vn, ht if ht is not None else dummy, plan.cu,
        plan.chunk_off, H, K=K, V=V, BKF=BKF, BV=BV, PREC=PREC, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        INTERP=INTERPRET, DT=DT, HILO=hilo, num_warps=warps, num_stages=stages,
    )
    BV, warps = OUTPUT_CONFIG
    BV = min(BV, next_pow2(V))
    _output_kernel[(triton.cdiv(V, BV), plan.NT, H)](
        qg, aqk, h, vn, o, plan.cu, plan.chunk_idx, H, float(scale),
        K=K, V=V, BKF=BKF, BV=BV, PREC=PREC, DT=DT, HILO=hilo, num_warps=warps,
    )

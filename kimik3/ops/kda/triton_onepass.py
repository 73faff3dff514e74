"""The chunk-local forward in one pass per (chunk, head) (``KIMIK3_KDA_INTRA=onepass``), for K <= 128.

The split forward streams the same chunk tiles through four kernels: the prologue writes Gamma (fp32) and
the normalised q, k, which phase A (Aqk, A) and phase C (W, U and the scan operands) read back from DRAM,
about 2.4 GB of traffic at K3's shape beyond the inputs. Here one program per (chunk, head) loads the raw
q, k, g, beta once and keeps Gamma, q and k in registers from the prologue to the scan operands:

  prologue  g = g_min sigmoid(exp(A_log) (z + dt_bias)) (with the gate fused), Gamma = cumsum(g) down the
            chunk, q, k <- x / |x| rounded to the input dtype (as the prologue kernel stores them), beta's
            sigmoid; stored only when the backward needs them (``store_prep``).
  phase A   for each 16-column tile j, against eps_j = Gamma at the tile's last valid token (the gate bound
            keeps e^(Gamma_t - eps_j) <= e^80 and e^(eps_j - Gamma_s) >= e^-80): Aqk and diag(beta) A as
            full-width [64, K] x [K, 64] products whose key operand is zero outside tile j (four times the
            products of ``triton_forward._a_tile``, none of its re-reads). Rows in a tile's past are masked
            before the exponential.
  phase B   T = (I + A)^-1 through the chunk's scratch tile (``triton_forward._solve``), behind a barrier.
  phase C   W = T (beta k e^Gamma), U = T (beta v), qg = q e^Gamma, kg = k e^(Gamma_C - Gamma), e^Gamma_C.

Outputs and their dtypes are those of the split kernels, so the scans, the output kernel and the backward
take them unchanged.

Timed on the H200 at K3's shape (BENCHMARKS.md, tenth session): 3.50 ms for this kernel against 1.96 ms for the
four split kernels it replaces (forward 4.47 against 2.91 ms). One 8-warp CTA per SM (255 registers, 112 B
spilled) walks the phases in series, so it is latency-bound and its smaller traffic does not show. It stays
an option, not the default.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_forward import _gate_gamma, _l2_scale, _solve
from .triton_scan import _chunk_block


@triton.jit
def _row(x, r, i):
    """Row i of a [64, N] register tile, as an [N] vector."""
    return tl.sum(tl.where((r == i)[:, None], x, 0.0), axis=0)


@triton.jit
def _onepass_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, g_min,
    G_ptr, qn_ptr, kn_ptr, betan_ptr,
    aqk_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr, kg_ptr, eg_ptr,
    cu_ptr, cidx_ptr, H,
    K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
    DTA: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, SOLVE: tl.constexpr,
    USE_GATE: tl.constexpr, USE_L2: tl.constexpr, USE_BETA_SIG: tl.constexpr, STORE_PREP: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, r, rv, c, cm, m, offs = _chunk_block(i_t, i_h, 0, cidx_ptr, cu_ptr, H, K, BKF)
    L = tl.sum(rv.to(tl.int32), axis=0)
    # prologue, in registers; q and k are kept in the input dtype (the L2 norm rounded to it, as the prologue
    # kernel stores them for the split kernels), Gamma in fp32
    G = _gate_gamma(g_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, USE_GATE)
    q = tl.load(q_ptr + offs, mask=m, other=0.0)
    k = tl.load(k_ptr + offs, mask=m, other=0.0)
    if USE_L2:
        q = _l2_scale(q.to(tl.float32)).to(q_ptr.dtype.element_ty)
        k = _l2_scale(k.to(tl.float32)).to(k_ptr.dtype.element_ty)
    bo = (t0 + r) * H + i_h
    beta = tl.load(beta_ptr + bo, mask=rv, other=0.0).to(tl.float32)
    if USE_BETA_SIG:
        beta = tl.where(rv, tl.sigmoid(beta), 0.0)
    if STORE_PREP:  # what the backward reads
        tl.store(G_ptr + offs, G, mask=m)
        if USE_L2:
            tl.store(qn_ptr + offs, q, mask=m)
            tl.store(kn_ptr + offs, k, mask=m)
        if USE_BETA_SIG:
            tl.store(betan_ptr + bo, beta, mask=rv)
    # the scan operands, so that q is not live past phase A
    g_last = _row(G, r, L - 1)
    tl.store(qg_ptr + offs, tl.where(m, q.to(tl.float32) * tl.exp(G), 0.0).to(qg_ptr.dtype.element_ty), mask=m)
    kg = tl.where(m, k.to(tl.float32) * tl.exp(g_last[None, :] - G), 0.0)
    tl.store(kg_ptr + offs, kg.to(kg_ptr.dtype.element_ty), mask=m)
    tl.store(eg_ptr + (i_t * H + i_h) * K + c, tl.exp(g_last), mask=cm)
    # phase A: Aqk (lower) and diag(beta) A (strictly lower), one 16-column tile at a time, each stored as it
    # is made (no [64, 64] accumulators held)
    NEG = float("-inf")
    a_base = (i_t * H + i_h) * 4096
    o2 = a_base + r[:, None] * 64 + r[None, :]
    for j in tl.static_range(4):
        g_ref = _row(G, r, tl.minimum(j * 16 + 15, L - 1))  # eps_j
        row_ok = rv & (r >= j * 16)  # rows before tile j are in its past
        in_tile = row_ok & (r < j * 16 + 16)
        e_r = tl.exp(tl.where(row_ok[:, None] & cm[None, :], G - g_ref[None, :], NEG))  # (0, e^80]
        e_s = tl.exp(tl.where(in_tile[:, None] & cm[None, :], g_ref[None, :] - G, NEG))  # [e^-80, 1], 0 outside
        kc = tl.trans((k.to(tl.float32) * e_s).to(DTA))
        aq = tl.dot((q.to(tl.float32) * e_r).to(DTA), kc, input_precision=PREC)
        ak = tl.dot((k.to(tl.float32) * e_r).to(DTA), kc, input_precision=PREC)
        cols = (r >= j * 16) & (r < j * 16 + 16)
        tl.store(aqk_ptr + o2, tl.where(r[:, None] >= r[None, :], aq, 0.0), mask=cols[None, :])
        tl.store(tinv_ptr + o2, tl.where(r[:, None] > r[None, :], ak * beta[:, None], 0.0), mask=cols[None, :])
    # phase C's key operand, made before the solve so that Gamma and k are not live across it
    rk = tl.where(m, k.to(tl.float32) * beta[:, None] * tl.exp(G), 0.0).to(DTC)
    tl.debug_barrier()
    # phase B
    t_all = _solve(tinv_ptr, a_base, SOLVE, SPREC, 0).to(DTC)
    # phase C
    w = tl.dot(t_all, rk, input_precision=PREC)
    tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=m)
    for vb in tl.static_range(0, V, BV):
        cv = vb + tl.arange(0, BV)
        mv = rv[:, None] & (cv < V)[None, :]
        vo = (t0 + r)[:, None] * (H * V) + i_h * V + cv[None, :]
        vr = tl.load(v_ptr + vo, mask=mv, other=0.0).to(tl.float32)
        u = tl.dot(t_all, (vr * beta[:, None]).to(DTC), input_precision=PREC)
        tl.store(u_ptr + vo, u.to(u_ptr.dtype.element_ty), mask=mv)


def launch_onepass(q, k, v, g, beta, alog, dtb, g_min, G, qn, kn, betan, aqk, tinv, w, u, qg, kg, eg, plan, H,
                   K, V, BKF, BV, DTA, DTC, PREC, SPREC, SOLVE, use_gate, use_l2, use_beta_sigmoid, store_prep,
                   warps):
    """One ``_onepass_kernel`` program per (chunk, head). K <= 128: the [64, K] tiles stay in registers."""
    if BKF > 128:
        raise ValueError(f"KIMIK3_KDA_INTRA=onepass holds [64, K] tiles in registers and supports K <= 128, got K={K}")
    _onepass_kernel[(plan.NT, H)](
        q, k, v, g, beta, alog, dtb, g_min, G, qn, kn, betan, aqk, tinv, w, u, qg, kg, eg,
        plan.cu, plan.chunk_idx, H,
        K=K, V=V, BKF=BKF, BV=BV, DTA=DTA, DTC=DTC, PREC=PREC, SPREC=SPREC, SOLVE=SOLVE,
        USE_GATE=use_gate, USE_L2=use_l2, USE_BETA_SIG=use_beta_sigmoid, STORE_PREP=store_prep, num_warps=warps,
    )

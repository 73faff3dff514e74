"""The chunk-parallel half of a forward alone on 16-token tiles (``dispatch.py``'s "16-token tiles"): everything a
16-token tile needs before the state reaches it, from the layer's raw inputs, in one Triton program per (tile, head).

With chunks of C = 16 tokens the WY form is small enough that a tile needs no sub-tiles: Gamma (the within-tile
cumulative log-decay, fp32) lies in [16 g_min, 0] = [-80, 0] by K3's gate bound, so both e^Gamma and e^-Gamma are
inside fp32 and bf16 range, and the tile's two [16, 16] matrices are each one dense product (the bound's claim):

    Akk = diag(beta) strict_lower((k e^Gamma) (k e^-Gamma)^T),   Aqk = scale lower((q e^Gamma) (k e^-Gamma)^T),
    T   = (I + Akk)^-1 (exactly, by block doubling),              W = T diag(beta) (k e^Gamma),

and the scan (``gluon/scan16.py``) then needs per tile, with S the state entering it:
    v_new = T diag(beta) v - W S,   o = (scale q e^Gamma) S + Aqk v_new,
    S <- e^Gamma_C S + (k e^(Gamma_C - Gamma))^T v_new.

Each program reads its tile of q, k, the gate's input z and beta once (the gate, the L2 norms and beta's sigmoid
fused: the normalised q, k are never rounded to 16 bits on their own) and writes, chunk-major ([NT16, H, 16, D], so
a partial tile's padding rows belong to no other sequence): W, kr = k e^(Gamma_C - Gamma) and qd = scale q e^Gamma
in bf16, e^Gamma_C (fp32, [NT16, H, K]), -T diag(beta) and Aqk's 16-bit high and low parts ([NT16, H, 16, 16] bf16).
Rows past a sequence's end are zero in every output (their q, k load as zero and their beta is zeroed), so they add
nothing to the scan. CI runs it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .prologue import _l2_scale, gate_params
from .triton_common import _chunk_bounds

TILE = 16  # tokens per tile: 16 |g_min| = 80 is the largest log-decay inside one
# num_warps of the prep kernel. Each program is one short dependent chain (norms, cumulative sum, two products, the
# inverse's six, W), so what hides its latency is programs in flight: at 2 warps (141 registers on sm_90) seven CTAs
# fit an SM.
PREP_WARPS = 2


@triton.jit
def _inverse_unit_lower16(a):
    """(I + a)^-1 for a strictly lower-triangular [16, 16] fp32 a, by block doubling (products at tf32x3, about
    fp32): with T_s the inverse of the block-diagonal part on s-blocks and E the part of a inside the 2s-blocks but
    off the s-blocks, T_2s = T_s - T_s E T_s exactly (E T_s E = 0). Four levels, six [16, 16] products."""
    r = tl.arange(0, 16)
    ri, rj = r[:, None], r[None, :]
    t = (ri == rj).to(tl.float32) - tl.where(ri // 2 == rj // 2, a, 0.0)
    for s in tl.static_range(1, 4):
        e = tl.where((ri >> (s + 1) == rj >> (s + 1)) & (ri >> s != rj >> s), a, 0.0)
        t = t - tl.dot(t, tl.dot(e, t, input_precision="tf32x3"), input_precision="tf32x3")
    return t


@triton.jit
def _prep16_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, w_ptr, kr_ptr, qd_ptr, eg_ptr, tb_ptr, ahi_ptr,
                   alo_ptr, cu_ptr, tidx_ptr, H, g_min, scale, K: tl.constexpr, BKF: tl.constexpr,
                   USE_GATE: tl.constexpr, USE_L2: tl.constexpr, USE_BETA_SIG: tl.constexpr, EPS: tl.constexpr,
                   DTA: tl.constexpr):
    """One (16-token tile, head): the module docstring's outputs. DTA: the operand dtype of the Akk, Aqk products
    (bf16 for 16-bit inputs)."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, L = _chunk_bounds(i_t, tidx_ptr, cu_ptr, 16)
    r = tl.arange(0, 16)
    rv = r < L
    c = tl.arange(0, BKF)
    cm = c < K
    m = rv[:, None] & cm[None, :]
    offs = (t0 + r)[:, None] * (H * K) + i_h * K + c[None, :]
    q = tl.load(q_ptr + offs, mask=m, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if USE_L2:
        q = _l2_scale(q, EPS)
        k = _l2_scale(k, EPS)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if USE_GATE:
        rate, dtb = gate_params(alog_ptr, dtb_ptr, i_h, c, cm, K)
        g = g_min * tl.sigmoid(rate * (g + dtb[None, :]))
    gamma = tl.cumsum(tl.where(m, g, 0.0), axis=0)  # rows past the end repeat the last valid row's
    beta = tl.load(beta_ptr + (t0 + r) * H + i_h, mask=rv, other=0.0).to(tl.float32)
    if USE_BETA_SIG:
        beta = tl.sigmoid(beta)
    beta = tl.where(rv, beta, 0.0)
    gamma_c = tl.sum(tl.where((r == L - 1)[:, None], gamma, 0.0), axis=0)  # Gamma at the tile's last valid token
    eg_c = tl.exp(gamma_c)
    e_pos = tl.exp(gamma)  # [e^-80, 1]
    k_neg = k * tl.exp(-gamma)  # |k| e^[0, 80]
    # each operand in 16 bits as soon as it is formed (what the products take and the stores write): fewer live
    # fp32 tiles, more programs per SM
    kr = (k_neg * eg_c[None, :]).to(kr_ptr.dtype.element_ty)
    kd = (k * e_pos).to(DTA)
    qd = (q * e_pos * scale).to(DTA)
    kt = tl.trans(k_neg.to(DTA))
    ri, rj = r[:, None], r[None, :]
    akk = tl.where(ri > rj, tl.dot(kd, kt) * beta[:, None], 0.0)
    aqk = tl.where(ri >= rj, tl.dot(qd, kt), 0.0)
    tb = _inverse_unit_lower16(akk) * beta[None, :]  # T diag(beta)
    w = tl.dot(tb.to(DTA), kd)
    base = (i_t * H + i_h) * 16  # the tile's first row in the chunk-major [NT16 H 16, .] views
    ro = (base + r)[:, None] * K + c[None, :]
    tl.store(w_ptr + ro, w.to(w_ptr.dtype.element_ty), mask=cm[None, :])  # every row: padding rows are zeros
    tl.store(kr_ptr + ro, kr, mask=cm[None, :])
    tl.store(qd_ptr + ro, qd.to(qd_ptr.dtype.element_ty), mask=cm[None, :])
    tl.store(eg_ptr + (i_t * H + i_h) * K + c, eg_c, mask=cm)
    so = (base + r)[:, None] * 16 + rj
    tl.store(tb_ptr + so, (-tb).to(tb_ptr.dtype.element_ty))
    a_hi = aqk.to(ahi_ptr.dtype.element_ty)
    tl.store(ahi_ptr + so, a_hi)
    tl.store(alo_ptr + so, (aqk - a_hi.to(tl.float32)).to(alo_ptr.dtype.element_ty))


def prep16_outputs(tplan, H: int, K: int, device, dtype):
    """The prep's output tensors for a 16-token plan: W, kr, qd ([NT16, H, 16, K] dtype), e^Gamma_C ([NT16, H, K]
    fp32), -T diag(beta), Aqk high, Aqk low ([NT16, H, 16, 16] dtype)."""
    NT = tplan.NT
    w, kr, qd = (torch.empty(NT, H, TILE, K, device=device, dtype=dtype) for _ in range(3))
    eg = torch.empty(NT, H, K, device=device, dtype=torch.float32)
    tb, a_hi, a_lo = (torch.empty(NT, H, TILE, TILE, device=device, dtype=dtype) for _ in range(3))
    return w, kr, qd, eg, tb, a_hi, a_lo


def launch(q, k, g, beta, A_log, dt_bias, outputs, tplan, H: int, K: int, scale: float, g_min: float,
           use_gate: bool, use_l2: bool, use_beta_sigmoid: bool, eps: float, dta=tl.bfloat16) -> None:
    """``_prep16_kernel`` over the plan's tiles; q, k, g (the gate's input z when use_gate, else the log-decay) in
    token layout [B, T, H, K], beta [B, T, H]; outputs: ``prep16_outputs``."""
    w, kr, qd, eg, tb, a_hi, a_lo = outputs
    alog, dtb = (A_log, dt_bias) if use_gate else (eg, eg)
    BKF = triton.next_power_of_2(K)
    _prep16_kernel[(tplan.NT, H)](q, k, g, beta, alog, dtb, w, kr, qd, eg, tb, a_hi, a_lo, tplan.cu, tplan.chunk_idx,
                                  H, float(g_min), float(scale), K=K, BKF=BKF, USE_GATE=use_gate, USE_L2=use_l2,
                                  USE_BETA_SIG=use_beta_sigmoid, EPS=eps, DTA=dta, num_warps=PREP_WARPS)

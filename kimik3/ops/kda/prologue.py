"""Stage 1 of the KDA forward (Triton): the gate / norm prologue, what turns the layer's raw inputs into the chunk
kernels' operands.

Per chunk and head: the optionally fused gate g = g_min * sigmoid(exp(A_log) (z + dt_bias)), the within-chunk
cumulative log-decay Gamma (fp32, token layout), the optional q / k L2 norms and beta's sigmoid (written to side
buffers only when fused). With the L2 norm fused, the gate runs per 64-column block of each chunk (the cumulative sum
runs down each column, so blocks are independent) and the norms over contiguous (token, head) rows, each program
streaming whole rows. The backward of these pre-activations is ``preact_bwd.py`` (or inside ``bwd_intra.py``).
"""

from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl

from .preact import L2_EPS
from .triton_common import _chunk_block, _chunk_part, part_grid

# The norms' kernel: (rows per program, num_warps); the gate's kernel: num_warps.
L2_ROWS_CONFIG: Tuple[int, int] = (64, 4)
GATE_COLS_WARPS = 4


@triton.jit
def _l2_scale(x, EPS: tl.constexpr):
    """x / sqrt(sum_row x^2 + EPS) for an fp32 tile whose rows are tokens."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + EPS)[:, None]


@triton.jit
def _l2_rows(x_ptr, out_ptr, offs, m, EPS: tl.constexpr):
    """``_l2_scale`` of one tile, loaded from x_ptr and stored at out_ptr."""
    x = _l2_scale(tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32), EPS)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _l2_norm_rows_kernel(q_ptr, k_ptr, qn_ptr, kn_ptr, R, K: tl.constexpr, BKF: tl.constexpr, BR: tl.constexpr,
                         EPS: tl.constexpr):
    """``_l2_rows`` over BR contiguous rows of the [R, K] view of q (grid axis 1 = 0) or k (1); R = B T H."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    c = tl.arange(0, BKF)
    m = (rows < R)[:, None] & (c < K)[None, :]
    offs = rows[:, None] * K + c[None, :]
    if tl.program_id(1) == 0:
        _l2_rows(q_ptr, qn_ptr, offs, m, EPS)
    else:
        _l2_rows(k_ptr, kn_ptr, offs, m, EPS)


@triton.jit
def _gate_gamma(g_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K: tl.constexpr, USE_GATE: tl.constexpr):
    """The (optionally fused) gate and the cumulative log-decay Gamma (fp32) of one [64, BK] chunk tile."""
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if USE_GATE:
        a = tl.exp(tl.load(alog_ptr + i_h).to(tl.float32))
        dtb = tl.load(dtb_ptr + i_h * K + c, mask=cm, other=0.0).to(tl.float32)
        g = g_min * tl.sigmoid(a * (g + dtb[None, :]))
        g = tl.where(m, g, 0.0)
    return tl.cumsum(g, axis=0)


@triton.jit
def _gate_cumsum(g_ptr, G_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K: tl.constexpr,
                 USE_GATE: tl.constexpr):
    """``_gate_gamma`` of one chunk tile, stored at G_ptr. (Kept as two functions: inlined into one, ptxas gave
    ``_gate_cols_kernel`` 79 registers instead of 72, six CTAs per SM instead of seven.)"""
    tl.store(G_ptr + offs, _gate_gamma(g_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, USE_GATE), mask=m)


@triton.jit
def gate_params(alog_ptr, dtb_ptr, i_h, cols, cm, K: tl.constexpr):
    """Head i_h's gate parameters, fp32: its rate exp(A_log) and the dt_bias of its key columns cols (mask cm)."""
    rate = tl.exp(tl.load(alog_ptr + i_h).to(tl.float32))
    return rate, tl.load(dtb_ptr + i_h * K + cols, mask=cm, other=0.0).to(tl.float32)


@triton.jit
def _beta_sigmoid(beta_ptr, betan_ptr, t0, r, rv, i_h, H):
    """beta_t -> sigmoid(beta_t) on one chunk's rows (fp32)."""
    bo = (t0 + r) * H + i_h
    b = tl.load(beta_ptr + bo, mask=rv, other=0.0).to(tl.float32)
    tl.store(betan_ptr + bo, tl.sigmoid(b), mask=rv)


@triton.jit
def _prep0_kernel(g_ptr, G_ptr, beta_ptr, betan_ptr, alog_ptr, dtb_ptr, cu_ptr, cidx_ptr, H, g_min,
                  K: tl.constexpr, BKF: tl.constexpr, USE_GATE: tl.constexpr, USE_BETA_SIG: tl.constexpr):
    """One (chunk, head), without the L2 norms: the gate, the cumulative log-decay and beta's sigmoid."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, r, rv, c, cm, m, offs = _chunk_block(i_t, i_h, 0, cidx_ptr, cu_ptr, H, K, BKF)
    _gate_cumsum(g_ptr, G_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, USE_GATE)
    if USE_BETA_SIG:
        _beta_sigmoid(beta_ptr, betan_ptr, t0, r, rv, i_h, H)


@triton.jit
def _gate_cols_kernel(g_ptr, G_ptr, beta_ptr, betan_ptr, alog_ptr, dtb_ptr, cu_ptr, cidx_ptr, H, g_min,
                      K: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr, USE_GATE: tl.constexpr,
                      USE_BETA_SIG: tl.constexpr):
    """The gate and Gamma alone (with the L2 norms fused, ``_l2_norm_rows_kernel`` takes them), one program per
    (chunk, head, BK-column block): the cumulative sum runs down each column, so the blocks are independent; the
    first also takes beta's sigmoid."""
    i_t, i_h, p = _chunk_part(NKB)
    t0, r, rv, c, cm, m, offs = _chunk_block(i_t, i_h, p, cidx_ptr, cu_ptr, H, K, BK)
    _gate_cumsum(g_ptr, G_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, USE_GATE)
    if USE_BETA_SIG:
        if p == 0:
            _beta_sigmoid(beta_ptr, betan_ptr, t0, r, rv, i_h, H)


def launch_prologue(g, G, q, k, qn, kn, beta, betan, alog, dtb, plan, H, K, BKF, BK, g_min, use_gate, use_l2,
                    use_beta_sigmoid):
    """The gate, Gamma, the L2 norms and beta's sigmoid. plan: the forward's ``ChunkPlan``; BKF: K padded to a power
    of two, BK: the column block. With the L2 norms fused, the gate per BK-column block of each chunk
    (``_gate_cols_kernel``) and the norms over contiguous (token, head) rows (``_l2_norm_rows_kernel``); else one
    program per (chunk, head) (``_prep0_kernel``)."""
    NT = plan.NT
    if use_l2:
        nkb = triton.cdiv(K, BK)
        _gate_cols_kernel[part_grid(NT, H, nkb)](
            g, G, beta, betan, alog, dtb, plan.cu, plan.chunk_idx, H, g_min,
            K=K, BK=BK, NKB=nkb, USE_GATE=use_gate, USE_BETA_SIG=use_beta_sigmoid, num_warps=GATE_COLS_WARPS,
        )
        rows, (BR, warps_r) = q.numel() // K, L2_ROWS_CONFIG
        _l2_norm_rows_kernel[(triton.cdiv(rows, BR), 2)](q, k, qn, kn, rows, K=K, BKF=BKF, BR=BR, EPS=L2_EPS,
                                                         num_warps=warps_r)
    else:
        _prep0_kernel[(NT, H)](g, G, beta, betan, alog, dtb, plan.cu, plan.chunk_idx, H, g_min,
                               K=K, BKF=BKF, USE_GATE=use_gate, USE_BETA_SIG=use_beta_sigmoid,
                               num_warps=4 if BKF <= 64 else 8)
